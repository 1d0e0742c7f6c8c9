"""Tool calling end to end: SmolLM2 served with the tool-aware Hermes template and
`--enable-auto-tool-choice --tool-call-parser hermes`, driven by the official openai client.

Greedy decoding on a prompt that asks the model to repeat a call makes it write a `<tool_call>`
block; the server's parsed message is checked against the raw text of the same request with
tool_choice "none", parsed here independently."""

from __future__ import annotations

import json
import os
import re

import openai
import pytest
from server_utils import ServerThread

from quire.config import EngineConfig
from quire.engine.async_engine import AsyncLLM
from quire.engine.metrics import EngineMetrics
from quire.entrypoints.api_server import build_app
from quire.entrypoints.chat_template import load_chat_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERMES_TEMPLATE = os.path.join(ROOT, "examples", "tool_chat_template_hermes.jinja")
MODEL = "smollm2"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = {"role": "user", "content": f"Repeat exactly: {CALL}"}
# Asked once and answered, then asked again: the 135M model copies its own answer. Asked only
# once, its greedy answer hangs on a near-tie, which the summation order of each numeric path
# (C kernels or torch, blocks kept or dequantized) decides its own way.
MESSAGES = [ASK, {"role": "assistant", "content": CALL}, ASK]
GREEDY = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=100)
# The independent reference: a block that holds one JSON object on its own line.
BLOCK = re.compile(r"<tool_call>\n(\{.*\})\n</tool_call>")


@pytest.fixture(scope="module")
def client(default_model):
    config = EngineConfig(model=default_model, max_model_len=512, num_kv_blocks=128)
    engine = AsyncLLM.from_engine_config(config, EngineMetrics(MODEL))
    app = build_app(
        engine, MODEL, chat_template=load_chat_template(HERMES_TEMPLATE), tool_call_parser="hermes"
    )
    server = ServerThread(app)
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def raw_text(client) -> str:
    """What the model writes, unparsed (tool_choice "none")."""
    response = client.chat.completions.create(**GREEDY, tool_choice="none")
    assert response.choices[0].finish_reason == "stop"
    return response.choices[0].message.content


@pytest.fixture(scope="module")
def auto_message(client):
    """The same request parsed (tool_choice defaults to "auto" when tools are given)."""
    return client.chat.completions.create(**GREEDY).choices[0]


def test_the_prompt_makes_the_model_write_a_call(raw_text):
    assert [json.loads(m) for m in BLOCK.findall(raw_text)] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]


def test_auto_returns_the_call_as_tool_calls_and_the_rest_as_content(auto_message, raw_text):
    choice = auto_message
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    expected = json.loads(BLOCK.search(raw_text).group(1))
    assert call.function.name == expected["name"]
    assert json.loads(call.function.arguments) == expected["arguments"]
    assert choice.message.content == (raw_text[: BLOCK.search(raw_text).start()].rstrip() or None)


def test_streamed_deltas_join_to_the_same_message(client, auto_message):
    full = auto_message
    stream = client.chat.completions.create(**GREEDY, stream=True)
    content, calls, finish_reasons = "", {}, []
    for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish_reasons.append(choice.finish_reason)
    assert content == (full.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert finish_reasons[-1] == "tool_calls" and set(finish_reasons[:-1]) == {None}


def test_the_tool_result_goes_back_as_history(client, auto_message):
    first = auto_message.message
    history = MESSAGES + [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "22 C, sunny"},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert response.usage.completion_tokens >= 1
    assert isinstance(response.choices[0].message.content, str)

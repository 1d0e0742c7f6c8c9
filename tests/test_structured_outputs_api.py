"""Structured outputs through the real server and the official openai client, on SmolLM2:
response_format (json_object, json_schema), vLLM's structured_outputs and its deprecated
guided_* spellings, tool_choice "required" and a named function, and the 400s for constraints
xgrammar rejects. Every output is checked independently: json + jsonschema, re.fullmatch, the
choice list. Requests of one test run concurrently, so they share steps."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import xgrammar
from test_api_server import ServerThread

from quire.config import EngineConfig
from quire.engine.async_engine import AsyncLLM
from quire.engine.metrics import EngineMetrics
from quire.entrypoints.api_server import build_app

MODEL = "smollm2"
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["colors"],
    },
    "bounded_integers_and_optionals": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
            "nickname": {"type": "string", "maxLength": 10},
            "active": {"type": "boolean"},
        },
        "required": ["age", "score"],
    },
}
TEMPERATURES = [(0.0, None), (0.7, 7), (1.0, 13)]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["timezone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
# A free JSON object ends, greedy and at (0.7, seed 2) and (1.0, seed 2), on every numerics path
# (AMX tiles, AVX-512 without them, AVX2); "Describe a person as JSON." rambles past 200 tokens
# greedy on AVX2, and at temperature 1.0 for about a fifth of seeds.
ASK_OBJECT = [{"role": "user", "content": "Give a person's name and age as JSON."}]
OBJECT_TEMPERATURES = [(0.0, None), (0.7, 2), (1.0, 2)]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_model):
    config = EngineConfig(model=default_model, max_model_len=1024, num_kv_blocks=512)
    engine = AsyncLLM.from_engine_config(config, EngineMetrics(MODEL))
    server = ServerThread(build_app(engine, MODEL))
    try:
        yield server
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=300)


def concurrently(calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def chat(client, **kwargs):
    return lambda: client.chat.completions.create(model=MODEL, max_tokens=200, **kwargs)


def test_json_schemas_validate_at_every_temperature(client):
    cases = [(name, t, seed) for name in SCHEMAS for t, seed in TEMPERATURES]
    fmt = lambda name: {  # noqa: E731
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }
    responses = concurrently(
        [
            chat(client, messages=ASK, response_format=fmt(name), temperature=t, seed=seed)
            for name, t, seed in cases
        ]
    )
    for (name, _, _), response in zip(cases, responses):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_gives_an_object(client):
    responses = concurrently(
        [
            chat(
                client,
                messages=ASK_OBJECT,
                response_format={"type": "json_object"},
                temperature=t,
                seed=s,
            )
            for t, s in OBJECT_TEMPERATURES
        ]
    )
    # Greedy finishes an object; a sample at temperature 0.7 or 1 may instead run to max_tokens
    # inside one (a string of digits that never closes: seeded, so whether it does depends on
    # the CPU's bf16 sums), never out of it.
    assert responses[0].choices[0].finish_reason == "stop"
    for response in responses:
        content = response.choices[0].message.content
        if response.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert response.choices[0].finish_reason == "length"
            assert json_object_prefix(content), content


def json_object_prefix(text: str) -> bool:
    """Whether `text` starts a JSON object: a "{" that xgrammar's JSON grammar accepts so far."""
    compiled = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo(["{"])
    ).compile_builtin_json_grammar()
    matcher = xgrammar.GrammarMatcher(compiled)
    return text.lstrip().startswith("{") and matcher.accept_string(text)


def test_regex_choice_and_grammar_on_chat_and_completions(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    grammar = 'root ::= sum\nsum ::= num (" + " num)?\nnum ::= [1-9] [0-9]?'
    choices = ["yes", "no", 'it "depends"']
    calls = [
        chat(client, messages=ASK, extra_body={"structured_outputs": {"regex": phone}}),
        chat(client, messages=ASK, temperature=1.0, seed=3, extra_body={"guided_regex": phone}),
        chat(client, messages=ASK, n=3, seed=5, extra_body={"guided_choice": choices}),
        chat(client, messages=ASK, extra_body={"structured_outputs": {"grammar": grammar}}),
        lambda: client.completions.create(
            model=MODEL,
            prompt="Two plus two is",
            max_tokens=50,
            temperature=0.7,
            seed=1,
            extra_body={"structured_outputs": {"choice": choices}},
        ),
        lambda: client.completions.create(
            model=MODEL,
            prompt="A person:",
            max_tokens=200,
            extra_body={"guided_json": SCHEMAS["array_of_enums"]},
        ),
    ]
    regex, regex_sampled, choice, arithmetic, completion_choice, completion_json = concurrently(
        calls
    )
    assert re.fullmatch(phone, regex.choices[0].message.content)
    assert re.fullmatch(phone, regex_sampled.choices[0].message.content)
    assert len(choice.choices) == 3
    assert all(c.message.content in choices for c in choice.choices)
    assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)?", arithmetic.choices[0].message.content)
    assert completion_choice.choices[0].text in choices
    jsonschema.validate(json.loads(completion_json.choices[0].text), SCHEMAS["array_of_enums"])


def test_max_tokens_cuts_a_structure_short_with_length(client):
    fmt = {"type": "json_object"}
    whole, short = concurrently(
        [
            chat(client, messages=ASK_OBJECT, response_format=fmt, temperature=0),
            lambda: client.chat.completions.create(
                model=MODEL, messages=ASK_OBJECT, response_format=fmt, temperature=0, max_tokens=3
            ),
        ]
    )
    assert short.choices[0].finish_reason == "length"
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content.startswith(short.choices[0].message.content)


def assert_calls_validate(calls, names):
    assert [call.function.name for call in calls] == names
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_calls_validate(client):
    responses = concurrently(
        [
            chat(
                client,
                messages=ASK_WEATHER,
                tools=TOOLS,
                tool_choice="required",
                temperature=t,
                seed=seed,
            )
            for t, seed in TEMPERATURES
        ]
        + [
            chat(
                client,
                messages=ASK_WEATHER,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=1.0,
                seed=4,
            )
        ]
    )
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls
        assert calls and all(c.function.name in PARAMETERS for c in calls)
        assert_calls_validate(calls, [c.function.name for c in calls])
    assert len(responses[-1].choices[0].message.tool_calls) == 1


def test_tool_choice_named_calls_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = chat(client, messages=ASK_WEATHER, tools=TOOLS, tool_choice=named)()
    choice = response.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's (and vLLM's) answer for a named choice
    assert_calls_validate(choice.message.tool_calls, ["get_time"])


def streamed_calls(client, **kwargs):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=200, stream=True, **kwargs
    )
    calls: dict[int, dict] = {}
    finish_reason = None
    for chunk in stream:
        choice = chunk.choices[0]
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return [calls[i] for i in sorted(calls)], finish_reason


@pytest.mark.parametrize(
    ("tool_choice", "finish_reason"),
    [
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ],
)
def test_streamed_tool_calls_equal_the_message(client, tool_choice, finish_reason):
    streamed, streamed_finish = streamed_calls(client, tool_choice=tool_choice, temperature=0)
    whole = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        max_tokens=200,
        tool_choice=tool_choice,
        temperature=0,
    ).choices[0]
    assert streamed_finish == whole.finish_reason == finish_reason
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in streamed] == expected
    for name, arguments in expected:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


BAD_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
            'response_format is invalid: Unsupported type "nope"',
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "Regex parsing error"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "EBNF parser"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1 item"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"guided_grammar": "root ::= x"}, "guided_grammar", "guided_grammar is invalid"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
        ({"tools": BAD_TOOLS, "tool_choice": "required"}, "tools", 'Unsupported type "nope"'),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
            "guided_regex",
            "cannot be combined with tool_choice",
        ),
    ],
)
def test_invalid_constraints_get_400_naming_the_field(server, body, param, message):
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]

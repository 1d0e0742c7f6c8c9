"""The OpenAI-compatible server, driven by the official `openai` client over loopback: responses
parse, streaming equals non-streaming, concurrent streams batch, disconnects free their blocks,
and every bad input gets OpenAI's error body with the right status while the server keeps going."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import assert_idle
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerThread, serve_engine, wait_until

from quire import SamplingParams
from quire.config import EngineConfig
from quire.engine.async_engine import AsyncLLM
from quire.entrypoints.cli import build_parser, main
from quire.executor.uniproc import UniprocExecutor

MODEL = "tiny"
API_KEY = "test-key"
NUM_KV_BLOCKS = 1024
MAX_MODEL_LEN = 1024  # the tiny checkpoints' max_position_embeddings
AUTH = {"Authorization": f"Bearer {API_KEY}"}
IGNORE_EOS = {"ignore_eos": True}


@contextlib.contextmanager
def serving(model: str, dtype: str, **app_kwargs) -> Iterator[tuple[ServerThread, AsyncLLM]]:
    config = EngineConfig(model=model, dtype=dtype, num_kv_blocks=NUM_KV_BLOCKS)
    with serve_engine(config, MODEL, **app_kwargs) as server_and_engine:
        yield server_and_engine


@pytest.fixture(scope="module")
def tiny_server(tiny_llama):
    with serving(tiny_llama, "float32", api_key=API_KEY) as server_and_engine:
        yield server_and_engine


@pytest.fixture(scope="module")
def server(tiny_server) -> ServerThread:
    return tiny_server[0]


@pytest.fixture(scope="module")
def engine(tiny_server) -> AsyncLLM:
    return tiny_server[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def metric(server: ServerThread, name: str, **labels: str) -> float:
    """A sample's value from /metrics (0 for a labelled counter not yet incremented)."""
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return 0.0


def assert_idle_with_all_blocks_free(server: ServerThread, engine: AsyncLLM) -> None:
    """The running-requests gauge back at 0, and the idle invariant."""
    assert wait_until(lambda: metric(server, "quire:num_requests_running") == 0)
    assert_idle(engine)


def num_tokens(server: ServerThread, prompt: str) -> int:
    return httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=AUTH).json()[
        "count"
    ]


def stream_text(chunks) -> dict[int, str]:
    """Completion chunks' text, joined per choice index."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


# ---- /v1/models and the small endpoints -------------------------------------------------------
def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "quire"


def test_health_version_and_metrics_need_no_api_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": "0.1.0"}
    text = httpx.get(server.url + "/metrics").text
    names = [
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "request_success_total",
    ]
    assert [n for n in names if f"# TYPE quire:{n.removesuffix('_total')}" not in text] == []


def test_tokenize_and_detokenize_round_trip(server):
    tokens = httpx.post(
        server.url + "/tokenize", json={"prompt": "Hello world"}, headers=AUTH
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(
        server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH
    ).json()
    assert text == {"prompt": "Hello world"}


def test_tokenize_messages_counts_the_chat_prompt(server, client):
    messages = [{"role": "user", "content": "Hi there"}]
    count = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=AUTH).json()[
        "count"
    ]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert response.usage.prompt_tokens == count


# ---- /v1/completions --------------------------------------------------------------------------
def test_completion_returns_text_and_usage(server, client):
    prompt = "The quick brown fox"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body=IGNORE_EOS
    )
    assert response.object == "text_completion"
    assert response.model == MODEL
    (choice,) = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    prompt_tokens = num_tokens(server, prompt)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 7)
    assert response.usage.total_tokens == prompt_tokens + 7


def test_completion_stream_joins_to_the_non_streamed_text(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, seed=5, n=2)
    full = client.completions.create(**kwargs, extra_body=IGNORE_EOS)
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=IGNORE_EOS))
    assert stream_text(chunks) == {c.index: c.text for c in full.choices}
    finishes = [(c.index, c.finish_reason) for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(finishes) == [(0, "length"), (1, "length")]


def test_streamed_multi_byte_characters_are_never_split(client):
    """Random sampling over the whole vocabulary yields many multi-byte characters split across
    tokens; the streamed pieces must join to exactly the full text, with no U+FFFD of their own."""
    texts = []
    for seed in range(3):
        kwargs = dict(model=MODEL, prompt="Text:", max_tokens=48, seed=seed, temperature=1.0)
        full = client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0].text
        streamed = stream_text(client.completions.create(**kwargs, stream=True))[0]
        assert streamed == full
        texts.append(full)
    assert any(len(ch.encode()) > 1 for text in texts for ch in text)


def test_same_seed_gives_the_same_completion_and_n_choices_differ(client):
    kwargs = dict(model=MODEL, prompt="Roses are", max_tokens=12, temperature=1.0, n=2)
    first = client.completions.create(**kwargs, seed=11)
    again = client.completions.create(**kwargs, seed=11)
    other = client.completions.create(**kwargs, seed=12)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert texts != [c.text for c in other.choices]
    assert texts[0] != texts[1]
    assert [c.index for c in first.choices] == [0, 1]


def test_stop_string_cuts_the_text_streamed_or_not(client):
    kwargs = dict(model=MODEL, prompt="Stop here:", max_tokens=20, temperature=0)
    text = client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]

    response = client.completions.create(**kwargs, stop=[stop], extra_body=IGNORE_EOS)
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop

    chunks = list(
        client.completions.create(**kwargs, stop=stop, stream=True, extra_body=IGNORE_EOS)
    )
    pieces = [c.text for ch in chunks for c in ch.choices]
    assert "".join(pieces) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_prompt_lists_and_token_ids_give_one_choice_per_prompt_and_sample(server, client):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello"}, headers=AUTH).json()
    by_text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    by_ids = client.completions.create(
        model=MODEL, prompt=ids["tokens"], max_tokens=5, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text

    many = client.completions.create(
        model=MODEL,
        prompt=[ids["tokens"], ids["tokens"] + ids["tokens"]],
        max_tokens=3,
        n=2,
        extra_body=IGNORE_EOS,
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == 3 * ids["count"]
    assert many.usage.completion_tokens == 4 * 3


def test_completion_logprobs_list_each_token_with_its_top_alternatives(client):
    response = client.completions.create(
        model=MODEL, prompt="Numbers:", max_tokens=6, temperature=0, logprobs=3
    )
    (choice,) = response.choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == response.usage.completion_tokens
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == logprob <= 0.0
        assert 3 <= len(top) <= 4
        assert logprob == max(top.values())  # greedy: the chosen token is the most likely


def test_echo_prepends_the_prompt_and_its_logprobs(client):
    prompt = "Echo this prompt"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    (choice,) = response.choices
    assert choice.text.startswith(prompt)
    num_prompt_tokens = response.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt_tokens + 3
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs[1:])


def test_stream_include_usage_ends_with_a_usage_chunk(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Count:",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
    )
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5


def test_vllm_sampling_extras_are_accepted(client):
    response = client.completions.create(
        model=MODEL,
        prompt="Extras:",
        max_tokens=6,
        extra_body={
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.2,
            "min_tokens": 6,
            "stop_token_ids": [2],
            "skip_special_tokens": True,
        },
    )
    assert response.usage.completion_tokens == 6


# ---- /v1/chat/completions ---------------------------------------------------------------------
def test_chat_completion_answers_as_the_assistant(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi!"},
        ],
        max_completion_tokens=6,
        temperature=0,
        extra_body=IGNORE_EOS,
    )
    assert response.object == "chat.completion"
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 6


def test_chat_text_parts_mean_the_same_as_string_content(client):
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello there"}], **kwargs
    )
    parts = client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
        **kwargs,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_chat_stream_sends_the_role_first_and_finish_reason_last(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=16,
        seed=3,
        n=2,
        extra_body=IGNORE_EOS,
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    for index in (0, 1):
        deltas = [
            (c.delta, c.finish_reason) for ch in chunks for c in ch.choices if c.index == index
        ]
        assert deltas[0][0].role == "assistant"
        assert [finish for _, finish in deltas] == [None] * (len(deltas) - 1) + ["length"]
        text = "".join(delta.content or "" for delta, _ in deltas)
        assert text == full.choices[index].message.content


def test_chat_stream_raw_events_end_with_done(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    assert '"usage":{"prompt_tokens"' in events[-2]


def test_chat_logprobs_give_each_token_and_its_top_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=IGNORE_EOS,
    )
    (choice,) = response.choices
    content = choice.logprobs.content
    assert len(content) == 5
    assert "".join(item.token for item in content) == choice.message.content
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert [top.logprob for top in item.top_logprobs] == sorted(
            (top.logprob for top in item.top_logprobs), reverse=True
        )
        assert len(item.top_logprobs) == 2
        assert item.logprob == item.top_logprobs[0].logprob  # greedy


def test_tool_call_history_with_null_content_renders_and_tool_choice_none_answers(server, client):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = HI + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert response.choices[0].message.tool_calls is None
    count = httpx.post(
        server.url + TOKENIZE, json={"messages": messages, "tools": TOOLS}, headers=AUTH
    ).json()["count"]
    assert response.usage.prompt_tokens == count


def test_multi_turn_history_from_a_response_message_is_accepted(client):
    messages = [{"role": "user", "content": "Hello"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "More"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


# ---- concurrency and disconnects --------------------------------------------------------------
def test_64_concurrent_streams_finish_correctly_in_shared_steps(server, engine, client):
    prompts = [f"Client number {i} writes" for i in range(8)]
    max_tokens = 8
    expected = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    async_client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )

    async def one(i: int) -> tuple[str, str, int]:
        stream = await async_client.completions.create(
            model=MODEL,
            prompt=prompts[i % len(prompts)],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
        text, finish, usage = "", None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, finish, usage

    async def all_clients():
        async with async_client:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 150)

    steps_before = engine.engine.num_steps
    results = asyncio.run(all_clients())
    steps = engine.engine.num_steps - steps_before
    assert results == [(expected[i % len(prompts)], "length", max_tokens) for i in range(64)]
    # One at a time, 64 requests of 8 tokens take 512 steps.
    assert steps <= 64 * max_tokens // 4
    assert_idle_with_all_blocks_free(server, engine)


def test_clients_that_disconnect_have_their_requests_aborted(server, engine):
    long_request = {"model": MODEL, "max_tokens": 900, "ignore_eos": True, "stream": True}
    bodies = [
        ("/v1/completions", {**long_request, "prompt": "Disconnect soon"}),
        ("/v1/completions", {**long_request, "prompt": ["Two prompts", "at once"], "n": 2}),
        ("/v1/chat/completions", {**long_request, "messages": [{"role": "user", "content": "Hi"}]}),
    ]
    aborted_before = metric(server, "quire:request_success_total", finished_reason="abort")
    for path, body in bodies:
        with httpx.stream("POST", server.url + path, json=body, headers=AUTH) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
            assert metric(server, "quire:num_requests_running") > 0
    with pytest.raises(httpx.ReadTimeout):
        body = {"model": MODEL, "prompt": "Wait", "max_tokens": 900, "ignore_eos": True}
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
    assert_idle_with_all_blocks_free(server, engine)
    aborted = metric(server, "quire:request_success_total", finished_reason="abort")
    assert aborted == aborted_before + 5


def test_an_engine_failure_fails_only_the_live_requests(server, engine, client, monkeypatch):
    assert_idle_with_all_blocks_free(server, engine)  # the loop thread waits: safe to patch
    execute = UniprocExecutor.submit
    failures = [RuntimeError("simulated kernel failure")] * 2

    def fail_twice(executor, scheduler_output):
        if failures:
            raise failures.pop()
        return execute(executor, scheduler_output)

    monkeypatch.setattr(UniprocExecutor, "submit", fail_twice)
    with pytest.raises(openai.InternalServerError, match="simulated kernel failure"):
        client.completions.create(model=MODEL, prompt="Fail", max_tokens=4)
    stream = client.completions.create(model=MODEL, prompt="Fail", max_tokens=4, stream=True)
    with pytest.raises(openai.APIError, match="simulated kernel failure"):
        list(stream)
    response = client.completions.create(
        model=MODEL, prompt="Fine", max_tokens=4, extra_body=IGNORE_EOS
    )
    assert response.usage.completion_tokens == 4
    assert_idle_with_all_blocks_free(server, engine)


# ---- bad input --------------------------------------------------------------------------------
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TOKENIZE = "/tokenize"
HI = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
UNKNOWN_NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "unknown_field": 1}, "unknown_field"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 50}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"49152": 1}}, "logit_bias"),
        (CHAT, {"messages": HI, "logit_bias": {"token": 1}}, "logit_bias.token"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        (COMPLETIONS, {"prompt": "word " * 1100}, "prompt"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": [1, 10**6]}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages.0.role"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
        (CHAT, {"messages": [{"role": "tool", "content": "22 C"}]}, "messages.0.tool_call_id"),
        (CHAT, {"messages": [{"role": "tool", "tool_call_id": "c1"}]}, "messages.0.content"),
        (
            CHAT,
            {"messages": [{"role": "tool", "tool_call_id": "c1", "content": None}]},
            "messages.0.content",
        ),
        (COMPLETIONS, {"prompt": "x", "guided_choice": []}, "guided_choice"),
        (
            COMPLETIONS,
            {"prompt": "x", "structured_outputs": {"choice": []}},
            "structured_outputs.choice",
        ),
        (CHAT, {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"messages": HI, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": HI, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        (CHAT, {"messages": HI, "tools": TOOLS}, "tool_choice"),  # auto is off on this server
        (CHAT, {"messages": HI, "tools": TOOLS, "tool_choice": UNKNOWN_NAMED}, "tool_choice"),
        (CHAT, {"messages": HI, "tool_choice": "auto"}, "tool_choice"),
        (CHAT, {"messages": HI, "tools": [{"type": "function"}]}, "tools.0.function"),
        (TOKENIZE, {"messages": []}, "messages"),
        (TOKENIZE, {}, "prompt"),
        (TOKENIZE, {"prompt": "Hi", "messages": HI}, "prompt"),
    ],
)
def test_invalid_values_get_400_and_the_server_keeps_answering(server, client, path, body, param):
    response = httpx.post(server.url + path, json={"model": MODEL, **body}, headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]"])
def test_malformed_bodies_get_400(server, raw):
    headers = {**AUTH, "Content-Type": "application/json"}
    response = httpx.post(server.url + COMPLETIONS, content=raw, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "x", "temperature": Infinity}',
        b'{"prompt": "x", "temperature": -Infinity}',
        b'{"prompt": "x", "top_p": NaN}',
        b'{"prompt": "x", "temperature": 1e999}',
        b'{"prompt": "x", "guided_json": {"type": "number", "maximum": Infinity}}',
    ],
)
def test_numbers_that_are_not_finite_get_400_anywhere_in_the_body(server, raw):
    headers = {**AUTH, "Content-Type": "application/json"}
    response = httpx.post(server.url + COMPLETIONS, content=raw, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("The request body is not valid JSON: ")
    assert error["message"].endswith(": send finite numbers")


def test_openai_client_raises_bad_request_with_the_param(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == "temperature"


def test_unknown_model_gets_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4", messages=HI)
    assert raised.value.body["code"] == "model_not_found"
    assert raised.value.body["param"] == "model"


def test_wrong_api_key_gets_401(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        client.models.list()
    assert raised.value.body["code"] == "invalid_api_key"


def test_missing_api_key_gets_401_on_every_api_route(server):
    for method, path in [("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", "/tokenize")]:
        response = httpx.request(method, server.url + path, json={"prompt": "x"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_auth_scheme_is_case_insensitive(server, scheme):
    headers = {"Authorization": f"{scheme} {API_KEY}"}
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 200


@pytest.mark.parametrize(
    "authorization", [f"Basic {API_KEY}", API_KEY, f"Bearer {API_KEY}x", "Bearer", ""]
)
def test_another_scheme_or_key_gets_401(server, authorization):
    response = httpx.get(server.url + "/v1/models", headers={"Authorization": authorization})
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_openapi_documents_the_api_key_on_every_route_that_needs_it(server):
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    assert schema["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}
    }
    for path, operations in schema["paths"].items():
        (operation,) = operations.values()
        if path in ("/health", "/ready", "/metrics", "/version"):
            assert "401" not in operation["responses"] and "security" not in operation
        else:
            assert "401" in operation["responses"] and operation["security"] == [{"bearer": []}]


def test_a_server_without_api_key_is_open(tiny_llama):
    with serving(tiny_llama, "float32") as (server, _):
        response = httpx.post(
            server.url + COMPLETIONS, json={"model": MODEL, "prompt": "x", "max_tokens": 2}
        )
        assert response.status_code == 200


# ---- the real model: emoji and CJK ------------------------------------------------------------
def test_emoji_and_cjk_stream_whole(default_model):
    """SmolLM2 writes 🤖 as three byte tokens and CJK characters as several; every streamed
    piece must hold whole characters and the pieces must join to the non-streamed text."""
    requests = [
        [{"role": "user", "content": "Write the robot emoji 🤖 three times."}],
        [{"role": "user", "content": "Translate 'hello world' to Chinese."}],
    ]
    with serving(default_model, "auto") as (server, _):
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)

        async def full(messages):
            response = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0
            )
            return response.choices[0].message.content

        async def pieces(messages):
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
            )
            return [c.delta.content async for ch in stream for c in ch.choices if c.delta.content]

        async def both():
            async with client:
                jobs = [full(m) for m in requests] + [pieces(m) for m in requests]
                return await asyncio.wait_for(asyncio.gather(*jobs), 240)

        emoji_text, cjk_text, emoji_pieces, cjk_pieces = asyncio.run(both())
    assert "🤖" in emoji_text
    assert any("\u4e00" <= ch <= "\u9fff" for ch in cjk_text)
    for text, streamed in [(emoji_text, emoji_pieces), (cjk_text, cjk_pieces)]:
        assert "".join(streamed) == text
        assert "\ufffd" not in text and not any("\ufffd" in piece for piece in streamed)


# ---- `quire serve` ----------------------------------------------------------------------------
def test_serve_defaults_to_loopback_port_8000_and_no_key():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.served_model_name) == (
        "127.0.0.1",
        8000,
        None,
        None,
    )


def test_quire_serve_refuses_a_port_in_use_before_loading_the_model(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        start = time.perf_counter()
        assert main(["serve", "--port", str(port)]) == 2
    assert time.perf_counter() - start < 1.0  # the default model takes seconds to load
    assert capsys.readouterr().err == (
        f"error: Cannot listen at 127.0.0.1:{port} (Address already in use): stop what holds "
        "the port or pass another --port (and as --host, an address of this machine).\n"
    )


def test_quire_serve_answers_the_openai_client_and_logs_each_request(tiny_llama, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path / "serve.log", "w+")
    command = [sys.executable, "-m", "quire.entrypoints.cli", "serve", tiny_llama]
    command += ["--port", str(port), "--served-model-name", MODEL, "--api-key", API_KEY]
    command += ["--num-kv-blocks", str(NUM_KV_BLOCKS)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert process.poll() is None, open(tmp_path / "serve.log").read()
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(healthy, timeout=90), open(tmp_path / "serve.log").read()
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        response = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        assert response.usage.completion_tokens <= 3
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    log.seek(0)
    assert f"Finished request {response.id}" in log.read()


def test_sampling_params_mapping_keeps_openai_defaults():
    from quire.entrypoints.openai_protocol import CompletionRequest

    params = CompletionRequest(prompt="x").to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (16, 1.0, 1.0, 1)
    assert params == SamplingParams(max_tokens=16)

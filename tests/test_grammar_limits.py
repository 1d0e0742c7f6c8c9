"""Structured outputs at the server, bounded: a schema with no finite output is a 400 naming
its field before anything is queued, a constraint that compiles too long is a 400, and while a
large grammar compiles, other clients' requests keep their speed (xgrammar compiles on one
thread at a low CPU priority and releases the GIL: never on the event loop, never in the
engine's step, never ahead of the engine's threads)."""

from __future__ import annotations

import statistics
import threading
import time

import pytest
from server_utils import serve_engine, wait_until

from quire.config import EngineConfig

SMALL = {"prompt": "Hi", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}


def enum_schema(num_members: int, tag: str) -> dict:
    return {"enum": [f"{tag}-member-{i}" for i in range(num_members)]}


@pytest.fixture(scope="module")
def served(tiny_llama):
    config = EngineConfig(model=tiny_llama, dtype="float32", num_kv_blocks=256)
    # The large grammar compiles at a low priority: on a loaded machine it can take minutes.
    with serve_engine(config, grammar_compile_timeout=600) as server_and_engine:
        yield server_and_engine


@pytest.mark.parametrize(
    ("field", "constraint"),
    [
        ("structured_outputs", {"structured_outputs": {"json": CYCLE}}),
        ("guided_json", {"guided_json": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}}),
        (
            "response_format",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "t",
                        "schema": {"$ref": "#/$defs/t", "$defs": {"t": {"$ref": "#/$defs/t"}}},
                    },
                }
            },
        ),
    ],
)
def test_a_schema_with_no_finite_output_gets_400_naming_the_field(served, field, constraint):
    server, engine = served
    response = server.post("/v1/completions", json={"prompt": "Hi", **constraint})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"] == (
        f"{field} is invalid: no finite output matches it: the schema's $refs refer to each "
        "other with no way to end (a required self-reference, or a cycle); make the recursion "
        "optional."
    )
    assert not engine.engine.has_unfinished_requests()


def test_a_constraint_not_compiled_within_the_limit_gets_400(tiny_llama):
    config = EngineConfig(model=tiny_llama, dtype="float32", num_kv_blocks=64)
    with serve_engine(config, grammar_compile_timeout=0.01) as (server, engine):
        body = {"prompt": "Hi", "guided_json": enum_schema(5000, "slow")}
        response = server.post("/v1/completions", json=body)
        assert response.status_code == 400
        assert response.json()["error"] == {
            "message": "guided_json was not compiled within this server's limit of 0.01 s "
            "(--grammar-compile-timeout): simplify it (fewer enum members or alternatives, less "
            "nesting).",
            "type": "invalid_request_error",
            "param": "guided_json",
            "code": "grammar_compile_timeout",
        }
        assert not engine.engine.has_unfinished_requests()


def test_a_small_request_stays_fast_while_a_large_grammar_compiles(served):
    server, engine = served

    def small_request_s() -> float:
        start = time.perf_counter()
        assert server.post("/v1/completions", json=SMALL).status_code == 200
        return time.perf_counter() - start

    small_request_s()  # warm
    idle = statistics.median(small_request_s() for _ in range(5))
    compiler = engine.engine.grammar_compiler
    num_compiled = compiler.num_compiled
    answers = []
    large = {"prompt": "Hi", "max_tokens": 4, "guided_json": enum_schema(10000, "large")}
    thread = threading.Thread(
        target=lambda: answers.append(server.post("/v1/completions", json=large))
    )
    thread.start()
    busy = []
    while compiler.num_compiled == num_compiled:  # time small requests while it compiles
        busy.append(small_request_s())
    thread.join()
    assert answers[0].status_code == 200
    assert statistics.median(busy) < 3 * idle, (idle, busy)


def test_a_grammar_that_min_tokens_keeps_from_ending_stops_with_an_openai_reason(served):
    """After "a" the grammar allows only EOS, which min_tokens bans: nothing is allowed, and the
    output stops with "stop"; the forbidden token that ends it has a logprob of -inf, sent as
    vLLM's -9999.0 (JSON has no infinity)."""
    server, engine = served
    constrained = {
        "max_tokens": 8,
        "min_tokens": 3,
        "temperature": 0,
        "structured_outputs": {"grammar": 'root ::= "a"'},
    }
    completion = server.post("/v1/completions", json={"prompt": "Hi", "logprobs": 0, **constrained})
    assert completion.status_code == 200, completion.text
    (choice,) = completion.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("a", "stop")
    assert choice["logprobs"]["token_logprobs"][-1] == -9999.0
    chat = server.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, **constrained},
    )
    assert chat.status_code == 200, chat.text
    (choice,) = chat.json()["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("a", "stop")
    assert choice["logprobs"]["content"][-1]["logprob"] == -9999.0
    assert wait_until(lambda: not engine.engine.has_unfinished_requests())

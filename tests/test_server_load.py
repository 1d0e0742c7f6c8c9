"""The server under hostile and heavy load: huge prompts never stall other clients or /health,
oversized bodies get 413 unparsed, a full queue gets 503 with Retry-After, deadlines abort, and a
soak of mixed clients leaves the server idle with every KV block free and its memory flat.
Every server here listens on loopback only."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import assert_idle
from server_utils import ServerThread, wait_until

from quire.config import EngineConfig
from quire.engine.async_engine import AsyncLLM
from quire.engine.metrics import EngineMetrics
from quire.entrypoints.api_server import build_app
from quire.entrypoints.cli import build_parser
from quire.entrypoints.tokenizer_pool import LONG_CALL_SIZE, TokenizerPool
from quire.model.tokenizer import load_tokenizer

MODEL = "tiny"
MAX_MODEL_LEN = 8192  # the long-context tiny model's max_position_embeddings = the KV pool
NUM_KV_BLOCKS = MAX_MODEL_LEN // 16
MAX_NUM_SEQS = 4
LONG = {"max_tokens": MAX_MODEL_LEN // 2, "ignore_eos": True}  # far longer than tests wait


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory, build_model) -> str:
    path = tmp_path_factory.mktemp("long") / "llama"
    return build_model(str(path), "llama", max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def engine(long_context_model) -> Iterator[AsyncLLM]:
    config = EngineConfig(
        model=long_context_model,
        dtype="float32",
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=MAX_NUM_SEQS,
    )
    engine = AsyncLLM.from_engine_config(config, EngineMetrics(MODEL))
    assert engine.max_model_len == MAX_MODEL_LEN
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def serving(engine) -> Callable[..., contextlib.AbstractContextManager[ServerThread]]:
    """serving(**build_app limits): a server for `engine` with those limits."""

    @contextlib.contextmanager
    def serve(**limits) -> Iterator[ServerThread]:
        server = ServerThread(build_app(engine, MODEL, **limits))
        try:
            yield server
        finally:
            server.stop()

    return serve


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


# ---- a responsive server -----------------------------------------------------------------------
# Posts {"prompt": "hi " * n} for each n in argv[2] (JSON) to argv[1], all at once, and prints
# the [status, body] of each: the hostile clients, in their own process so that they do not
# compete for this process's GIL with the server under test.
_SEND_PROMPTS = """
import json, sys, threading, urllib.error, urllib.request
url, repeats = sys.argv[1], json.loads(sys.argv[2])
answers = [None] * len(repeats)
def send(i):
    body = json.dumps({"prompt": "hi " * repeats[i]}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answers[i] = [response.status, json.load(response)]
    except urllib.error.HTTPError as error:
        answers[i] = [error.code, json.load(error)]
threads = [threading.Thread(target=send, args=(i,)) for i in range(len(repeats))]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(answers))
"""


def test_health_and_a_small_completion_answer_while_huge_prompts_are_handled(
    engine, serving, long_context_model
):
    tokenizer = load_tokenizer(long_context_model)
    max_token_chars = max(len(t) for t in tokenizer.get_vocab())
    max_prompt_chars = MAX_MODEL_LEN * max_token_chars
    over_the_bound = max_prompt_chars // 3 + 1000  # repeats of "hi ": rejected untokenized
    under_the_bound = max_prompt_chars // 3 - 1000  # tokenized, then rejected
    num_tokens = len(tokenizer.encode("hi " * under_the_bound))
    max_request_bytes = 3 * over_the_bound + 1000
    repeats = [over_the_bound] * 3 + [under_the_bound]
    with serving(max_request_bytes=max_request_bytes) as server, httpx.Client() as prober:
        small = {"prompt": "hi", "max_tokens": 2}

        def time_small_completion() -> float:
            start = time.perf_counter()
            assert prober.post(server.url + "/v1/completions", json=small).status_code == 200
            return time.perf_counter() - start

        time_small_completion()  # the engine's first step is its slowest
        # What the host's own load costs a small completion (other processes share its cores).
        quiet_latency = max(time_small_completion() for _ in range(5))
        senders = subprocess.Popen(
            [sys.executable, "-c", _SEND_PROMPTS, server.url + "/v1/completions"]
            + [json.dumps(repeats)],
            stdout=subprocess.PIPE,
        )
        health_latencies, completion_latencies = [], []
        while senders.poll() is None:
            start = time.perf_counter()
            assert prober.get(server.url + "/health").status_code == 200
            health_latencies.append(time.perf_counter() - start)
            completion_latencies.append(time_small_completion())
        answers = json.loads(senders.stdout.read())

    assert len(health_latencies) >= 3  # the probes ran while the long prompt was tokenized
    assert max(health_latencies) < 0.5
    assert max(completion_latencies) < quiet_latency + 0.5  # 0.5 s on a quiet host
    for _, body in answers[:3]:
        assert body["error"]["message"] == (
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens, and the prompt has "
            f"{3 * over_the_bound} characters, more than {MAX_MODEL_LEN} tokens can hold (at "
            f"most {max_token_chars} characters each): shorten the prompt."
        )
    assert answers[3][1]["error"]["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens, and the prompt has "
        f"{num_tokens}: shorten the prompt."
    )
    assert {status for status, _ in answers} == {400}
    assert {body["error"]["code"] for _, body in answers} == {"context_length_exceeded"}
    assert_idle(engine)


def test_the_event_loop_keeps_running_while_the_pool_tokenizes(long_context_model):
    tokenizer = load_tokenizer(long_context_model)
    pool = TokenizerPool(tokenizer, MAX_MODEL_LEN)
    text = "hi " * 300_000

    async def ticks_during_encode() -> tuple[list[float], list[int]]:
        encoding = asyncio.ensure_future(pool.run(len(text), tokenizer.encode, text))
        gaps, last = [], time.perf_counter()
        while not encoding.done():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        return gaps, encoding.result()

    try:
        gaps, token_ids = asyncio.run(ticks_during_encode())
    finally:
        pool.shutdown()
    assert token_ids == tokenizer.encode(text)
    assert len(gaps) >= 10  # the loop ticked all along the encode...
    assert max(gaps) < 0.25  # ...never stopped for long (the GIL is released)


def test_a_short_call_does_not_wait_behind_long_ones(long_context_model):
    pool = TokenizerPool(load_tokenizer(long_context_model), MAX_MODEL_LEN)
    release = threading.Event()

    async def short_call_while_the_long_lane_is_busy() -> str:
        long_calls = [pool.run(LONG_CALL_SIZE + 1, release.wait) for _ in range(3)]
        blocked = asyncio.gather(*long_calls)
        answer = await asyncio.wait_for(pool.run(LONG_CALL_SIZE, str, "short"), timeout=10)
        release.set()
        await blocked
        return answer

    try:
        assert asyncio.run(short_call_while_the_long_lane_is_busy()) == "short"
    finally:
        release.set()
        pool.shutdown()


# ---- request size --------------------------------------------------------------------------
def test_a_body_over_the_limit_gets_413_before_it_is_parsed(engine, serving):
    with serving(max_request_bytes=1000) as server:
        response = server.post(
            "/v1/completions", content=b"{" * 1001, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 413  # not 400: the malformed JSON was never parsed
        assert error_of(response) == {
            "message": "The request body is larger than this server's limit of 1000 bytes "
            "(--max-request-bytes): send a shorter prompt.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
    assert_idle(engine)


def test_a_chunked_body_over_the_limit_gets_413(engine, serving):
    body = json.dumps({"prompt": "hi " * 1000}).encode()
    chunks = (body[i : i + 100] for i in range(0, len(body), 100))  # no Content-Length
    with serving(max_request_bytes=1000) as server:
        response = server.post(
            "/v1/completions", content=chunks, headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"
    assert_idle(engine)


def test_a_body_at_the_limit_is_served(serving):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    with serving(max_request_bytes=len(body)) as server:
        response = server.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 200


def test_a_body_not_received_within_the_timeout_gets_408_and_is_dropped(engine, serving):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    with serving(request_body_timeout=0.5) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(head + b'{"prompt": "hi"')  # 15 of the 100 bytes it declared
            answer = b""
            while chunk := sock.recv(65536):  # until the server closes the connection
                answer += chunk
            elapsed = time.monotonic() - start
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout"
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"] == {
        "message": "The request body was not received within this server's limit of 0.5 s "
        "(--request-body-timeout): send the whole body at once, as long as its Content-Length "
        "says.",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_timeout",
    }
    assert 0.5 <= elapsed < 5
    assert_idle(engine)


# ---- the admission queue -------------------------------------------------------------------
def test_a_full_queue_gets_503_with_retry_after_and_not_ready(engine, serving):
    capacity = MAX_NUM_SEQS + 1
    with serving(max_queued_requests=1) as server, httpx.Client(timeout=60) as client:
        with contextlib.ExitStack() as streams:
            for _ in range(capacity):  # each returns once its request is in the engine
                body = {"prompt": "hi", "stream": True, **LONG}
                stream = client.stream("POST", server.url + "/v1/completions", json=body)
                assert streams.enter_context(stream).status_code == 200
            response = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert response.status_code == 503
            assert response.headers["Retry-After"] == "1"
            assert error_of(response) == {
                "message": f"The server is busy: {capacity} requests are already running or "
                "queued. Retry after 1 s.",
                "type": "server_error",
                "param": None,
                "code": "server_busy",
            }
            assert client.get(server.url + "/ready").status_code == 503
            assert client.get(server.url + "/health").status_code == 200
        assert wait_until(lambda: client.get(server.url + "/ready").status_code == 200)
    assert_idle(engine)


def test_the_default_queue_holds_at_least_a_batch(engine, serving):
    with serving() as server:
        assert server.server.config.app.state.admission.capacity == 2 * MAX_NUM_SEQS


# ---- deadlines -----------------------------------------------------------------------------
def test_a_request_past_its_timeout_gets_504_and_is_aborted(engine, serving):
    with serving() as server:
        start = time.monotonic()
        response = server.post("/v1/completions", json={"prompt": "hi", "timeout": 0.2, **LONG})
        elapsed = time.monotonic() - start
    assert response.status_code == 504
    assert error_of(response) == {
        "message": "The request did not finish within its timeout of 0.2 s and was aborted: "
        "raise `timeout` or lower max_tokens.",
        "type": "server_error",
        "param": "timeout",
        "code": "request_timeout",
    }
    assert elapsed < 5
    assert_idle(engine)


def test_a_stream_past_its_timeout_ends_with_an_error_event(engine, serving):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "timeout": 0.2}
    with serving() as server:
        response = server.post("/v1/chat/completions", json={**body, **LONG})
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert_idle(engine)


def test_the_server_request_timeout_caps_a_longer_request_timeout(engine, serving):
    with serving(request_timeout=0.2) as server:
        response = server.post("/v1/completions", json={"prompt": "hi", "timeout": 60, **LONG})
    assert response.status_code == 504
    assert error_of(response) == {
        "message": "The request did not finish within this server's request timeout of 0.2 s "
        "and was aborted: lower max_tokens.",
        "type": "server_error",
        "param": None,
        "code": "request_timeout",
    }
    assert_idle(engine)


def test_a_timeout_that_is_not_positive_gets_400(serving):
    with serving() as server:
        response = server.post("/v1/completions", json={"prompt": "hi", "timeout": 0})
    assert response.status_code == 400
    assert error_of(response)["param"] == "timeout"


def test_serve_parses_the_load_limits():
    args = build_parser().parse_args(
        ["serve", "--max-request-bytes", "1000", "--max-queued-requests", "3"]
        + ["--request-timeout", "2.5", "--request-body-timeout", "1.5"]
    )
    assert (args.max_request_bytes, args.max_queued_requests, args.request_timeout) == (
        1000,
        3,
        2.5,
    )
    assert args.request_body_timeout == 1.5
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.max_request_bytes, defaults.max_queued_requests) == (4 * 2**20, None)
    assert defaults.request_timeout is None
    assert defaults.request_body_timeout == 5.0


# ---- the soak ------------------------------------------------------------------------------
def _soak_module():
    path = Path(__file__).parent.parent / "scripts" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_soak_of_mixed_clients_leaves_the_server_idle_with_flat_memory(tiny_llama, tmp_path):
    soak = _soak_module()
    result = soak.run_soak(
        tiny_llama,
        duration=25,
        rate=12,
        log_path=str(tmp_path / "server.log"),
        server_args=soak.SERVER_ARGS + ("--num-kv-blocks", "1024"),
    )
    print(result.report())
    assert result.unexpected == []
    assert result.num_requests >= 250
    for kind, statuses in result.statuses.items():  # every kind was served, not only turned away
        assert sum(n for status, n in statuses.items() if status != 503) > 0, kind
    assert result.final_gauges == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    assert result.rss_growth < 0.03

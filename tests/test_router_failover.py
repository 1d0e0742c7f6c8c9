"""`quire router` when an instance dies: a request that has not streamed a byte yet is retried
on another instance of the same role (the answer is the one that instance gives), the dead
instance is left out of routing from then on, and when none is left the client gets a 502 that
names every instance tried. Every block on the surviving instances is free afterwards. An instance
going down, coming back and each retry are logged in quire's format; polls are not."""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from conftest import assert_idle
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from server_utils import (
    ServerThread,
    completion_text,
    router_retries,
    serve_engine,
    wait_until,
)

from quire.config import EngineConfig
from quire.executor.multiproc import free_port
from quire.router.app import Router, build_router_app
from quire.router.policies import Instance

MODEL = "tiny"


def serving(model: str, **kwargs):
    settings = dict(dtype="float32", block_size=16, max_num_batched_tokens=24, num_kv_blocks=32)
    return serve_engine(EngineConfig(model=model, **{**settings, **kwargs}))


@pytest.fixture(scope="module")
def instances(tiny_llama):
    with (
        serving(tiny_llama, disaggregation_mode="prefill", kv_lease_timeout=1.0) as prefill,
        serving(tiny_llama, disaggregation_mode="decode", kv_transfer_timeout=2.0) as decode,
    ):
        yield prefill, decode


LOAD = {"num_running": 0, "num_waiting": 3, "disaggregation_mode": None, "kv_endpoint": None}


class DyingInstance:
    """An instance that answers the router's /load polls (3 waiting), but dies holding every
    request it is sent: it reads the request and closes the connection unanswered. After
    `close()` nothing listens: connections are refused."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        load = json.dumps(LOAD).encode()
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                if conn.recv(65536).startswith(b"GET /load"):
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(load), load)
                    )
                else:
                    self.requests += 1

    def close(self) -> None:
        self.sock.close()


def dies_before_its_first_event() -> FastAPI:
    """An instance that answers /load, and a completion with 200 and its headers, then dies
    before any event."""
    app = FastAPI()

    @app.get("/load")
    async def load() -> dict:
        return LOAD

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def events():
            raise RuntimeError("killed")
            yield b""

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def router_over():
    """Starts a router over the instances and returns once it polled the `dying` ones (the
    first poll is at start, the next a minute later: the tests see only failures that requests
    meet)."""
    servers = []

    def start(instances: list[Instance], dying: list[str]) -> ServerThread:
        server = ServerThread(build_router_app(Router(instances, "round_robin", 60.0)))
        servers.append(server)
        assert wait_until(lambda: all(i.polled_load == 3 for i in instances if i.url in dying))
        return server

    yield start
    for server in servers:
        server.stop()


def body(prompt: list[int], **kwargs) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kwargs}


PROMPT = [(31 * j) % 40000 + 10 for j in range(20)]


def test_a_refused_instance_is_retried_elsewhere_then_left_out(instances, router_over, caplog):
    _, (decode_server, decode) = instances
    expected = completion_text(decode_server.url, body(PROMPT))
    dead = DyingInstance()
    # no prefill instance: the decode instances compute whole requests
    router = router_over(
        [Instance(dead.url, "decode"), Instance(decode_server.url, "decode")], [dead.url]
    )
    dead.close()
    with caplog.at_level(logging.INFO, logger="quire.router"):
        assert [completion_text(router.url, body(PROMPT)) for _ in range(3)] == [expected] * 3
    assert router_retries(router.url, "decode") == 1  # only the first request met the dead instance
    # the reason: refused, or dropped while the socket closed (the router's records only: an
    # earlier test may have left the engine's loggers at INFO)
    down, retry = [r for r in caplog.records if r.name.startswith("quire.router")]
    assert (down.levelname, retry.levelname) == ("WARNING", "INFO")
    assert re.fullmatch(
        f"The decode instance {dead.url} is down \\((ConnectError|RemoteProtocolError|ReadError): "
        ".*\\): "
        "routing around it until its /load answers",
        down.getMessage(),
    )
    assert retry.getMessage() == (
        f"Retrying a request on the decode instance {decode_server.url} ({dead.url} failed)"
    )
    load = httpx.get(router.url + "/load").json()["instances"]
    assert [(i["url"], i["healthy"]) for i in load] == [
        (dead.url, False),
        (decode_server.url, True),
    ]
    assert_idle(decode)


def test_a_dropped_connection_before_any_byte_is_retried_once(instances, router_over):
    _, (decode_server, decode) = instances
    expected = completion_text(decode_server.url, body(PROMPT, stream=True))
    dying = DyingInstance()
    try:
        router = router_over(
            [Instance(dying.url, "decode"), Instance(decode_server.url, "decode")], [dying.url]
        )
        assert completion_text(router.url, body(PROMPT, stream=True)) == expected
        assert completion_text(router.url, body(PROMPT, stream=True)) == expected
    finally:
        dying.close()
    assert dying.requests == 1  # marked down at once: the second request went straight on
    assert_idle(decode)


def test_a_stream_that_dies_before_its_first_event_is_retried(instances, router_over):
    _, (decode_server, decode) = instances
    expected = completion_text(decode_server.url, body(PROMPT, stream=True))
    dying = ServerThread(dies_before_its_first_event())
    try:
        router = router_over(
            [Instance(dying.url, "decode"), Instance(decode_server.url, "decode")], [dying.url]
        )
        assert completion_text(router.url, body(PROMPT, stream=True)) == expected
    finally:
        dying.stop()
    assert router_retries(router.url, "decode") == 1
    assert_idle(decode)


def test_no_instance_left_is_a_502_naming_every_instance_tried(router_over):
    first, second = DyingInstance(), DyingInstance()
    router = router_over(
        [Instance(first.url, "collocated"), Instance(second.url, "collocated")],
        [first.url, second.url],
    )
    first.close()
    second.close()
    response = httpx.post(router.url + "/v1/completions", json=body(PROMPT), timeout=30)
    assert response.status_code == 502
    assert response.json()["error"]["message"] == (
        f"No collocated instance answered (tried {first.url}, {second.url})."
    )


def test_a_dead_decode_instance_after_the_prefill_leaves_the_request_to_another(
    instances, router_over
):
    """The prefill instance computed the prompt and leased its KV; the decode instance it was
    meant for is gone, so another decode instance computes the whole request (same tokens),
    and the unpulled lease runs out (1 s) and frees the prefill instance's blocks."""
    (prefill_server, prefill), (decode_server, decode) = instances
    expected = completion_text(decode_server.url, body(PROMPT, ignore_eos=True))
    kv_port = prefill.engine.quire_config.kv_transfer.port
    dead = DyingInstance()
    router = router_over(
        [
            Instance(prefill_server.url, "prefill", kv_host="127.0.0.1", kv_port=kv_port),
            Instance(dead.url, "decode"),
            Instance(decode_server.url, "decode"),
        ],
        [dead.url],
    )
    dead.close()
    assert completion_text(router.url, body(PROMPT, ignore_eos=True)) == expected
    assert router_retries(router.url, "decode") == 1
    assert wait_until(lambda: not prefill.engine.has_kv_transfers(), timeout=10)
    assert_idle(prefill, decode)


def test_a_prefill_instance_that_drops_the_request_is_replaced_by_another(instances, router_over):
    (prefill_server, prefill), (decode_server, decode) = instances
    expected = completion_text(decode_server.url, body(PROMPT, ignore_eos=True))
    kv_port = prefill.engine.quire_config.kv_transfer.port
    expired = prefill.engine.core_stats().kv_transfer.num_leases_expired
    dying = DyingInstance()
    try:
        router = router_over(
            [
                Instance(dying.url, "prefill", kv_host="127.0.0.1", kv_port=1),
                Instance(prefill_server.url, "prefill", kv_host="127.0.0.1", kv_port=kv_port),
                Instance(decode_server.url, "decode"),
            ],
            [dying.url],
        )
        assert completion_text(router.url, body(PROMPT, ignore_eos=True)) == expected
    finally:
        dying.close()
    assert dying.requests == 1
    assert router_retries(router.url, "prefill") == 1
    assert prefill.engine.core_stats().kv_transfer.num_leases_expired == expired  # pulled
    assert_idle(prefill, decode)


def test_the_router_logs_an_instance_going_down_and_back_up_and_no_poll():
    """`quire router` in its own process, over an instance whose /load fails for a while: its
    log is quire's lines, one per change, none for the /load polls nor for /health checks."""
    up = threading.Event()
    up.set()
    app = FastAPI()

    @app.get("/load")
    async def load():
        return LOAD if up.is_set() else JSONResponse({"error": "restarting"}, 503)

    @app.get("/health")
    async def health():
        return {}

    instance = ServerThread(app)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["router", "--collocated", instance.url, "--port", str(port)]
    router = subprocess.Popen(
        [sys.executable, "-m", "quire.entrypoints.cli", *argv], stderr=subprocess.PIPE, text=True
    )

    def healthy() -> bool | None:
        try:
            return httpx.get(url + "/load").json()["instances"][0]["healthy"]
        except httpx.HTTPError:
            return None

    try:
        assert wait_until(lambda: healthy() is True, timeout=60)
        assert httpx.get(url + "/health").status_code == 200
        up.clear()
        assert wait_until(lambda: healthy() is False)
        up.set()
        assert wait_until(lambda: healthy() is True)
    finally:
        router.terminate()
        stderr = router.communicate(timeout=30)[1]
        instance.stop()
    # "2026-11-26 08:40:01,234 LEVEL logger: message": quire's format, as `quire serve` logs
    assert [line.split(" ", 2)[2] for line in stderr.splitlines()] == [
        f"INFO quire.router.app: Routing at {url} with round_robin over collocated {instance.url}",
        f"WARNING quire.router.app: The collocated instance {instance.url} is down (/load "
        "answered 503): routing around it until its /load answers",
        f"INFO quire.router.app: The collocated instance {instance.url} is back up",
    ]

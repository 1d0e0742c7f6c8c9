"""`quire serve` stops when told: the first SIGTERM stops admitting (503, /ready 503) and lets
the requests in flight finish for up to --shutdown-timeout seconds, then ends the rest with an
error event and [DONE]; a second SIGTERM or a SIGINT ends them at once. The process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_utils import wait_until

from quire.entrypoints.cli import build_parser

MODEL = "tiny"
# over a second of decoding even on a quiet host (the tiny model's context is 1,024 tokens, and
# it decodes ~600 a second): outlives the tests' waits
LONG = {"max_tokens": 1000, "ignore_eos": True}


class Serve:
    """`quire serve` of the tiny model in a process of its own, with `flags`."""

    def __init__(self, model: str, log_path, *flags: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "quire.entrypoints.cli", "serve", model, *flags]
        command += ["--port", str(port), "--served-model-name", MODEL, "--num-kv-blocks", "256"]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        assert wait_until(self._healthy, timeout=120), self.log()

    def _healthy(self) -> bool:
        assert self.process.poll() is None, self.log()
        try:
            return httpx.get(self.url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        with open(self.log_path) as log:
            return log.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class Stream:
    """A streamed completion read on a thread: its events (the JSON of each, or "[DONE]")."""

    def __init__(self, url: str, body: dict) -> None:
        self.events: list = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the stream sent nothing"

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    self.started.set()

    def join(self) -> None:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()

    @property
    def error(self) -> dict | None:
        errors = [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]
        return errors[0] if errors else None


@pytest.fixture
def serve(tiny_llama, tmp_path) -> Iterator:
    servers = []

    def start(*flags: str) -> Serve:
        servers.append(Serve(tiny_llama, tmp_path / f"serve{len(servers)}.log", *flags))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_sigterm_ends_a_long_stream_after_the_shutdown_timeout_with_an_error_event(serve):
    server = serve("--shutdown-timeout", "0.5")
    stream = Stream(server.url, {"prompt": "Hi", "stream": True, **LONG})
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    # Draining: still listening, admitting nothing.
    assert wait_until(lambda: httpx.get(server.url + "/ready").status_code == 503, timeout=2)
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert server.process.wait(timeout=30) == 0
    elapsed = time.monotonic() - start
    stream.join()
    assert 0.5 <= elapsed < 15
    assert stream.events[-1] == "[DONE]"
    assert stream.events[-2]["error"] == {
        "message": "The server is shutting down (SIGTERM) and its --shutdown-timeout of 0.5 s has "
        "passed: the request was ended before it finished; retry it.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert all("choices" in event for event in stream.events[:-2])


def test_a_request_that_finishes_within_the_shutdown_timeout_is_served_whole(serve):
    server = serve("--shutdown-timeout", "60")
    stream = Stream(server.url, {"prompt": "Hi", "stream": True, "max_tokens": 40})
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60) == 0
    elapsed = time.monotonic() - start
    stream.join()
    assert stream.error is None
    assert stream.events[-1] == "[DONE]"
    assert stream.events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert elapsed < 30  # it exits once drained, not at the timeout


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_sigterm_or_a_sigint_ends_the_streams_at_once(serve, second):
    server = serve("--shutdown-timeout", "600")
    stream = Stream(server.url, {"prompt": "Hi", "stream": True, **LONG})
    server.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: httpx.get(server.url + "/ready").status_code == 503, timeout=2)
    start = time.monotonic()
    server.process.send_signal(second)
    assert server.process.wait(timeout=30) == 0
    stream.join()
    assert time.monotonic() - start < 15
    assert stream.events[-1] == "[DONE]"
    assert stream.error["message"] == (
        f"The server was stopped ({second.name}): the request was ended before it finished; "
        "retry it."
    )


def test_a_sigint_alone_ends_the_streams_with_an_error_event(serve):
    server = serve()
    stream = Stream(server.url, {"prompt": "Hi", "stream": True, **LONG})
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=30) == 0
    stream.join()
    assert stream.events[-1] == "[DONE]"
    assert stream.error["message"].startswith("The server was stopped (SIGINT)")


def test_serve_parses_the_shutdown_timeout():
    assert build_parser().parse_args(["serve"]).shutdown_timeout == 5.0
    args = build_parser().parse_args(["serve", "--shutdown-timeout", "0.5"])
    assert args.shutdown_timeout == 0.5


def test_sigterm_while_a_large_grammar_compiles_exits_within_the_timeout(serve):
    server = serve("--shutdown-timeout", "1")
    large = {"prompt": "Hi", "guided_json": {"enum": [f"member-{i}" for i in range(50000)]}}
    answers = []
    thread = threading.Thread(
        target=lambda: answers.append(
            httpx.post(server.url + "/v1/completions", json=large, timeout=60)
        ),
        daemon=True,
    )
    thread.start()
    time.sleep(2)  # parsed and compiling (tens of seconds for 50,000 members)
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0
    assert time.monotonic() - start < 15
    thread.join(timeout=30)
    assert answers[0].status_code == 503

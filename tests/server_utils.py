"""A uvicorn server in a background thread, polling with a deadline, and what the serving tests
ask of a server: shared by the tests that serve the OpenAI app in process."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn

from quire.config import EngineConfig
from quire.engine.async_engine import AsyncLLM
from quire.engine.metrics import EngineMetrics
from quire.entrypoints.api_server import build_app


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Polls `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class ServerThread:
    """uvicorn serving `app` on a free loopback port, in a background thread."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=30)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextlib.contextmanager
def serve_engine(
    config: EngineConfig, model_name: str = "tiny", **app_kwargs
) -> Iterator[tuple[ServerThread, AsyncLLM]]:
    """An engine of `config` served as `model_name` by the OpenAI app (with `app_kwargs`)."""
    engine = AsyncLLM.from_engine_config(config, EngineMetrics(model_name))
    server = ServerThread(build_app(engine, model_name, **app_kwargs))
    try:
        yield server, engine
    finally:
        server.stop()
        engine.shutdown()


def completion_text(url: str, body: dict, timeout: float = 60) -> str:
    """The text of the completion `body` asks `url` for: streamed (the events' texts joined, none
    of them an error) when the body says so, else in one answer."""
    if not body.get("stream"):
        response = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    parts = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                parts.append(event["choices"][0]["text"])
    return "".join(parts)


def router_retries(url: str, role: str) -> float:
    """quire_router_retries_total{role} of the router at `url`."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'quire_router_retries_total{{role="{role}"}}'):
            return float(line.split()[-1])
    return 0.0

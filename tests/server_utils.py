"""A uvicorn server in a background thread, and polling with a deadline: shared by the tests
that serve the OpenAI app in process."""

from __future__ import annotations

import contextlib
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

"""What runs inside a Ray actor: one `quire serve` instance, or the router, each serving HTTP
from a thread of the actor's process while the actor answers Ray's calls.

These are plain classes; `quire.cluster.placement` makes them actors with `ray.remote`, so this
module imports neither Ray nor, until an actor starts, the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time

import uvicorn

from quire.engine_args import EngineArgs

logger = logging.getLogger(__name__)


class HTTPThread:
    """uvicorn serving `app` on `host` (port 0: a free one) from a daemon thread."""

    def __init__(self, app, host: str, port: int = 0, start_timeout_s: float = 60.0) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_config=None, access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"The HTTP server at {self.url} did not start.")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def node_ip() -> str:
    """This node's address as the Ray cluster knows it (what the other nodes reach)."""
    import ray

    return ray.util.get_node_ip_address()


class InstanceServer:
    """A `quire serve` instance of `role` ("prefill", "decode" or None: collocated) on this
    node: its HTTP API and (prefill) its KV endpoint listen on the node's address, on free
    ports."""

    def __init__(self, engine_args: EngineArgs, role: str | None, served_model_name: str):
        from quire.engine.async_engine import AsyncLLM
        from quire.engine.metrics import EngineMetrics
        from quire.entrypoints.api_server import build_app

        host = node_ip()
        args = dataclasses.replace(
            engine_args, disaggregation_mode=role, kv_host=host, kv_port=None
        )
        self.engine = AsyncLLM.from_engine_config(
            args.create_engine_config(), EngineMetrics(served_model_name)
        )
        self.http = HTTPThread(build_app(self.engine, served_model_name), host)
        logger.info("%s instance serving at %s", role or "collocated", self.http.url)

    def url(self) -> str:
        return self.http.url

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def ping(self) -> bool:
        """True while the engine runs (a dead actor raises to the caller instead)."""
        return self.engine.is_running

    def num_free_blocks(self) -> tuple[int, int]:
        """(free KV blocks, all KV blocks): every block is free when no request is running."""
        kv = self.engine.engine.kv_manager
        return kv.num_free_blocks, kv.num_blocks

    def stop(self) -> None:
        self.http.stop()
        self.engine.shutdown()


class RouterServer:
    """`quire router` over the given instance URLs, on `host`:`port` of this node."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        collocated: list[str],
        policy: str,
        host: str,
        port: int,
        poll_interval_s: float,
    ):
        from quire.router.app import Router, build_router_app, check_instances

        self.router = Router(
            check_instances(prefill, decode, collocated), policy, poll_interval_s=poll_interval_s
        )
        self.http = HTTPThread(build_router_app(self.router), host, port)

    def url(self) -> str:
        return self.http.url

    def ping(self) -> bool:
        return True

    def replace_instance(self, url: str, role: str, new_url: str) -> None:
        """Routes to the instance at `new_url` instead of the (dead) one at `url`."""
        from quire.router.app import check_instance

        self.router.replace_instance(url, check_instance(role, new_url))

    def stop(self) -> None:
        self.http.stop()

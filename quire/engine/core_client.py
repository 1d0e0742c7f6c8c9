"""The engine core in a process of its own (`ParallelConfig.engine_core_process`).

The front end (LLMEngine) sends requests and aborts over a pipe; the core process steps while it
has work and sends each step's outputs and stats back, without waiting to be asked, so the front
end's work on one step (detokenizing, streaming) overlaps the core's next step. `step()` returns
the next step's outputs as they arrive. A core that dies is noticed within a second while the
front end waits on it (`EngineCoreDiedError`); a step that raises in the core is reported back
as a RuntimeError and the core ends every request.
"""

from __future__ import annotations

import gc
import multiprocessing
import queue
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from quire.config import QuireConfig
from quire.engine.core import CoreStats, EngineCore, EngineCoreOutput
from quire.engine.request import Request, RequestStatus
from quire.executor import child_process

if TYPE_CHECKING:
    from quire.worker.worker import WorkerState

_STALL_WAIT_S = 0.001  # the core's pause after a step that could schedule nothing
_SHUTDOWN_TIMEOUT_S = 10.0
_NEEDS_IN_PROCESS_CORE = (
    "check_invariants and stats read the engine core's scheduler and workers: build the engine "
    "with engine_core_process=False to call them."
)


class EngineCoreDiedError(RuntimeError):
    """The engine-core process ended while the front end needed it."""


class CoreProcessClient:
    """EngineCore's interface, served by a core in another process."""

    def __init__(self, config: QuireConfig):
        context = multiprocessing.get_context("spawn")
        self._pipe, core_end = context.Pipe()
        self._process = context.Process(
            target=_core_main,
            args=(core_end, config),
            name="quire-engine-core",
            daemon=True,
        )
        self._process.start()
        core_end.close()
        self._stats = CoreStats()
        self.num_steps = 0
        try:
            self.config = self._receive()  # with the KV pool's size
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = self.config.model.max_model_len
        self.num_kv_blocks = self.config.cache.num_kv_blocks

    def add_request(self, request: Request) -> None:
        self._send("add", request)

    def abort_requests(
        self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        if req_ids:
            self._send("abort", (req_ids, status))

    def abort_all(self) -> None:
        self._send("abort_all", None)

    def reset_prefix_cache(self) -> None:
        self._send("reset_prefix_cache", None)

    def _send(self, kind: str, payload) -> None:
        try:
            self._pipe.send((kind, payload))
        except OSError as error:
            raise EngineCoreDiedError(f"The engine-core process died: {error!r}") from error

    def step(self) -> list[EngineCoreOutput]:
        outputs, self._stats = self._receive()
        self.num_steps += 1
        return outputs

    def stats(self) -> CoreStats:
        """As of the last step received."""
        return self._stats

    def idle_problems(self) -> list[str]:
        raise RuntimeError(_NEEDS_IN_PROCESS_CORE)

    def worker_states(self) -> list[WorkerState]:
        raise RuntimeError(_NEEDS_IN_PROCESS_CORE)

    def _receive(self):
        return child_process.receive(self._pipe, self._process, "engine-core", EngineCoreDiedError)

    def shutdown(self) -> None:
        if self._process is None:
            return
        try:
            self._pipe.send(("shutdown", None))
        except (OSError, ValueError):
            pass
        self._process.join(_SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()
        self._pipe.close()
        self._process = None


def _core_main(pipe: Connection, config: QuireConfig) -> None:
    try:
        core = EngineCore(config)
    except BaseException as error:
        pipe.send(("error", child_process.error_message(error)))
        return
    gc.collect()
    gc.freeze()  # the process lives as long as the core: a full collection skips its model
    pipe.send(("ready", core.config))
    # A reader thread takes every command as it arrives, so the front end never waits on a
    # core that is busy sending (each direction of the pipe has a bounded buffer).
    commands: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(pipe, commands), daemon=True).start()
    while True:
        # Take every command that has arrived; wait for one when there is no work.
        while not commands.empty() or not core.has_unfinished_requests():
            kind, payload = commands.get()
            if kind == "shutdown":
                core.shutdown()
                return
            if kind == "add":
                core.add_request(payload)
            elif kind == "abort":
                core.abort_requests(*payload)
            elif kind == "abort_all":
                core.abort_all()
            elif kind == "reset_prefix_cache":
                core.reset_prefix_cache()
        try:
            outputs = core.step()
        except Exception:
            core.abort_all()
            pipe.send(("error", traceback.format_exc()))
            continue
        pipe.send(("outputs", (outputs, core.stats())))
        if not outputs:
            time.sleep(_STALL_WAIT_S)


def _read_commands(pipe: Connection, commands: queue.SimpleQueue) -> None:
    try:
        while True:
            commands.put(pipe.recv())
    except (EOFError, ConnectionError, OSError):
        commands.put(("shutdown", None))  # the front end is gone

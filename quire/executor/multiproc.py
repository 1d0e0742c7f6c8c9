"""MultiprocExecutor: one worker process per rank, each step sent to all of them as a message.

The step (`SchedulerOutput`) goes to every rank over a pipe (pickled: plain data); rank 0's
`ModelRunnerOutput` comes back. A rank that dies (killed, crashed) is noticed within a second
while the engine waits on it, and raises `WorkerDiedError` instead of hanging; a rank whose step
raised sends its traceback back. Workers end when told to, or when the engine's end of their pipe
closes (the engine process died).
"""

from __future__ import annotations

import logging
import multiprocessing
import traceback
from multiprocessing.connection import Connection

import torch

from quire.config import EngineConfig
from quire.executor import child_process
from quire.executor.base import Executor
from quire.messages import ModelRunnerOutput, SchedulerOutput
from quire.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 10.0


class WorkerDiedError(RuntimeError):
    """A worker process ended while the engine needed it."""


class MultiprocExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        max_model_len: int,
        world_size: int = 1,
    ):
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._processes: list[multiprocessing.Process] = []
        self._pipes: list[Connection] = []
        for rank in range(world_size):
            engine_end, worker_end = context.Pipe()
            process = context.Process(
                target=_worker_main,
                args=(worker_end, config, model_config, dtype, max_model_len, rank),
                name=f"quire-worker-{rank}",
                daemon=True,
            )
            process.start()
            worker_end.close()
            self._processes.append(process)
            self._pipes.append(engine_end)
        try:
            self.num_kv_blocks = min(self._receive(rank) for rank in range(world_size))
        except BaseException:
            self.shutdown()
            raise
        logger.info("Started %d worker process(es)", world_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for pipe in self._pipes:
            pipe.send(("execute", scheduler_output))
        outputs = [self._receive(rank) for rank in range(len(self._pipes))]
        return outputs[0]

    def _receive(self, rank: int):
        return child_process.receive(
            self._pipes[rank], self._processes[rank], f"worker rank {rank}", WorkerDiedError
        )

    def shutdown(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.send(("shutdown", None))
            except (OSError, ValueError):
                pass  # already gone
        for process in self._processes:
            process.join(_SHUTDOWN_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join()
        for pipe in self._pipes:
            pipe.close()
        self._pipes, self._processes = [], []


def _worker_main(
    pipe: Connection,
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    rank: int,
) -> None:
    from quire.worker.worker import Worker

    try:
        worker = Worker(config, model_config, dtype, max_model_len, rank)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        return
    pipe.send(("ready", worker.num_kv_blocks))
    while True:
        try:
            kind, payload = pipe.recv()
        except (EOFError, ConnectionError):
            return  # the engine is gone
        if kind == "shutdown":
            return
        try:
            pipe.send(("output", worker.execute_model(payload)))
        except Exception:
            pipe.send(("error", traceback.format_exc()))

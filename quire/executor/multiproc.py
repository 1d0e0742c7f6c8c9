"""MultiprocExecutor: one worker process per tensor-parallel rank, each step sent to all of them
as a message.

The step (`SchedulerOutput`) goes to every rank over a pipe (pickled: plain data); rank 0's
`ModelRunnerOutput` comes back. The ranks meet at a TCP port on 127.0.0.1 (a free one unless
`tensor_parallel_port` is set) and form a gloo group (NCCL on a GPU); each gets an equal share of
the cores, pinned to them where the OS allows.

A rank that dies (killed, crashed) is noticed within a second while the engine waits on any
rank, and raises `WorkerDiedError` instead of hanging; a rank whose step raised sends its
traceback back. Either way the other ranks may be stuck in a collective that will never
complete, so every worker is ended and the executor runs no more steps. Workers end when told
to, or when the engine's end of their pipe closes (the engine process died).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from quire.config import QuireConfig
from quire.distributed.parallel_state import RankPlacement
from quire.executor import child_process
from quire.executor.base import Executor, WorkerDiedError
from quire.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from quire.worker.worker import WorkerState

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 10.0


class MultiprocExecutor(Executor):
    def __init__(self, config: QuireConfig):
        world_size = config.parallel.tensor_parallel_size
        port = config.parallel.tensor_parallel_port or free_port()
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._processes: list[multiprocessing.Process] = []
        self._pipes: list[Connection] = []
        for rank in range(world_size):
            engine_end, worker_end = context.Pipe()
            placement = RankPlacement(rank, world_size, port, rank_cores(rank, world_size))
            process = context.Process(
                target=_worker_main,
                args=(worker_end, config, placement),
                name=f"quire-worker-{rank}",
                daemon=True,
            )
            process.start()
            worker_end.close()
            self._processes.append(process)
            self._pipes.append(engine_end)
        try:
            self.num_kv_blocks = min(self._receive_all())
        except BaseException:
            self._end_workers()
            raise
        logger.info("Started %d worker process(es), rendezvous port %d", world_size, port)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call_all("execute", scheduler_output)[0]

    def worker_states(self) -> list[WorkerState]:
        return self._call_all("state", None)

    def _call_all(self, kind: str, payload) -> list:
        """Sends (kind, payload) to every rank; their answers, in rank order."""
        if not self._processes:
            raise WorkerDiedError("The workers have ended; this engine can run no more steps.")
        try:
            for pipe in self._pipes:
                pipe.send((kind, payload))
            return self._receive_all()
        except BaseException:
            self._end_workers()  # the other ranks may wait in a collective forever
            raise

    def _receive_all(self) -> list:
        """Each rank's next payload, in rank order; raises WorkerDiedError within
        child_process.POLL_S of any rank's death, while waiting on whichever rank."""
        payloads = []
        for rank, pipe in enumerate(self._pipes):
            while not pipe.poll(child_process.POLL_S):
                for other, process in enumerate(self._processes):
                    if not process.is_alive():
                        raise WorkerDiedError(
                            f"The worker rank {other} process died (exit code {process.exitcode})."
                        )
            payloads.append(
                child_process.receive(
                    pipe, self._processes[rank], f"worker rank {rank}", WorkerDiedError
                )
            )
        return payloads

    def _end_workers(self) -> None:
        """Ends every worker at once (no shutdown message: some may be stuck)."""
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            process.join()
        for pipe in self._pipes:
            pipe.close()
        self._pipes, self._processes = [], []

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_cores(rank: int, world_size: int) -> list[int] | None:
    """The cores rank `rank` of `world_size` is pinned to: an equal, disjoint share of the
    cores this process may run on; None where there are fewer cores than ranks or the OS has
    no affinity call (the rank then runs one thread, unpinned)."""
    if world_size == 1 or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // world_size
    return cores[rank * share : (rank + 1) * share] if share else None


def _worker_main(pipe: Connection, config: QuireConfig, placement: RankPlacement) -> None:
    from quire.executor.plugins import make_kv_connector, make_proposer
    from quire.worker.worker import Worker

    try:
        worker = Worker(
            config,
            placement,
            proposer=make_proposer(config),
            kv_connector=make_kv_connector(config),
        )
    except BaseException as error:
        pipe.send(("error", child_process.error_message(error)))
        return
    pipe.send(("ready", worker.num_kv_blocks))
    while True:
        try:
            kind, payload = pipe.recv()
        except (EOFError, ConnectionError):
            return  # the engine is gone
        if kind == "shutdown":
            # Nothing is left to clean up that the OS does not: skip the interpreter's teardown
            # of torch, ~3 s per rank on a loaded 2-core host, which the engine's shutdown waits
            # for.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            if kind == "state":
                pipe.send(("state", worker.state()))
            else:
                pipe.send(("output", worker.execute_model(payload)))
        except Exception:
            pipe.send(("error", traceback.format_exc()))

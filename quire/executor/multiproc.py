"""MultiprocExecutor: one worker process per rank (tensor_parallel_size in each of
pipeline_parallel_size stages), each step sent to all of them as a message.

The step (`SchedulerOutput`) goes to every rank over a pipe (pickled: plain data); the
`ModelRunnerOutput` of the last stage's first rank comes back (every rank answers, so an error
anywhere is seen). The ranks meet at a TCP port on 127.0.0.1 (a free one unless
`tensor_parallel_port` is set) and form a gloo group (NCCL on a GPU); each gets an equal share of
the cores, pinned to them where the OS allows.

Steps may be submitted while earlier ones run (the engine core's batch queue); the answers come
back in order, and while a step is in flight the next one's messages are written by a thread, so
that the engine never blocks on a busy rank's full pipe while that rank blocks on its answer.

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
import queue
import socket
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from quire.config import QuireConfig
from quire.distributed.parallel_state import RankPlacement
from quire.executor import child_process
from quire.executor.base import Executor, StepFuture, WorkerDiedError
from quire.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from quire.worker.worker import Worker, WorkerState

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 10.0


class MultiprocExecutor(Executor):
    _worker_noun = "process"  # in the message of a rank's death

    def __init__(self, config: QuireConfig):
        parallel = config.parallel
        world_size = parallel.world_size
        port = parallel.tensor_parallel_port or free_port()
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._init_steps(config)
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

    def _init_steps(self, config: QuireConfig) -> None:
        """The state the step loop below keeps (RayExecutor's too): no rank started yet."""
        parallel = config.parallel
        # the first rank of the last stage samples: its output is the step's
        self._output_rank = parallel.world_size - parallel.tensor_parallel_size
        # a multiprocessing.Process per rank, or a stand-in with is_alive, exitcode, terminate, join
        self._processes: list = []
        self._pipes: list[Connection] = []
        self._pending: deque[StepFuture] = deque()  # submitted, answers not yet read
        self._outbox: queue.SimpleQueue | None = None  # (pipe, message) for the sender thread
        self._sender: threading.Thread | None = None

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        if not self._processes:
            raise WorkerDiedError("The workers have ended; this engine can run no more steps.")
        message = ("execute", scheduler_output)
        if self._pending:  # a rank may be busy: its pipe may be full
            if self._outbox is None:
                self._outbox = queue.SimpleQueue()
                self._sender = threading.Thread(
                    target=_send_loop, args=(self._outbox,), name="quire-step-sender", daemon=True
                )
                self._sender.start()
            for pipe in self._pipes:
                self._outbox.put((pipe, message))
        else:
            self._send_all(message)
        future = StepFuture(lambda: self._wait_for(future))
        self._pending.append(future)
        return future

    def _wait_for(self, future: StepFuture) -> ModelRunnerOutput:
        """Reads the answers of the steps submitted before `future`'s, then its own."""
        while True:
            if not self._pending:
                raise WorkerDiedError("The workers have ended; this engine can run no more steps.")
            oldest = self._pending.popleft()
            try:
                output = self._receive_all()[self._output_rank]
            except BaseException:
                self._pending.clear()
                self._end_workers()  # the other ranks may wait in a collective forever
                raise
            if oldest is future:
                return output
            oldest._output, oldest._wait = output, None

    def worker_states(self) -> list[WorkerState]:
        while self._pending:
            self._pending[-1].result()
        return self._call_all("state", None)

    def _send_all(self, message: tuple) -> None:
        try:
            try:
                for pipe in self._pipes:
                    pipe.send(message)
            except OSError as error:  # a rank's end of its pipe is gone: the rank died
                deadline = time.monotonic() + child_process.POLL_S
                while time.monotonic() < deadline:  # the parent sees the exit a moment later
                    self._raise_if_one_died(error)
                    time.sleep(0.01)
                raise
        except BaseException:
            self._end_workers()
            raise

    def _call_all(self, kind: str, payload) -> list:
        """Sends (kind, payload) to every rank; their answers, in rank order."""
        if not self._processes:
            raise WorkerDiedError("The workers have ended; this engine can run no more steps.")
        self._send_all((kind, payload))
        try:
            return self._receive_all()
        except BaseException:
            self._end_workers()  # the other ranks may wait in a collective forever
            raise

    def _receive_all(self) -> list:
        """Each rank's next payload, in rank order; raises WorkerDiedError within
        child_process.POLL_S of any rank's death, while waiting on whichever rank. A rank whose
        step failed because another died (its peer in a collective or a pipeline send went
        away) is reported as that death."""
        payloads = []
        for rank, pipe in enumerate(self._pipes):
            while not pipe.poll(child_process.POLL_S):
                self._raise_if_one_died()
            try:
                payloads.append(
                    child_process.receive(
                        pipe,
                        self._processes[rank],
                        f"worker rank {rank}",
                        WorkerDiedError,
                        self._worker_noun,
                    )
                )
            except WorkerDiedError:
                raise
            except RuntimeError as error:
                deadline = time.monotonic() + child_process.POLL_S
                while time.monotonic() < deadline:
                    self._raise_if_one_died(error)
                    time.sleep(0.01)
                raise
        return payloads

    def _raise_if_one_died(self, cause: BaseException | None = None) -> None:
        for rank, process in enumerate(self._processes):
            if not process.is_alive():
                raise WorkerDiedError(
                    f"The worker rank {rank} process died (exit code {process.exitcode})."
                ) from cause

    def _end_workers(self) -> None:
        """Ends every worker at once (no shutdown message: some may be stuck)."""
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            process.join()
        self._stop_sender()  # its writes fail now that no rank reads
        for pipe in self._pipes:
            pipe.close()
        self._pipes, self._processes = [], []

    def _stop_sender(self) -> None:
        """Ends the sender thread once it has written what it was given."""
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join()
            self._sender = self._outbox = None

    def shutdown(self) -> None:
        if self._pending:  # steps in flight: their answers are read first, as a rank writes them
            try:
                self._pending[-1].result()
            except Exception:
                pass  # the workers are ended
        self._stop_sender()
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


def _send_loop(outbox: queue.SimpleQueue) -> None:
    """Writes each (pipe, message) in order until it gets None; a pipe that closed is the
    rank's death, which the engine sees when it waits for the answer."""
    while (item := outbox.get()) is not None:
        pipe, message = item
        try:
            pipe.send(message)
        except (OSError, ValueError):
            pass


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
    if serve_steps(pipe, worker):
        # Nothing is left to clean up that the OS does not: skip the interpreter's teardown of
        # torch, ~3 s per rank on a loaded 2-core host, which the engine's shutdown waits for.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def serve_steps(pipe: Connection, worker: Worker) -> bool:
    """A rank's side of the executor's messages on `pipe`: ("execute", step) answered with the
    step's output, ("state", None) with the rank's state, a failure with ("error", traceback).
    True once told to shut down; False when the executor's end closed (the engine is gone)."""
    while True:
        try:
            kind, payload = pipe.recv()
        except (EOFError, ConnectionError):
            return False
        if kind == "shutdown":
            return True
        try:
            if kind == "state":
                pipe.send(("state", worker.state()))
            else:
                pipe.send(("output", worker.execute_model(payload)))
        except Exception:
            pipe.send(("error", traceback.format_exc()))

"""Executor: owns the workers and runs a step on all of them; the engine core sees only this.

`uni` keeps the one worker in the engine's process (no copies, no IPC: the default on one
device). `mp` runs each rank's worker in a process of its own and sends it the step as a
message; the output of the last pipeline stage's first rank is returned (executor/multiproc.py).
`ray` does the same with each rank a Ray actor, on any node of a Ray cluster (executor/ray.py).

`submit` hands the ranks a step and returns at once with a StepFuture, so the engine core can keep
several steps in flight (its batch queue: pipeline stages each run one); their results are taken
in the order they were submitted. `execute_model` is a submit and its wait.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from quire.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from quire.worker.worker import WorkerState


class WorkerDiedError(RuntimeError):
    """A worker (process or Ray actor) ended while the engine needed it."""


class StepFuture:
    """A submitted step's ModelRunnerOutput: `result()` waits for it (or raises the step's
    error)."""

    def __init__(self, wait: Callable[[], ModelRunnerOutput]):
        self._wait: Callable[[], ModelRunnerOutput] | None = wait
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> StepFuture:
        future = cls(lambda: output)
        future.result()
        return future

    def result(self) -> ModelRunnerOutput:
        if self._wait is not None:
            self._output, self._wait = self._wait(), None
        return self._output


class Executor(ABC):
    num_kv_blocks: int  # the KV pool of each worker, in blocks

    @abstractmethod
    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Hands every rank the step; returns without waiting for it."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(scheduler_output).result()

    @abstractmethod
    def worker_states(self) -> list[WorkerState]:
        """Each rank's state, in rank order (between steps)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Ends the workers; the executor cannot run steps afterwards."""

"""Executor: owns the workers and runs a step on all of them; the engine core sees only this.

`uni` keeps the one worker in the engine's process (no copies, no IPC: the default on one
device). `mp` runs each rank's worker in a process of its own and sends it the step as a
message; rank 0's output is returned (executor/multiproc.py). `ray` does the same with each rank
a Ray actor, on any node of a Ray cluster (executor/ray.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from quire.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from quire.worker.worker import WorkerState


class WorkerDiedError(RuntimeError):
    """A worker (process or Ray actor) ended while the engine needed it."""


class Executor(ABC):
    num_kv_blocks: int  # the KV pool of each worker, in blocks

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def worker_states(self) -> list[WorkerState]:
        """Each rank's state, in rank order (between steps)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Ends the workers; the executor cannot run steps afterwards."""

"""UniprocExecutor: the worker in the engine's own process."""

from __future__ import annotations

from quire.config import QuireConfig
from quire.executor.base import Executor, StepFuture
from quire.executor.plugins import make_kv_connector, make_proposer
from quire.messages import SchedulerOutput
from quire.worker.worker import Worker, WorkerState


class UniprocExecutor(Executor):
    def __init__(self, config: QuireConfig):
        self.worker = Worker(
            config,
            proposer=make_proposer(config),
            kv_connector=make_kv_connector(config),
        )
        self.num_kv_blocks = self.worker.num_kv_blocks

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Runs the step now (one worker in this process: nothing to overlap)."""
        return StepFuture.done(self.worker.execute_model(scheduler_output))

    def worker_states(self) -> list[WorkerState]:
        return [self.worker.state()]

    def shutdown(self) -> None:
        """Closes the worker's KV transfer endpoint, if any; the worker lives and dies with the
        engine's process."""
        self.worker.shutdown()

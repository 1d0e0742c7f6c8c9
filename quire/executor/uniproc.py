"""UniprocExecutor: the worker in the engine's own process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

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
        # Async scheduling: steps run on a thread of their own, one after another, while the
        # engine schedules the next (the forward releases the GIL in torch and the C kernels).
        self._thread = (
            ThreadPoolExecutor(1, thread_name_prefix="quire-step")
            if config.scheduler.async_scheduling
            else None
        )

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Runs the step now, or with async scheduling on the step thread."""
        if self._thread is None:
            return StepFuture.done(self.worker.execute_model(scheduler_output))
        return StepFuture(self._thread.submit(self.worker.execute_model, scheduler_output).result)

    def worker_states(self) -> list[WorkerState]:
        return [self.worker.state()]

    def shutdown(self) -> None:
        """Closes the worker's KV transfer endpoint, if any; the worker lives and dies with the
        engine's process."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.worker.shutdown()

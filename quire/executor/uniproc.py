"""UniprocExecutor: the worker in the engine's own process."""

from __future__ import annotations

import torch

from quire.config import EngineConfig
from quire.executor.base import Executor
from quire.messages import ModelRunnerOutput, SchedulerOutput
from quire.model.model_config import ModelConfig
from quire.worker.worker import Worker, WorkerState


class UniprocExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        max_model_len: int,
    ):
        self.worker = Worker(config, model_config, dtype, max_model_len)
        self.num_kv_blocks = self.worker.num_kv_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def worker_states(self) -> list[WorkerState]:
        return [self.worker.state()]

    def shutdown(self) -> None:
        """Closes the worker's KV transfer endpoint, if any; the worker lives and dies with the
        engine's process."""
        self.worker.shutdown()

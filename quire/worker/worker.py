"""Worker: one rank's device, model, KV cache and model runner, driven by step messages."""

from __future__ import annotations

import torch

from quire.config import EngineConfig
from quire.messages import ModelRunnerOutput, SchedulerOutput
from quire.model.model_config import ModelConfig
from quire.worker.model_runner import ModelRunner


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        max_model_len: int,
        rank: int = 0,
    ):
        self.rank = rank
        torch.manual_seed(config.seed)  # the unseeded sampling noise of this rank
        self.runner = ModelRunner(config, model_config, dtype, max_model_len)

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

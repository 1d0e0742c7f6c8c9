"""The executors (base.py: the interface the engine core sees) and the choice among them."""

from __future__ import annotations

import torch

from quire.config import EngineConfig
from quire.executor.base import Executor
from quire.model.model_config import ModelConfig


def make_executor(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int
) -> Executor:
    """The executor `distributed_executor_backend` names. Each is imported when chosen: `uni`
    loads the worker into this process, which with `mp` only the rank processes import."""
    if config.distributed_executor_backend == "mp":
        from quire.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_config, dtype, max_model_len)
    from quire.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config, model_config, dtype, max_model_len)

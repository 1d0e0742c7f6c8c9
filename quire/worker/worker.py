"""Worker: one rank's device, model, KV cache and model runner, driven by step messages."""

from __future__ import annotations

import logging
import os

import torch

from quire.config import QuireConfig
from quire.distributed.parallel_state import RankPlacement, init_tensor_parallel
from quire.messages import ModelRunnerOutput, SchedulerOutput
from quire.worker.model_runner import ModelRunner
from quire.worker.protocols import KVConnector, Proposer

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: QuireConfig,
        placement: RankPlacement | None = None,
        proposer: Proposer | None = None,
        kv_connector: KVConnector | None = None,
    ):
        """`proposer`, `kv_connector`: the plug-ins the executor built (executor/plugins.py)."""
        placement = placement or RankPlacement()
        self.rank = placement.rank
        if placement.world_size > 1:
            pin_rank(placement)
            if config.device.device == "cuda":  # one GPU per rank: "cuda" is this rank's
                torch.cuda.set_device(placement.rank)
            # every tensor an all-reduce sums is at most a step's tokens x hidden size
            rows = max(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
            hidden_size, dtype = config.model.architecture.hidden_size, config.model.dtype
            init_tensor_parallel(
                placement.rank,
                placement.world_size,
                placement.port,
                config.device.device,
                shm_bytes=rows * hidden_size * max(dtype.itemsize, 4),
            )
        torch.manual_seed(config.model.seed)  # the unseeded sampling noise: the same on every rank
        self.runner = ModelRunner(config, proposer, kv_connector)

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def shutdown(self) -> None:
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.close()


def pin_rank(placement: RankPlacement) -> None:
    """Pins this rank to its cores and runs that many threads (torch's and the C kernels')."""
    if placement.cores is None:
        torch.set_num_threads(1)
        return
    os.sched_setaffinity(0, placement.cores)
    torch.set_num_threads(len(placement.cores))
    logger.info("Rank %d on cores %s", placement.rank, placement.cores)

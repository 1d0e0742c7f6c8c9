"""Worker: one rank's device, model, KV cache and model runner, driven by step messages."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from quire.config import QuireConfig
from quire.distributed.parallel_state import RankPlacement, init_tensor_parallel
from quire.kernels import cpu as cpu_kernels
from quire.kernels.cpu import gemv, qmatmul
from quire.messages import ModelRunnerOutput, SchedulerOutput
from quire.worker.model_runner import ModelRunner
from quire.worker.protocols import KVConnector, Proposer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerState:
    """What one rank holds and which fast paths it runs: plain data, for `LLM.check_invariants`
    and `LLM.stats` (the executor gathers one per rank)."""

    rank: int
    pid: int  # the process the rank runs in
    num_kv_blocks: int
    request_ids: tuple[str, ...]  # the requests in its InputBatch, sorted
    draft_request_ids: tuple[str, ...]  # requests its proposer keeps state for, sorted
    weight_bytes: int  # the model weights it holds (its pipeline stage's layers)
    c_decode_step: bool  # decode steps run the fused C step (worker/cpu_step.py)
    cuda_graphs: bool  # decode steps replay CUDA graphs (worker/cuda_graph.py)
    gemv_path: str  # quire.kernels.cpu.gemv.path() in this rank's process
    qmatmul_path: str  # quire.kernels.cpu.qmatmul.path() in this rank's process


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
        cpu_kernels.warm_up_torch_math()  # before any float unary op runs on several threads
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
                shm_bytes=rows * hidden_size * max(dtype.itemsize, 4) if placement.same_host else 0,
                host=placement.host,
                pipeline_parallel_size=config.parallel.pipeline_parallel_size,
            )
        torch.manual_seed(config.model.seed)  # the unseeded sampling noise: the same on every rank
        self.runner = ModelRunner(config, proposer, kv_connector)
        target = self.runner.target
        logger.info(
            "Rank %d holds layers %d..%d of %d: %.1f MiB of weights, %d KV blocks",
            self.rank,
            target.model.layer_range.start,
            target.model.layer_range.stop - 1,
            config.model.architecture.num_hidden_layers,
            target.weight_bytes() / 2**20,
            self.runner.num_blocks,
        )

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def state(self) -> WorkerState:
        """This rank's state, read from its runner (and its proposer)."""
        runner = self.runner
        drafted = set() if runner.proposer is None else runner.proposer.req_ids
        return WorkerState(
            rank=self.rank,
            pid=os.getpid(),
            num_kv_blocks=runner.num_blocks,
            request_ids=tuple(sorted(runner.input_batch.requests)),
            draft_request_ids=tuple(sorted(drafted)),
            weight_bytes=runner.target.weight_bytes(),
            c_decode_step=runner.target.cpu_step is not None,
            cuda_graphs=runner.target.cuda_graphs is not None,
            gemv_path=gemv.path(),
            qmatmul_path=qmatmul.path(),
        )

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

"""This process's place among the ranks: its tensor-parallel group (its rank, the rank count,
and the collectives the model calls: all-reduce after a row-parallel linear and the
vocabulary-parallel embedding, all-gather of the LM head's logits) and its pipeline stage (the
stage before and after it, and the point-to-point send and receive of the hidden states between
them).

Rank r of `world_size` = tp x pp is tensor-parallel rank r % tp of stage r // tp; the stages of
one tensor-parallel rank (a column) form a pipeline group, whose ranks send to each other. A
worker calls `init_tensor_parallel` once before building its model; layers read `tp_rank()` and
`tp_size()` when they are built, the model `pp_rank()` and `pp_size()`. Without a group (the
default, one rank) the sizes are 1 and every collective returns its input: the single-rank path
runs no extra op.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from quire.distributed.shm_all_reduce import ShmAllReduce

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlacement:
    """Where a worker runs: its rank of `world_size`, the rendezvous address (rank 0's host and
    a port there), the cores it is pinned to (None: not pinned, one thread), and whether every
    rank runs on this host (so they may share memory)."""

    rank: int = 0
    world_size: int = 1
    port: int = 0
    cores: list[int] | None = None
    host: str = "127.0.0.1"
    same_host: bool = True


@dataclass
class _Group:
    rank: int
    size: int
    shm: ShmAllReduce | None  # ranks on one host: step-sized collectives over shared memory
    group: dist.ProcessGroup | None  # the tensor-parallel ranks (None: every rank, one stage)


@dataclass
class _Pipeline:
    stage: int
    num_stages: int
    ranks: list[int]  # this column's rank in each stage
    group: dist.ProcessGroup


_group: _Group | None = None
_pipeline: _Pipeline | None = None


def tp_rank() -> int:
    return 0 if _group is None else _group.rank


def tp_size() -> int:
    return 1 if _group is None else _group.size


def pp_rank() -> int:
    """This rank's pipeline stage."""
    return 0 if _pipeline is None else _pipeline.stage


def pp_size() -> int:
    return 1 if _pipeline is None else _pipeline.num_stages


def init_tensor_parallel(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    shm_bytes: int,
    host: str = "127.0.0.1",
    pipeline_parallel_size: int = 1,
) -> None:
    """Joins the `world_size` ranks rendezvousing at `host`:`port` (gloo on CPU, NCCL on a GPU),
    in `pipeline_parallel_size` stages of world_size / pipeline_parallel_size tensor-parallel
    ranks. On CPU, a tensor-parallel group's all-reduces of up to `shm_bytes` go through shared
    memory (0: none, for ranks on different hosts)."""
    global _group, _pipeline
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size
    )
    tp = world_size // pipeline_parallel_size
    stage = rank // tp
    tp_group = None
    if pipeline_parallel_size > 1:
        # every rank creates every group, in the same order (torch.distributed's rule)
        for s in range(pipeline_parallel_size):
            group = dist.new_group(list(range(s * tp, (s + 1) * tp)))
            if s == stage:
                tp_group = group
        for column in range(tp):
            ranks = list(range(column, world_size, tp))
            group = dist.new_group(ranks)
            if column == rank % tp:
                _pipeline = _Pipeline(stage, pipeline_parallel_size, ranks, group)
    shm = None
    if device == "cpu" and shm_bytes > 0 and tp > 1:
        barrier = functools.partial(dist.barrier, group=tp_group)
        shm = ShmAllReduce.create(rank % tp, tp, f"{port}-{stage}", shm_bytes, barrier=barrier)
    _group = _Group(rank % tp, tp, shm, tp_group)
    logger.info(
        "Rank %d of %d: tensor-parallel rank %d of %d, pipeline stage %d of %d (%s%s)",
        rank,
        world_size,
        rank % tp,
        tp,
        stage,
        pipeline_parallel_size,
        backend,
        ", shared-memory all-reduce" if shm else "",
    )


def shm_group() -> ShmAllReduce | None:
    """The group's shared-memory file (ranks on one host, CPU), or None: one rank, or gloo
    alone."""
    return None if _group is None else _group.shm


def all_ranks_agree(flag: bool) -> bool:
    """Whether `flag` holds on every rank (collective; `flag` itself with one rank)."""
    if _group is None or _group.size == 1:
        return flag
    x = torch.tensor([int(flag)])
    dist.all_reduce(x, op=dist.ReduceOp.MIN, group=_group.group)
    return bool(x.item())


def destroy_tensor_parallel() -> None:
    global _group, _pipeline
    if _group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _group = _pipeline = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (in place where the transport allows; use the result)."""
    if _group is None or _group.size == 1:
        return x
    if _group.shm is not None and _group.shm.fits(x):
        return _group.shm.all_reduce(x)
    dist.all_reduce(x, group=_group.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] per rank -> [..., size * n], rank 0's columns first."""
    if _group is None or _group.size == 1:
        return x
    if _group.shm is not None and _group.shm.fits(x):
        return _group.shm.all_gather_last_dim(x)
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x.contiguous(), group=_group.group)
    return torch.cat(parts, dim=-1)


def send_to_next_stage(x: torch.Tensor) -> None:
    """Sends `x` to this column's rank in the next stage (which receives it in a tensor of its
    shape and dtype: `recv_from_previous_stage`)."""
    dist.send(x.contiguous(), _pipeline.ranks[_pipeline.stage + 1], group=_pipeline.group)


def recv_from_previous_stage(out: torch.Tensor) -> torch.Tensor:
    """Receives into `out` what this column's rank in the previous stage sent; returns `out`."""
    dist.recv(out, _pipeline.ranks[_pipeline.stage - 1], group=_pipeline.group)
    return out

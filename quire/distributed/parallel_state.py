"""This process's tensor-parallel group: its rank, the rank count, and the collectives the model
calls (all-reduce after a row-parallel linear and the vocabulary-parallel embedding, all-gather of
the LM head's logits).

A worker calls `init_tensor_parallel` once before building its model; layers read `tp_rank()` and
`tp_size()` when they are built. Without a group (the default, one rank) the size is 1 and every
collective returns its input: the single-rank path runs no extra op.
"""

from __future__ import annotations

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


_group: _Group | None = None


def tp_rank() -> int:
    return 0 if _group is None else _group.rank


def tp_size() -> int:
    return 1 if _group is None else _group.size


def init_tensor_parallel(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    shm_bytes: int,
    host: str = "127.0.0.1",
) -> None:
    """Joins the group of `world_size` ranks rendezvousing at `host`:`port` (gloo on CPU, NCCL
    on a GPU). On CPU, all-reduces of up to `shm_bytes` go through shared memory (0: none, for
    ranks on different hosts)."""
    global _group
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size
    )
    shm = None
    if device == "cpu" and shm_bytes > 0:
        shm = ShmAllReduce.create(rank, world_size, port, shm_bytes, barrier=dist.barrier)
    _group = _Group(rank, world_size, shm)
    logger.info(
        "Tensor-parallel rank %d of %d (%s%s)",
        rank,
        world_size,
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
    dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return bool(x.item())


def destroy_tensor_parallel() -> None:
    global _group
    if _group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _group = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (in place where the transport allows; use the result)."""
    if _group is None or _group.size == 1:
        return x
    if _group.shm is not None and _group.shm.fits(x):
        return _group.shm.all_reduce(x)
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] per rank -> [..., size * n], rank 0's columns first."""
    if _group is None or _group.size == 1:
        return x
    if _group.shm is not None and _group.shm.fits(x):
        return _group.shm.all_gather_last_dim(x)
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)

"""All-reduce (and all-gather) through shared memory, for tensor-parallel ranks on one host (CPU).

Every rank has a slot in one mapped file (/dev/shm): it copies its tensor in, publishes the
call's sequence number in its flag, waits until every rank's flag has reached that number, and
sums the slots in rank order, so every rank gets the same bits. A call's number is one past
the rank's own flag, so the C decode step (quire/kernels/cpu/shm_all_reduce.c), which runs the
same protocol over this file at `address`, and these calls share one sequence. Slots alternate
between two sets by the sequence number's parity: a rank can write call s + 2's data only after every rank
has published call s + 1, which each does after reading call s's slots. A decode step's
all-reduce is a few KiB, where gloo's TCP round trips over loopback cost more than the copies
(docs/BENCHMARKS.md). The LM head's logits are all-gathered the same way (each rank then
concatenates the slots). Tensors larger than a slot go to gloo.

The file is unlinked as soon as every rank has mapped it, so nothing is left behind however the
processes end.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import numpy as np
import torch

_FLAG_STRIDE = 8  # int64s per rank's flag: one 64-byte cache line each, no false sharing
# Checks (~1 us each) before a waiting rank yields its core: ranks on cores of their own meet
# within that, and a yield on a busy host can cost a whole time slice.
_SPINS_BEFORE_YIELD = 64


class ShmAllReduce:
    def __init__(self, buffer: mmap.mmap, rank: int, world_size: int, slot_bytes: int):
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self._buffer = buffer
        header = world_size * _FLAG_STRIDE * 8
        flags = np.frombuffer(buffer, np.int64, world_size * _FLAG_STRIDE)
        self._flags = flags[::_FLAG_STRIDE]  # [world_size], call numbers published
        self._data = torch.frombuffer(buffer, dtype=torch.uint8, offset=header)
        self.address = np.frombuffer(buffer, np.uint8).ctypes.data  # the file's first byte
        self._views: dict[tuple, list[torch.Tensor]] = {}

    @staticmethod
    def file_bytes(world_size: int, slot_bytes: int) -> int:
        return world_size * _FLAG_STRIDE * 8 + 2 * world_size * slot_bytes

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        key: int | str,
        slot_bytes: int,
        barrier: Callable[[], None],
    ) -> ShmAllReduce:
        """Maps the group's file; `key` names it (unique among the host's groups: the
        rendezvous port), `barrier` synchronizes the ranks (collective)."""
        path = f"/dev/shm/quire-tp-{key}-{os.getppid()}"
        size = cls.file_bytes(world_size, slot_bytes)
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(size)
        barrier()
        with open(path, "r+b") as f:
            buffer = mmap.mmap(f.fileno(), size)
        barrier()
        if rank == 0:
            os.unlink(path)
        return cls(buffer, rank, world_size, slot_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.nbytes <= self.slot_bytes

    def _slots(self, x: torch.Tensor, parity: int) -> list[torch.Tensor]:
        """Each rank's slot of this call's set, viewed as x's shape and dtype."""
        key = (x.shape, x.dtype, parity)
        views = self._views.get(key)
        if views is None:
            views = []
            for r in range(self.world_size):
                start = (parity * self.world_size + r) * self.slot_bytes
                raw = self._data[start : start + x.nbytes]
                views.append(raw.view(x.dtype).view(x.shape))
            self._views[key] = views
        return views

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publishes `x` in this rank's slot and returns every rank's, once all have written."""
        call = int(self._flags[self.rank]) + 1
        slots = self._slots(x, call & 1)
        slots[self.rank].copy_(x)
        self._flags[self.rank] = call  # after the copy: x86 keeps stores in order
        flags = self._flags
        spins = 0
        while flags.min() < call:
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:  # more ranks than free cores: let the others run
                os.sched_yield()
        return slots

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., world_size * n], rank 0's columns first."""
        return torch.cat(self._exchange(x), dim=-1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `x`, written into `x` (also returned)."""
        slots = self._exchange(x)
        torch.add(slots[0], slots[1], out=x)
        for r in range(2, self.world_size):
            x.add_(slots[r])
        return x

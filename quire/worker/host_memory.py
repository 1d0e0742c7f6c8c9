"""Host memory on transparent huge pages for the large CPU tensors: the weights (adapter stacks
included) and the KV cache.

A CPU decode step streams every weight and most of the KV cache once. On 4 KiB pages that is a
TLB miss every 4 KiB, and the hardware prefetchers stop at each page boundary; Linux backs memory
with 2 MiB pages instead when a range is advised (madvise(MADV_HUGEPAGE)) before it is first
touched, with transparent huge pages in "madvise" or "always" mode. Measured here, interleaved
in one process: decode steps 2-4% faster at batch 1 and at batch 32 (docs/BENCHMARKS.md). Best
effort: where the advice is not taken the memory is ordinary memory. EngineConfig.huge_pages
(default: QUIRE_HUGE_PAGES) turns it off; the engine passes it to each allocation.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import sys

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGNMENT = 64  # of each tensor carved from an arena: a cache line, as torch's allocator gives
# smaller tensors stay where they are; a layer's LoRA stacks (64 KiB - 1 MiB for SmolLM2 at rank
# 16), read every decode step as the weights are, move
_MIN_TENSOR_BYTES = 1 << 16
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def supported() -> bool:
    """Whether asking for huge pages can work here: Linux with transparent huge pages not
    "never"."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(_THP_MODE) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@functools.cache
def _madvise():
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def arena(num_bytes: int, huge_pages: bool) -> torch.Tensor:
    """`num_bytes` of zero-filled CPU memory (uint8) starting on a huge-page boundary and, with
    `huge_pages` where `supported()`, advised to huge pages. It is a private anonymous mapping,
    which the kernel fills with zeros page by page as each is first touched: no time goes to
    zeroing it up front (seconds for the default 4 GiB KV pool), and pages never used take no
    memory."""
    size = -(-num_bytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(
        -1,
        size + HUGE_PAGE,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    offset = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[offset : offset + size]
    if huge_pages and supported() and _madvise()(buffer.data_ptr(), size, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return buffer[:num_bytes]


Specs = list[tuple[tuple[int, ...], torch.dtype]]  # (shape, dtype) of each tensor


def _offsets(specs: Specs) -> tuple[list[int], int]:
    """Where each tensor of `specs` starts, one after the other on cache lines, and the end."""
    offsets, end = [], 0
    for shape, dtype in specs:
        start = -(-end // _ALIGNMENT) * _ALIGNMENT
        offsets.append(start)
        end = start + dtype.itemsize * math.prod(shape)
    return offsets, end


def arena_bytes(specs: Specs) -> int:
    """The bytes `carve` needs for `specs`."""
    return _offsets(specs)[1]


def carve(buffer: torch.Tensor, specs: Specs) -> list[torch.Tensor]:
    """Tensors of the given shapes and dtypes laid one after the other in `buffer` (uint8, from
    `arena(arena_bytes(specs), ...)`), each starting on a cache line; what the buffer holds."""
    return [
        buffer[start : start + dtype.itemsize * math.prod(shape)].view(dtype).view(shape)
        for start, (shape, dtype) in zip(_offsets(specs)[0], specs, strict=True)
    ]


def zeros(specs: Specs, huge_pages: bool) -> list[torch.Tensor]:
    """Zero-filled tensors of the given shapes and dtypes in one arena (on huge pages if asked),
    its pages faulted in as first written."""
    return carve(arena(arena_bytes(specs), huge_pages), specs)


def _movable(t: torch.Tensor) -> bool:
    """A dense CPU tensor of at least _MIN_TENSOR_BYTES that is all of its storage (a view into
    a larger tensor is left alone, so that no aliasing is broken)."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_mkldnn
        and t.nbytes >= _MIN_TENSOR_BYTES
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.nbytes
    )


def move_to_huge_pages(module: nn.Module) -> int:
    """Copies the module's large tensors (parameters, buffers and tensor attributes such as
    packed weights) into one huge-page arena and rebinds them; returns the bytes moved. Shared
    tensors (tied embeddings) stay shared. Call it before anything keeps raw data pointers (the
    C decode path takes them at its first step). Nothing moves where huge pages are not
    `supported()`."""
    if not supported():
        return 0
    # Each distinct storage once, with every place that refers to it.
    found: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, str]]]] = {}
    for m in module.modules():
        places = [("param", name, p) for name, p in m._parameters.items() if p is not None]
        places += [("buffer", name, b) for name, b in m._buffers.items() if b is not None]
        places += [
            ("attr", name, v)
            for name, v in vars(m).items()
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
        ]
        for kind, name, t in places:
            if _movable(t):
                key = t.untyped_storage().data_ptr()
                found.setdefault(key, (t, []))[1].append((m, kind, name))
    if not found:
        return 0
    copies = zeros([(tuple(t.shape), t.dtype) for t, _ in found.values()], huge_pages=True)
    moved = sum(t.nbytes for t, _ in found.values())
    # One tensor at a time, each original dropped once rebound, so that the peak is the weights
    # plus the largest tensor, not twice the weights (the arena's pages fault in as written).
    for new in copies:
        t, places = found.pop(next(iter(found)))  # in insertion order, as specs
        new.copy_(t)
        for m, kind, name in places:
            if kind == "param":
                m._parameters[name].data = new  # the Parameter object stays (and stays shared)
            elif kind == "buffer":
                m._buffers[name] = new
            else:
                setattr(m, name, new)
        del t
    logger.info("Weights on huge pages: %d tensors, %.0f MiB", len(copies), moved / 2**20)
    return moved

"""Triton kernels for the GPU path: attention over the paged KV cache, and the pointwise ops
fused around it (pointwise.py).

The fused pointwise kernels run only where a forward is captured into a CUDA graph
(`fused_pointwise()`, worker/cuda_graph.py): there each saves the device two to eight of
PyTorch's kernels. Launched eagerly from Python, a Triton kernel costs the host more than the
PyTorch ops it replaces, and eager GPU steps are host-bound.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from types import ModuleType

import torch

_FUSED_POINTWISE = contextvars.ContextVar("fused_pointwise", default=False)


@contextlib.contextmanager
def fused_pointwise() -> Iterator[None]:
    """Within it, the layers run CUDA tensors through the fused Triton kernels."""
    token = _FUSED_POINTWISE.set(True)
    try:
        yield
    finally:
        _FUSED_POINTWISE.reset(token)


def gpu_pointwise(x: torch.Tensor) -> ModuleType | None:
    """quire.kernels.pointwise inside `fused_pointwise()`, for a CUDA tensor its kernels take;
    else None (Triton is imported on a GPU only)."""
    if not x.is_cuda or not _FUSED_POINTWISE.get():
        return None
    pointwise = _import_pointwise()
    return pointwise if pointwise is not None and pointwise.supported(x) else None


@functools.cache
def _import_pointwise() -> ModuleType | None:
    try:
        from quire.kernels import pointwise
    except ImportError:  # no Triton: PyTorch's ops
        return None
    return pointwise

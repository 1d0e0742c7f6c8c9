"""ctypes wrappers of pointwise.c: fused residual add + RMSNorm and in-place rotary, bf16 on CPU.

Callers check `supported(tensor)` and keep their PyTorch code as the fallback (float32, other
devices, no C compiler); both give the same bits as Hugging Face's bf16 modules.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from quire.kernels.cpu import load_library


@functools.cache
def _functions() -> tuple | None:
    lib = load_library()
    if lib is None:
        return None
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    norm = lib.add_rms_norm_bf16
    norm.argtypes = [ptr, i64, ptr, ptr, ptr, i32, i32, f32, i32]
    rotary = lib.rotary_bf16
    rotary.argtypes = [ptr, i64, ptr, ptr, i32, i32, i32, i32]
    for fn in (norm, rotary):
        fn.restype = ctypes.c_int
    return norm, rotary


def supported(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and _functions() is not None


def rotary_supported(x: torch.Tensor) -> bool:
    """x [tokens, heads, head_dim] with heads packed in each token's row (a view into qkv is)."""
    return supported(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def add_rms_norm(
    x: torch.Tensor,  # [rows, dim]; rows may be strided, each row contiguous
    residual: torch.Tensor | None,  # [rows, dim] contiguous, updated in place to x + residual
    weight: torch.Tensor,  # [dim]
    eps: float,
) -> torch.Tensor:  # [rows, dim]
    rows, dim = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, dim), dtype=x.dtype)
    status = _functions()[0](
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        eps,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"add_rms_norm: hidden size {dim} is over the kernel's 16384")
    return out


def rotary_(
    x: torch.Tensor,  # [tokens, heads, head_dim], heads and head_dim contiguous; rotated in place
    cos: torch.Tensor,  # [tokens, 1, head_dim] contiguous
    sin: torch.Tensor,
) -> None:
    tokens, num_heads, head_dim = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    status = _functions()[1](
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        num_heads,
        head_dim,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"rotary: head_dim {head_dim} must be even and at most 512")

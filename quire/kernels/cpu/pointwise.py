"""ctypes wrappers of pointwise.c: fused residual add + RMSNorm and in-place rotary, bf16 on CPU.

Callers check `supported(tensor)` and keep their PyTorch code as the fallback (float32, other
devices, no C compiler). The kernels round step by step as Hugging Face's bf16 modules do.
"""

from __future__ import annotations

import torch

from quire.kernels.cpu import load_library


def supported(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and load_library() is not None


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
    status = load_library().add_rms_norm_bf16(
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
    status = load_library().rotary_bf16(
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

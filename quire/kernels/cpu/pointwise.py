"""ctypes wrappers of pointwise.c: fused residual add + RMSNorm, in-place rotary and SiLU-and-mul,
bf16 on CPU, and the greedy sampler's argmax over float32 logits.

Callers check `supported(tensor)` and keep their PyTorch code as the fallback (float32, other
devices, no C compiler). The kernels round step by step as Hugging Face's bf16 modules do.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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


@functools.cache
def silu_table() -> torch.Tensor:  # [65536] float32, indexed by the unsigned bf16 bit pattern
    """torch's bf16 SiLU of every bf16 bit pattern (NaNs and infinities included), widened to
    float32 (exactly), so the C kernels' activation is torch's bit for bit."""
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return torch.roll(F.silu(every_bf16.view(torch.bfloat16)), 2**15).float()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2 * d] contiguous -> [rows, d]
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    load_library().silu_and_mul_bf16(
        gate_up.data_ptr(),
        silu_table().data_ptr(),
        out.data_ptr(),
        rows,
        width // 2,
        torch.get_num_threads(),
    )
    return out


def _float32_cpu_rows(x: torch.Tensor) -> bool:
    """Whether the C kernels can read x as it is: contiguous float32 rows in CPU memory."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, cols] float32 -> [rows] int64
    """`x.argmax(dim=-1)` for contiguous float32 rows on CPU (ties and NaNs as torch: the first
    maximum, the first NaN), in one vectorized pass; torch's reduction over one row of a 49k
    vocabulary takes ~30 us, as long as the rest of a batch-1 step's sampling."""
    rows, cols = x.shape
    lib = load_library()
    if lib is None or not _float32_cpu_rows(x) or cols < 1:
        return x.argmax(dim=-1)
    out = torch.empty(rows, dtype=torch.int64)
    lib.argmax_f32(x.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads())
    return out


def apply_token_bitmask(
    logits: torch.Tensor,  # [S, V] float32
    bitmask: torch.Tensor,  # [R, ceil(V / 32)] int32
    rows: list[int],  # the R rows of logits the masks apply to
) -> bool:
    """Sets the tokens each masked row's bits forbid to -inf, in place, in one parallel pass;
    False (logits untouched) where the C kernel does not run (not float32 CPU rows)."""
    lib = load_library()
    if lib is None or not _float32_cpu_rows(logits) or bitmask.dtype != torch.int32:
        return False
    bitmask = bitmask.contiguous()
    index = torch.tensor(rows, dtype=torch.int64)
    status = lib.apply_token_bitmask_f32(
        logits.data_ptr(),
        logits.shape[1],
        bitmask.data_ptr(),
        bitmask.shape[1],
        index.data_ptr(),
        len(rows),
        torch.get_num_threads(),
    )
    return status == 0

"""Triton twins of quire/kernels/cpu/pointwise.c for the GPU: the residual add and RMSNorm in one
pass, Qwen3's per-head q/k RMSNorm with the rotary embedding in one pass over the qkv buffer, and
SiLU-and-mul. Each replaces two to eight of PyTorch's kernels, which at decode sizes cost their
launch, not their bytes.

Each computes in float32 and rounds where the model's modules hand a tensor on (the residual
sum, the normed q/k before the rotation, each output); the rotation and the gate round once, not
after every op, so bf16 results can sit an ulp from PyTorch's. One program per token row: a
row's result never depends on the rows beside it.

Callers check `supported(tensor)` and keep their PyTorch code as the fallback.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILE = 16384  # elements of one program's tile: a norm's row, a token's q/k heads


def supported(x: torch.Tensor) -> bool:
    """A CUDA tensor of a float dtype whose last dimension is contiguous."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.stride(-1) == 1
    )


def norm_supported(x: torch.Tensor) -> bool:
    """Rows [rows, dim] that one program's tile holds."""
    return x.dim() == 2 and triton.next_power_of_2(x.shape[1]) <= MAX_TILE


def rotary_supported(qk: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with heads packed in each token's row (a view into qkv is),
    whose heads one program's tile holds."""
    tokens, heads, head_dim = qk.shape
    return (
        qk.stride(1) == head_dim
        and head_dim % 2 == 0
        and triton.next_power_of_2(heads) * triton.next_power_of_2(head_dim // 2) <= MAX_TILE
    )


def _num_warps(block: int) -> int:
    # At least as many elements as threads (32 a warp), so no element is held by two threads:
    # add_rms_norm stores the residual and the q/k kernel its rows in place, before or after
    # reductions that every thread joins.
    return 1 if block <= 256 else 4 if block <= 2048 else 8


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * dim + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * dim + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * dim + cols, (x * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask
    )


def add_rms_norm(
    x: torch.Tensor,  # [rows, dim]; rows may be strided, each row contiguous
    residual: torch.Tensor | None,  # [rows, dim] contiguous, updated in place to x + residual
    weight: torch.Tensor,  # [dim]
    eps: float,
) -> torch.Tensor:  # [rows, dim]: rms_norm(x + residual) * weight
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(dim)
    _add_rms_norm_kernel[(rows,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        x.stride(0),
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out


@triton.jit
def _qk_norm_rotary_kernel(
    qk_ptr,  # [tokens, heads, head_dim], heads and head_dim contiguous
    q_weight_ptr,  # [head_dim]
    k_weight_ptr,
    cos_ptr,  # [tokens, head_dim] contiguous
    sin_ptr,
    stride_token,
    num_heads,  # query heads and key heads together
    num_q_heads,
    q_eps,
    k_eps,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half = HEAD_DIM // 2
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half
    mask = (heads[:, None] < num_heads) & dim_mask[None, :]
    first = qk_ptr + token * stride_token + heads[:, None] * HEAD_DIM + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # each head's RMSNorm, its q or k weight, rounded as the module hands it on
        is_q_head = heads < num_q_heads
        eps = tl.where(is_q_head, q_eps, k_eps)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        is_q = is_q_head[:, None]
        w1 = tl.where(
            is_q,
            tl.load(q_weight_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :],
            tl.load(k_weight_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :],
        )
        w2 = tl.where(
            is_q,
            tl.load(q_weight_ptr + half + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :],
            tl.load(k_weight_ptr + half + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :],
        )
        x1 = (x1 * rstd[:, None] * w1).to(qk_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * rstd[:, None] * w2).to(qk_ptr.dtype.element_ty).to(tl.float32)
    table = token * HEAD_DIM + dims
    cos1 = tl.load(cos_ptr + table, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + table + half, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + table, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + table + half, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    out_dtype = qk_ptr.dtype.element_ty
    tl.store(first, (x1 * cos1 - x2 * sin1).to(out_dtype), mask=mask)
    tl.store(first + half, (x2 * cos2 + x1 * sin2).to(out_dtype), mask=mask)


def qk_norm_rotary_(
    qk: torch.Tensor,  # [tokens, q_heads + k_heads, head_dim], heads packed; changed in place
    num_q_heads: int,
    cos: torch.Tensor,  # [tokens, 1, head_dim]
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,  # [head_dim]: each head's RMSNorm first (Qwen3)
    k_weight: torch.Tensor | None = None,
    q_eps: float = 1e-6,
    k_eps: float = 1e-6,
) -> None:
    """Rotates the queries and keys (rotate-half form) in place, each head RMS-normed first when
    weights are given. `rotary_supported(qk)`."""
    tokens, num_heads, head_dim = qk.shape
    assert qk.stride(2) == 1 and rotary_supported(qk)
    if tokens == 0:
        return
    cos, sin = (
        cos.reshape(tokens, head_dim).contiguous(),
        sin.reshape(tokens, head_dim).contiguous(),
    )
    has_norm = q_weight is not None
    block_h = triton.next_power_of_2(num_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    _qk_norm_rotary_kernel[(tokens,)](
        qk,
        q_weight if has_norm else cos,
        k_weight if has_norm else cos,
        cos,
        sin,
        qk.stride(0),
        num_heads,
        num_q_heads,
        q_eps,
        k_eps,
        HEAD_DIM=head_dim,
        HAS_NORM=has_norm,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=_num_warps(block_h * block_half),
    )


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [rows, 2 * dim]
    out_ptr,  # [rows, dim]
    stride_in,
    dim,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + dim + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2 * d] -> [rows, d]
    rows, width = gate_up.shape
    dim = width // 2
    out = torch.empty((rows, dim), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(triton.next_power_of_2(dim), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(dim, block))](
        gate_up, out, gate_up.stride(0), dim, BLOCK=block, num_warps=4
    )
    return out

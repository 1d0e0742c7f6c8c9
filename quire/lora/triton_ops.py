"""The GPU LoRA ops: Triton shrink and expand kernels over a step's rows grouped by adapter slot
(LoRAMapping.sorted_rows / group_*), one launch each for every adapter of the step (Punica's
SGMV: a program takes a block of one group's rows, so prompt chunks and decode rows go the same
way).

- shrink: u[i] = A[slot] x[row_i] for the fused modules' ranks at once; u float32, in sorted
  order.
- expand, per fused module: out[row_i, cols] += u[i, its ranks] B[slot, cols]^T, summed in float32
  and rounded once to out's dtype.

The stacks are in the model's dtype (bf16 or float32: half the bytes in bf16); each block is
widened to float32 as it is loaded, and the dots run in IEEE float32 (not TF32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from quire.layers.lora_linear import LoRAMapping

BLOCK_M = 16  # rows of a group per program
BLOCK_N = 32  # output columns per program (ranks for shrink)
BLOCK_K = 32  # the reduction's step


@triton.jit
def _shrink_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [max_loras, R, K] bf16 or float32
    u_ptr,  # [rows with an adapter, R] float32, in sorted order
    sorted_rows_ptr,
    group_slots_ptr,
    group_starts_ptr,
    group_sizes_ptr,
    K,
    R,
    stride_xm,
    stride_as,
    stride_ar,
    stride_um,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    group = tl.program_id(0)
    size = tl.load(group_sizes_ptr + group)
    if tl.program_id(1) * BLOCK_M >= size:
        return
    start = tl.load(group_starts_ptr + group)
    slot = tl.load(group_slots_ptr + group).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < size
    rows = tl.load(sorted_rows_ptr + start + offs_m, mask=mask_m, other=0)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        a = tl.load(
            a_ptr + slot * stride_as + offs_n[None, :] * stride_ar + offs_k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_K, BLOCK_N]: A^T's block
        acc += tl.dot(x, a, input_precision="ieee")  # float32, not TF32
    tl.store(
        u_ptr + (start + offs_m)[:, None] * stride_um + offs_n[None, :],
        acc,
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _expand_kernel(
    u_ptr,  # [rows with an adapter, R] float32, in sorted order
    b_ptr,  # [max_loras, max_rank, out] bf16 or float32 (B transposed)
    out_ptr,  # [num_tokens, out]
    sorted_rows_ptr,
    group_slots_ptr,
    group_starts_ptr,
    group_sizes_ptr,
    N,  # this module's columns
    MAX_RANK,
    u_first,  # this module's first rank column in u
    out_first,  # this module's first output column (and row of B)
    stride_um,
    stride_bs,
    stride_br,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    group = tl.program_id(0)
    size = tl.load(group_sizes_ptr + group)
    if tl.program_id(1) * BLOCK_M >= size:
        return
    start = tl.load(group_starts_ptr + group)
    slot = tl.load(group_slots_ptr + group).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < size
    rows = tl.load(sorted_rows_ptr + start + offs_m, mask=mask_m, other=0)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, MAX_RANK, BLOCK_K):
        offs_r = r0 + tl.arange(0, BLOCK_K)
        mask_r = offs_r < MAX_RANK
        u = tl.load(
            u_ptr + (start + offs_m)[:, None] * stride_um + u_first + offs_r[None, :],
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + (out_first + offs_n)[None, :],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_K, BLOCK_N]: B^T's block
        acc += tl.dot(u, b, input_precision="ieee")
    out_ptrs = out_ptr + rows[:, None] * stride_om + (out_first + offs_n)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=mask)


class TritonLoRAOps:
    """quire/layers/lora_linear.LoRAOps on Triton kernels (contiguous rows in x and out)."""

    def add_lora(
        self,
        out: torch.Tensor,  # [num_tokens, out]
        x: torch.Tensor,  # [num_tokens, in]
        lora_a: torch.Tensor,  # [max_loras, modules * max_rank, in]
        lora_b: torch.Tensor,  # [max_loras, max_rank, out]
        out_slices: Sequence[tuple[int, int]],
        mapping: LoRAMapping,
    ) -> None:
        num_rows = mapping.sorted_rows.numel()
        if num_rows == 0:
            return
        assert x.stride(1) == 1 and out.stride(1) == 1
        groups = mapping.group_slots.numel()
        ranks = lora_a.shape[1]
        u = torch.empty(num_rows, ranks, dtype=torch.float32, device=x.device)
        row_blocks = triton.cdiv(num_rows, BLOCK_M)
        _shrink_kernel[(groups, row_blocks, triton.cdiv(ranks, BLOCK_N))](
            x,
            lora_a,
            u,
            mapping.sorted_rows,
            mapping.group_slots,
            mapping.group_starts,
            mapping.group_sizes,
            x.shape[1],
            ranks,
            x.stride(0),
            lora_a.stride(0),
            lora_a.stride(1),
            u.stride(0),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
        max_rank = lora_b.shape[1]
        for i, (first, size) in enumerate(out_slices):
            _expand_kernel[(groups, row_blocks, triton.cdiv(size, BLOCK_N))](
                u,
                lora_b,
                out,
                mapping.sorted_rows,
                mapping.group_slots,
                mapping.group_starts,
                mapping.group_sizes,
                size,
                max_rank,
                i * max_rank,
                first,
                u.stride(0),
                lora_b.stride(0),
                lora_b.stride(1),
                out.stride(0),
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K,
            )

"""Flash-decoding over the paged KV cache: one query token per request, split-K over the context.

Pass 1 runs one program per (request, KV head, partition). It loads the query rows of every head
in the KV head's GQA group as one tile (padded to at least 16 rows so `tl.dot` can use tensor
cores), streams its partition of the context through an online softmax, and writes the
partition's normalized output with its log-sum-exp. Pass 2 merges the partitions of each
(request, query head) with the log-sum-exp rule. With a single partition, pass 1 writes the final
output and pass 2 is skipped.

Softmax runs in base 2: scores are scaled by `scale * log2(e)` so `exp2` replaces `exp`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = math.log2(math.e)
MAX_PARTITION_SIZE = 512  # tokens per split when the grid is already full
MIN_PARTITION_SIZE = 128  # the smallest split the grid heuristic picks
PROGRAMS_PER_SM = 4  # pass-1 programs per SM that count as a full GPU
KV_TILE = 64  # context tokens per loop iteration


@triton.jit
def _paged_decode_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # one partition: [num_seqs, num_heads, head_dim]; else fp32 [.., P, head_dim]
    lse_ptr,  # fp32 [num_seqs, num_heads, P]; only written when SPLIT
    qk_scale,  # softmax scale * log2(e)
    stride_qs,
    stride_qh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt,
    stride_os,
    stride_oh,
    stride_op,
    stride_ls,
    stride_lh,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = partition * PARTITION_SIZE
    if SPLIT:
        if start >= seq_len:  # past this request's context: pass 2 will not read it
            return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)

    groups = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP_SIZE + groups  # [BLOCK_G]
    head_mask = (groups[:, None] < GROUP_SIZE) & (dims[None, :] < HEAD_DIM)  # [BLOCK_G, BLOCK_D]
    q = tl.load(
        query_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kc_head
    v_head = v_cache_ptr + kv_head * stride_vc_head
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        pos_mask = pos < end
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = pos_mask[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_N, BLOCK_D]
        k_rows = k_head + block[:, None] * stride_kc_block + offset[:, None] * stride_kc_slot
        v_rows = v_head + block[:, None] * stride_vc_block + offset[:, None] * stride_vc_slot
        k = tl.load(k_rows + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_rows + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty context (seq_len 0, a padded request) has l_i == 0 and yields zeros.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_rows = out_ptr + seq * stride_os + partition * stride_op + heads[:, None] * stride_oh
    tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=head_mask)
    if SPLIT:
        tl.store(
            lse_ptr + seq * stride_ls + heads * stride_lh + partition,
            m_i + tl.log2(l_i),
            mask=groups < GROUP_SIZE,
        )


@triton.jit
def _merge_partitions_kernel(
    partial_out_ptr,  # fp32 [num_seqs, num_heads, num_partitions, head_dim]
    lse_ptr,  # fp32 [num_seqs, num_heads, num_partitions]
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_ps,
    stride_ph,
    stride_pp,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_partitions = tl.cdiv(seq_len, PARTITION_SIZE)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    partial_out = partial_out_ptr + seq * stride_ps + head * stride_ph
    lse_row = lse_ptr + seq * stride_ls + head * stride_lh

    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for partition in range(0, num_partitions):
        lse = tl.load(lse_row + partition)
        o = tl.load(partial_out + partition * stride_pp + dims, mask=dim_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + weight * o
        denom = denom * alpha + weight
        m = m_new

    out = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pick_partition_size(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Largest split (fewest partials to merge) that still gives every SM enough programs."""
    target_programs = PROGRAMS_PER_SM * _num_sms(device)
    rows = num_seqs * num_kv_heads
    size = MAX_PARTITION_SIZE
    while size > MIN_PARTITION_SIZE and rows * triton.cdiv(max_seq_len, size) < target_programs:
        size //= 2
    return size


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    partition_size: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of each request's one new query token over its first `seq_lens[i]` cached tokens.

    `max_seq_len` bounds `seq_lens` and sets the number of partitions; pass a fixed bound (the
    model's max length) to keep the launch grid constant, e.g. under CUDA graphs.
    `partition_size` (tokens per split, a power of two >= 16) is picked from the grid when None.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0
    assert query.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if partition_size is None:
        partition_size = _pick_partition_size(num_seqs, num_kv_heads, max_seq_len, query.device)
    assert partition_size >= 16 and partition_size & (partition_size - 1) == 0
    num_partitions = max(1, triton.cdiv(max_seq_len, partition_size))
    split = num_partitions > 1
    group_size = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16

    if split:
        partial_out = torch.empty(
            num_seqs, num_heads, num_partitions, head_dim, dtype=torch.float32, device=query.device
        )
        lse = torch.empty(
            num_seqs, num_heads, num_partitions, dtype=torch.float32, device=query.device
        )
        dest, dest_partition_stride = partial_out, partial_out.stride(2)
        lse_strides = lse.stride(0), lse.stride(1)
    else:
        lse = out  # never written with one partition
        dest, dest_partition_stride = out, 0
        lse_strides = 0, 0

    # TRITON_INTERPRET=1 at import: Triton decorated the kernels for its interpreter.
    interpret = isinstance(_paged_decode_kernel, InterpretedFunction)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        dest,
        lse,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        dest.stride(0),
        dest.stride(1),
        dest_partition_stride,
        *lse_strides,
        GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PARTITION_SIZE=partition_size,
        SPLIT=split,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        BLOCK_N=min(KV_TILE, partition_size),
        BLOCK_D=block_d,
        # The interpreter's tl.dot is wrong on bf16 (triton#11584): it gets fp32 operands.
        DOT_FP32=interpret,
        # fp32 caches keep full-precision dots instead of the TF32 default.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4 if block_d <= 128 else 8,
        num_stages=2,
    )
    if split:
        _merge_partitions_kernel[(num_seqs, num_heads)](
            partial_out,
            lse,
            seq_lens,
            out,
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            PARTITION_SIZE=partition_size,
            BLOCK_D=block_d,
            num_warps=1 if block_d <= 128 else 2,
        )
    return out

"""Prefill attention over the paged KV cache: prompt chunks attend to their cached prefix + chunk.

Each request's chunk of new tokens sits at context positions `[seq_len - query_len, seq_len)`
and attends causally to positions `0..own position`, all read from the paged cache (`store_kv`
has already written the chunk's K/V). One program handles one (query block, request, KV head).
Its tile rows are (token, query head) pairs: `BLOCK_M // group_size` consecutive tokens times the
`group_size` query heads sharing the KV head, so each K/V tile feeds the whole GQA group. The
context streams through a flash-attention online softmax in base 2 with fp32 accumulation; tiles
entirely before the block's first query position skip every mask.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = math.log2(math.e)
MIN_BLOCK_M = 64  # tile rows: (token, head) pairs per program


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, BLOCK_D]
    m_i,  # [BLOCK_M] running max (base 2)
    l_i,  # [BLOCK_M] running sum of exp2
    acc,  # [BLOCK_M, BLOCK_D] fp32
    q_pos,  # [BLOCK_M] context position of each row's token
    tile_start,
    kv_end,
    block_table,  # pointer to this request's block-table row
    k_head,  # pointer to the KV head's column in k_cache
    v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_vc_block,
    stride_vc_slot,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    dims = tl.arange(0, BLOCK_D)
    if MASKED:
        pos_mask = pos < kv_end
        kv_mask = pos_mask[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_N, BLOCK_D]
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=pos_mask, other=0)
    else:
        kv_mask = dims[None, :] < HEAD_DIM
        block = tl.load(block_table + pos // BLOCK_SIZE)
    block = block.to(tl.int64)
    offset = pos % BLOCK_SIZE
    k_rows = k_head + block[:, None] * stride_kc_block + offset[:, None] * stride_kc_slot
    v_rows = v_head + block[:, None] * stride_vc_block + offset[:, None] * stride_vc_slot
    k = tl.load(k_rows + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_rows + dims[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        # Causal; rows of valid tokens have q_pos < seq_len, so this also drops keys past kv_end.
        scores = tl.where(pos[None, :] <= q_pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_paged_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Later query blocks attend to more keys: launch them first so the long ones do not trail.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = q_block * BLOCK_Q  # this program's first token within the chunk
    if first >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    tok = first + rows // GROUP_SIZE  # [BLOCK_M] token within the chunk
    heads = kv_head * GROUP_SIZE + rows % GROUP_SIZE  # [BLOCK_M] query head
    row_mask = (rows < BLOCK_Q * GROUP_SIZE) & (tok < query_len)
    io_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    tokens = (q_start + tok).to(tl.int64)
    q = tl.load(
        query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=io_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = prefix_len + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kc_head
    v_head = v_cache_ptr + kv_head * stride_vc_head
    # Keys before the block's first query position are visible to every row: no masks.
    kv_end = tl.minimum(seq_len, prefix_len + first + BLOCK_Q)
    unmasked_end = (prefix_len + first) // BLOCK_N * BLOCK_N
    for tile_start in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, tile_start, kv_end, block_table, k_head, v_head,
            stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, False, DOT_FP32, DOT_PRECISION,
        )  # fmt: skip
    for tile_start in range(unmasked_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, tile_start, kv_end, block_table, k_head, v_head,
            stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, DOT_FP32, DOT_PRECISION,
        )  # fmt: skip

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def prefill_paged(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, starting at 0
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached prefix + chunk
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each request's chunk over its whole context in the paged cache."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0
    assert query.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group_size = num_heads // num_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group_size))
    block_q = block_m // group_size  # chunk tokens per program
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16

    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_paged_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
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
        out.stride(0),
        out.stride(1),
        GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=64 if block_d <= 128 else 32,
        BLOCK_D=block_d,
        # The interpreter's tl.dot is wrong on bf16 (triton#11584): it gets fp32 operands.
        DOT_FP32=isinstance(_prefill_paged_kernel, InterpretedFunction),
        # fp32 caches keep full-precision dots instead of the TF32 default.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4 if block_d <= 128 else 8,
        num_stages=2,
    )
    return out

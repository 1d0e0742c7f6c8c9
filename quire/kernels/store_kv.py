"""Writes a step's new K and V rows into the paged KV cache, one program per new token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask
    )
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(
        k_dst + heads[:, None] * stride_kc_head + dims[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + heads[:, None] * stride_vc_head + dims[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a slot < 0 skips the token (padding)
) -> None:
    """Copies token t's K and V into cache slot `slot_mapping[t]` (= block * block_size + offset)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = k_cache.shape[1]
    assert key.stride(-1) == value.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )

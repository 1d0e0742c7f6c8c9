"""The reference attention backend, and the CPU path: PyTorch ops over gathered cache blocks.

Decodes (one query token each) run in the C kernel of quire/kernels/cpu when it can be built (it
reads K/V through the block table, no gathered copy); otherwise as one padded batch: every
decode sequence's blocks are gathered into a `[num_decodes, max_blocks * block_size,
num_kv_heads, head_dim]` tensor and masked past its length.
Prefill chunks likewise run in a C kernel when it can be built for the dtype (bf16 on CPUs with
AVX-512 BF16: all chunks of a step in one call, K/V read through the block table).

A quantized cache (kernels/kv_format.py) is written by the C quantizer, each token's row on its
own, and read in its codes by the C decode kernel and by the C prefill kernel (which dequantizes
each row to bf16 as it packs the context: a token's bits still depend only on its context's
codes), or prefill chunks run as decodes where that kernel does not run. There is no PyTorch fallback for it (checked at start). Where it
cannot and the dtype is bf16 (an AVX2-only CPU), each prompt token runs as a decode over its
context in the decode kernel, so that its bits do not depend on chunking or batching; otherwise
(float32, or no C kernels) one request at a time with `scaled_dot_product_attention` over the
gathered prefix plus the chunk, causal with the chunk's offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quire.attention.backend import AttentionBackend, AttentionMetadata
from quire.kernels import cpu as cpu_kernels
from quire.kernels import kv_format


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim (+ 4 quantized)]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    if kv_format.is_quantized(k_cache.dtype) or (
        k_cache.device.type == "cpu"
        and k_cache.dtype == key.dtype == torch.bfloat16
        and key.stride(1) == key.shape[2]
        and value.stride(1) == value.shape[2]
        and key.stride(2) == value.stride(2) == 1
        and cpu_kernels.load_library() is not None
    ):
        cpu_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value
    )


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [..., num_blocks_per_seq] int
) -> torch.Tensor:  # [..., num_blocks_per_seq * block_size, num_kv_heads, head_dim]
    gathered = cache[block_table.long()]
    return gathered.flatten(-4, -3)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        if metadata.num_decodes == metadata.num_seqs:  # decode-only step: no copy into output
            return self._decode(query, k_cache, v_cache, metadata, scale)
        output = torch.empty_like(query)
        if metadata.num_decodes > 0:
            n = metadata.num_decode_tokens
            output[:n] = self._decode(query[:n], k_cache, v_cache, metadata, scale)
        self._prefill(query, k_cache, v_cache, metadata, scale, output)
        return output

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_decodes = metadata.num_decodes
        if query.device.type == "cpu" and cpu_kernels.supports_paged_decode(
            query.dtype, query.shape[1], k_cache.shape[2], query.shape[2]
        ):  # a quantized cache always comes here (kv_format.cache_dtype)
            return cpu_kernels.paged_decode(
                query,
                k_cache,
                v_cache,
                metadata.block_tables[:num_decodes],
                metadata.seq_lens[:num_decodes],
                scale,
            )
        return gathered_decode(query, k_cache, v_cache, metadata, scale)

    def _prefill(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        if query.device.type == "cpu" and cpu_kernels.supports_prefill_attention(
            query.dtype, query.shape[1], k_cache.shape[2], query.shape[2]
        ):
            # All prefill chunks in one call, reading K/V (the chunks' own included, stored
            # above) from the cache through the block tables.
            n = metadata.num_decode_tokens
            block_tables, query_start_loc, seq_lens = metadata.prefill_tables()
            cpu_kernels.prefill_attention(
                query[n:],
                k_cache,
                v_cache,
                block_tables,
                query_start_loc,
                seq_lens,
                scale,
                output[n:],
            )
            return
        if (
            query.device.type == "cpu"
            and query.dtype == torch.bfloat16
            and cpu_kernels.supports_paged_decode(
                query.dtype, query.shape[1], k_cache.shape[2], query.shape[2]
            )
        ):
            decoded_prefill(query, k_cache, v_cache, metadata, scale, output)
            return
        gathered_prefill(query, k_cache, v_cache, metadata, scale, output)


def decoded_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    output: torch.Tensor,
) -> None:
    """Prefill attention as one decode per prompt token, over the context up to it, in the paged
    decode kernel: where the prefill kernel does not run (no AVX2, or a head_dim it does not
    take), a token's bits are then the same whatever chunk its prompt was cut into and
    whatever else is in the batch, as in decode. Writes the prefill tokens' rows of `output`."""
    n = metadata.num_decode_tokens
    block_tables, query_start_loc, seq_lens = metadata.prefill_tables()
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)  # request of token
    offset = torch.arange(len(owner)) - query_start_loc[:-1].long()[owner]  # index in its chunk
    token_seq_lens = (seq_lens.long()[owner] - query_lens[owner] + offset + 1).to(torch.int32)
    output[n:] = cpu_kernels.paged_decode(
        query[n:], k_cache, v_cache, block_tables[owner], token_seq_lens, scale
    )


def gathered_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    output: torch.Tensor,
) -> None:
    """Prefill attention in plain PyTorch: per request, gather its blocks and run SDPA, causal
    with the chunk's offset; writes the prefill tokens' rows of `output`."""
    block_size = k_cache.shape[1]
    starts = metadata.query_start_loc_cpu
    for i in range(metadata.num_decodes, metadata.num_seqs):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        seq_len = metadata.seq_lens_cpu[i]
        num_blocks = -(-seq_len // block_size)
        block_table = metadata.block_tables[i, :num_blocks]
        # 4-D inputs: SDPA's CPU flash kernel takes only those (3-D falls back to the math
        # path, 6x slower on a 2048-token prompt).
        k = gather_kv(k_cache, block_table)[:seq_len].transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = gather_kv(v_cache, block_table)[:seq_len].transpose(0, 1)[None]
        q = query[start:end].transpose(0, 1)[None]  # [1, Hq, Q, D]
        gqa = q.shape[1] != k.shape[1]
        prefix_len = seq_len - query_len
        if prefix_len == 0:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            q_pos = torch.arange(prefix_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [Q, L]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        output[start:end] = out[0].transpose(0, 1)


def gathered_decode(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Decode attention in plain PyTorch: gather each request's blocks, mask, SDPA."""
    num_decodes = metadata.num_decodes
    block_size = k_cache.shape[1]
    seq_lens_cpu = metadata.seq_lens_cpu[:num_decodes]
    max_len = max(seq_lens_cpu)
    num_blocks = -(-max_len // block_size)
    block_tables = metadata.block_tables[:num_decodes, :num_blocks]
    keys = gather_kv(k_cache, block_tables)[:, :max_len]  # [B, L, Hkv, D]
    values = gather_kv(v_cache, block_tables)[:, :max_len]
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    k = keys.transpose(1, 2)  # [B, Hkv, L, D]
    v = values.transpose(1, 2)
    mask = None
    if min(seq_lens_cpu) != max_len:
        positions = torch.arange(max_len, device=query.device)
        valid = positions[None, :] < metadata.seq_lens[:num_decodes, None]  # [B, L]
        mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.squeeze(2)

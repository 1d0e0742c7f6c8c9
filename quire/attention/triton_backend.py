"""The GPU attention backend: Triton kernels over the paged KV cache.

A step stores its new K/V with `store_kv`, then runs the decode requests (ordered first, one token
each) through the split-K `paged_decode` kernel and the prefill chunks after them through
`prefill_paged`, each kernel writing its slice of one output tensor.

The host-side metadata it reads (num_decodes, num_decode_tokens, num_seqs, max_seq_len,
max_query_len) only sizes launch grids and picks branches, and it never reads device values back,
so a decode-only batch can be captured in a CUDA graph: worker/cuda_graph.py fixes those values per
captured batch size (max_seq_len to max_model_len) and pads the batch with seq_len 0, slot -1 rows.
"""

from __future__ import annotations

import torch

from quire.attention.backend import AttentionBackend, AttentionMetadata
from quire.kernels.paged_decode import paged_decode
from quire.kernels.prefill_paged import prefill_paged
from quire.kernels.store_kv import store_kv


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        num_decodes = metadata.num_decodes
        num_decode_tokens = metadata.num_decode_tokens
        if num_decodes > 0:
            paged_decode(
                query[:num_decode_tokens],
                k_cache,
                v_cache,
                metadata.block_tables[:num_decodes],
                metadata.seq_lens[:num_decodes],
                scale,
                metadata.max_seq_len,
                out=output[:num_decode_tokens],
            )
        if num_decodes < metadata.num_seqs:
            block_tables, query_start_loc, seq_lens = metadata.prefill_tables()
            prefill_paged(
                query[num_decode_tokens:],
                k_cache,
                v_cache,
                block_tables,
                query_start_loc,
                seq_lens,
                scale,
                metadata.max_query_len,
                out=output[num_decode_tokens:],
            )
        return output

"""The attention-backend interface: one flattened batch of new tokens against a paged KV cache.

A step's batch holds `num_seqs` sequences: a request's prefill chunk, or one generated token (a
decode; a resumed request replaying its generated tokens gives one sequence per token, all over
its one block table). Sequence i contributes `query_len[i]` new tokens (1 for a decode, a chunk
for a prefill) laid out contiguously in the flattened token dimension, in
`[query_start_loc[i], query_start_loc[i + 1])`. Before this step it had `seq_len[i] - query_len[i]`
tokens in the cache; after it, `seq_len[i]`. New token j of sequence i sits at position
`seq_len[i] - query_len[i] + j` and attends causally to positions `0..that`. Those positions may
be written in this very step by another sequence (a replay's earlier tokens), so a backend
stores every new token's K/V before any attention.

The KV cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
Logical position p of sequence i lives in physical block `block_tables[i, p // block_size]` at
offset `p % block_size`; `slot_mapping[t] = block * block_size + offset` for each new token t.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot for each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc and seq_lens, so backends can plan without a device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Sequences [0, num_decodes) decode one generated token each; the rest are prefill chunks
    # (of one token or more: a prompt's last chunk may be a single token).
    num_decodes: int
    num_decode_tokens: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def prefill_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """block_tables, query_start_loc and seq_lens of the prefill sequences alone, the
        offsets counted from the first prefill token (the tokens after the decodes')."""
        first, n = self.num_decodes, self.num_decode_tokens
        return self.block_tables[first:], self.query_start_loc[first:] - n, self.seq_lens[first:]


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache, then attends over each request's context."""

    name: str

    @abstractmethod
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
        ...

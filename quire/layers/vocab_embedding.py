"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of the rank count and split in equal contiguous ranges:
rank r holds rows [r * n, (r + 1) * n) of the table (padding rows are zeros). The embedding looks
up the ids in its range, zeros the others, and sums over the ranks; the LM head computes its
range's logits, and `gather_logits` puts the ranges side by side and drops the padding, so the
sampler sees the full vocabulary. With one rank both are the plain table and no op is added.
"""

from __future__ import annotations

import torch
from torch import nn

from quire.distributed.parallel_state import all_gather_last_dim, all_reduce, tp_rank, tp_size
from quire.layers.parallel_linear import Shard, shard_size


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int):
        self.vocab_size = vocab_size
        rows = shard_size(vocab_size, tp_size())
        self.vocab_start = tp_rank() * rows
        # an uninitialized table, which the checkpoint fills (nn.Embedding's normal_ init on
        # the meta device imports torch's compiler: seconds at startup)
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size))

    def shard(self) -> Shard:
        return Shard(0, self.vocab_start, self.weight.shape[0], self.vocab_size)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        self.shard().load(param.data, full)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        if tp_size() == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary range of an untied LM head (no bias)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        self.vocab_size = vocab_size
        rows = shard_size(vocab_size, tp_size())
        self.vocab_start = tp_rank() * rows
        super().__init__(hidden_size, rows, bias=False)

    def shard(self) -> Shard:
        return Shard(0, self.vocab_start, self.weight.shape[0], self.vocab_size)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        self.shard().load(param.data, full)


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, vocab range of this rank] -> [n, vocab_size] on every rank."""
    if tp_size() == 1:
        return logits
    return all_gather_last_dim(logits)[:, :vocab_size]

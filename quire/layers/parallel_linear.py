"""Tensor-parallel linear layers (Megatron-style splits) and their weight loaders.

Each layer is an `nn.Linear` holding this rank's shard, so the single-rank model is the same
module tree as before and weight packing (linear.py) applies to the shards alone. A loader takes
the full checkpoint tensor (safetensors or dequantized GGUF) and copies this rank's rows or
columns:

- ColumnParallelLinear: output rows split; each rank's output is a slice of the full one.
- MergedColumnParallelLinear: several column-parallel matrices in one (gate | up), each split.
- QKVParallelLinear: q | k | v, split by heads; KV heads are replicated when there are fewer of
  them than ranks (rank r reads KV head r * num_kv_heads // tp).
- RowParallelLinear: input columns split; the partial products are summed over the ranks
  (all-reduce), then the bias is added once.

A dimension that does not divide by the rank count (an MLP's intermediate size) is padded: each
rank holds ceil(n / tp) rows, and those past n are zeros, which add nothing to any sum. Heads
must divide (config check: `tensor_parallel_split_error`).
"""

from __future__ import annotations

import torch
from torch import nn

from quire.distributed.parallel_state import all_reduce, tp_rank, tp_size


def shard_size(n: int, size: int) -> int:
    """Rows per rank when `n` rows are split over `size` ranks (the last ones padded)."""
    return -(-n // size)


def load_shard(dest: torch.Tensor, full: torch.Tensor, dim: int, start: int, expected: int) -> None:
    """Copies `full[start : start + dest.shape[dim]]` along `dim` into `dest`, zeros where the
    shard runs past `full`'s end (padding). `expected` is `full`'s size along `dim`; any other
    shape raises ValueError."""
    expected_shape = list(dest.shape)
    expected_shape[dim] = expected
    if list(full.shape) != expected_shape:
        raise ValueError(f"has shape {tuple(full.shape)}, expected {tuple(expected_shape)}")
    length = max(0, min(dest.shape[dim], expected - start))
    dest.narrow(dim, 0, length).copy_(full.narrow(dim, start, length))
    if length < dest.shape[dim]:
        dest.narrow(dim, length, dest.shape[dim] - length).zero_()


def load_full(dest: torch.Tensor, full: torch.Tensor) -> None:
    """A replicated parameter: the whole tensor."""
    if dest.shape != full.shape:
        raise ValueError(f"has shape {tuple(full.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(full)


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.full_out_features = out_features
        super().__init__(in_features, shard_size(out_features, tp_size()), bias=bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        n = param.shape[0]
        load_shard(param.data, full, 0, tp_rank() * n, self.full_out_features)


class MergedColumnParallelLinear(nn.Linear):
    """Several matrices of the same input stacked by output rows, e.g. gate | up; each is split
    over the ranks and this rank's shards are stacked in the same order."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        self.shard_sizes = [shard_size(n, tp_size()) for n in output_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias=bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        size = self.shard_sizes[shard_id]
        dest = param.data.narrow(0, sum(self.shard_sizes[:shard_id]), size)
        load_shard(dest, full, 0, tp_rank() * size, self.output_sizes[shard_id])


class QKVParallelLinear(nn.Linear):
    """q | k | v of this rank's heads: num_heads / tp query heads, and num_kv_heads / tp KV heads
    (one, replicated, when num_kv_heads < tp)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ):
        tp = tp_size()
        self.head_dim = head_dim
        self.total_heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        if num_kv_heads >= tp:
            kv_start = tp_rank() * self.num_kv_heads
        else:  # replicated: ranks tp / num_kv_heads apart share a head
            kv_start = tp_rank() * num_kv_heads // tp
        self.first_head = {"q": tp_rank() * self.num_heads, "k": kv_start, "v": kv_start}
        self.local_heads = {"q": self.num_heads, "k": self.num_kv_heads, "v": self.num_kv_heads}
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias=bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:
        offset = {"q": 0, "k": self.num_heads, "v": self.num_heads + self.num_kv_heads}[shard_id]
        d = self.head_dim
        dest = param.data.narrow(0, offset * d, self.local_heads[shard_id] * d)
        start = self.first_head[shard_id] * d
        load_shard(dest, full, 0, start, self.total_heads[shard_id] * d)


class RowParallelLinear(nn.Linear):
    """Input columns split; y = all_reduce(x_r W_r^T) + b. The bias (replicated) is added after
    the sum, once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.full_in_features = in_features
        super().__init__(shard_size(in_features, tp_size()), out_features, bias=bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias
            load_full(param.data, full)
            return
        n = param.shape[1]
        load_shard(param.data, full, 1, tp_rank() * n, self.full_in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return super().forward(x)
        out = all_reduce(torch.nn.functional.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

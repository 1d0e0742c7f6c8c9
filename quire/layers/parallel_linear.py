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
must divide (config check: `ModelShape.check_tensor_parallel_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Shard:
    """This rank's part of a checkpoint tensor: `full[start : start + size]` along `dim` (zeros
    past `full_size`, the tensor's size there), stored at rows [offset, offset + size) of the
    parameter (dim 0) or as its whole columns (dim 1). GGUF blocks kept quantized are cut by the
    same description (layers/quantized_linear.py)."""

    dim: int
    start: int
    size: int
    full_size: int
    offset: int = 0

    def load(self, param: torch.Tensor, full: torch.Tensor) -> None:
        dest = param.narrow(0, self.offset, self.size) if self.dim == 0 else param
        load_shard(dest, full, self.dim, self.start, self.full_size)


def load_full(dest: torch.Tensor, full: torch.Tensor) -> None:
    """A replicated parameter: the whole tensor."""
    if dest.shape != full.shape:
        raise ValueError(f"has shape {tuple(full.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(full)


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.full_out_features = out_features
        super().__init__(in_features, shard_size(out_features, tp_size()), bias=bias)

    def shard(self) -> Shard:
        n = self.out_features
        return Shard(0, tp_rank() * n, n, self.full_out_features)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        self.shard().load(param.data, full)


class MergedColumnParallelLinear(nn.Linear):
    """Several matrices of the same input stacked by output rows, e.g. gate | up; each is split
    over the ranks and this rank's shards are stacked in the same order."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        self.shard_sizes = [shard_size(n, tp_size()) for n in output_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias=bias)

    def shard(self, shard_id: int) -> Shard:
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        return Shard(0, tp_rank() * size, size, self.output_sizes[shard_id], offset)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        self.shard(shard_id).load(param.data, full)


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

    def shard(self, shard_id: str) -> Shard:
        offset = {"q": 0, "k": self.num_heads, "v": self.num_heads + self.num_kv_heads}[shard_id]
        d = self.head_dim
        return Shard(
            0,
            self.first_head[shard_id] * d,
            self.local_heads[shard_id] * d,
            self.total_heads[shard_id] * d,
            offset * d,
        )

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:
        self.shard(shard_id).load(param.data, full)


class RowParallelLinear(nn.Linear):
    """Input columns split; y = all_reduce(x_r W_r^T) + b. The bias (replicated) is added after
    the sum, once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.full_in_features = in_features
        super().__init__(shard_size(in_features, tp_size()), out_features, bias=bias)

    def shard(self) -> Shard:  # of the weight; the bias is whole
        n = self.in_features
        return Shard(1, tp_rank() * n, n, self.full_in_features)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias
            load_full(param.data, full)
            return
        self.shard().load(param.data, full)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product, before the sum over the ranks and the bias."""
        return torch.nn.functional.linear(x, self.weight)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' partial products summed, then the bias added once."""
        out = all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return super().forward(x)
        return self.reduce(self.partial(x))

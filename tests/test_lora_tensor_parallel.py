"""Adapters under tensor parallelism: a column-parallel LoRALinear (q|k|v) holds its rows of B
and gives its columns of the full layer's output with the adapters added; a row-parallel one
(an odd split of the input) holds its columns of A, and its partial delta summed over the ranks
with the partial products gives the full output. Two ranks, float32, gloo."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from quire.distributed.parallel_state import all_reduce, init_tensor_parallel
from quire.executor.multiproc import free_port
from quire.layers.lora_linear import LoRALinear, LoRAMapping, LoRAWeights, lora_context
from quire.layers.parallel_linear import QKVParallelLinear, RowParallelLinear
from quire.lora.ops import TorchLoRAOps

WORLD = 2
HIDDEN, HEAD_DIM, ODD = 24, 3, 11
# a prompt chunk on slot 0 (SGMV), a base-model row, two decode rows on slot 1 (BGMV)
SLOTS, SIZES = [0, -1, 1, 1], [3, 1, 1, 1]
ROW_SLOTS = [0, 0, 0, -1, 1, 1]


def _shard(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's `size` columns of `full`, zero-padded past its end."""
    part = full[:, rank * size : (rank + 1) * size]
    return torch.cat([part, full.new_zeros(full.shape[0], size - part.shape[1])], dim=1)


def _weights(out_features: int, in_features: int, rank: int) -> LoRAWeights:
    return LoRAWeights(torch.randn(rank, in_features), torch.randn(out_features, rank), 0.5)


def _with_adapters(linear: nn.Linear, x: torch.Tensor, adapters: list[dict], module: str):
    """The full layer's output with each row's adapter (ROW_SLOTS) added."""
    y = linear(x)
    for row, slot in enumerate(ROW_SLOTS):
        if slot >= 0 and module in adapters[slot]:
            w = adapters[slot][module]
            y[row] += w.scale * (w.lora_b @ (w.lora_a @ x[row]))
    return y


def _errors(rank: int) -> dict[str, float]:
    torch.manual_seed(0)  # the same full weights, adapters and inputs on both ranks
    mapping = LoRAMapping.from_requests(SLOTS, SIZES)
    errors = {}

    x = torch.randn(6, HIDDEN)
    full = {m: nn.Linear(HIDDEN, n * HEAD_DIM, bias=True) for m, n in zip("qkv", (4, 2, 2))}
    adapters = [
        {f"{m}_proj": _weights(full[m].out_features, HIDDEN, 8) for m in "qkv"},
        {f"{m}_proj": _weights(full[m].out_features, HIDDEN, 4) for m in "qv"},
    ]
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, 4, 2, bias=True)
    for m in "qkv":
        qkv.weight_loader(qkv.weight, full[m].weight.data, m)
        qkv.weight_loader(qkv.bias, full[m].bias.data, m)
    layer = LoRALinear(
        qkv, ("q_proj", "k_proj", "v_proj"), 0, max_loras=2, max_rank=8, dtype=torch.float32
    )
    for slot, adapter in enumerate(adapters):
        layer.set_slot(slot, adapter)
    with lora_context(mapping, TorchLoRAOps()):
        got = layer(x)
    want = torch.cat(
        [
            _shard(_with_adapters(full[m], x, adapters, f"{m}_proj"), rank, size)
            for m, size in zip("qkv", (2 * HEAD_DIM, HEAD_DIM, HEAD_DIM))
        ],
        dim=1,
    )
    errors["column"] = (got - want).abs().max().item()

    x = torch.randn(6, ODD)
    full_o = nn.Linear(ODD, HIDDEN, bias=True)
    adapters = [{"o_proj": _weights(HIDDEN, ODD, 8)}, {"o_proj": _weights(HIDDEN, ODD, 4)}]
    row = RowParallelLinear(ODD, HIDDEN, bias=True)
    row.weight_loader(row.weight, full_o.weight.data)
    row.weight_loader(row.bias, full_o.bias.data)
    layer = LoRALinear(row, ("o_proj",), 0, max_loras=2, max_rank=8, dtype=torch.float32)
    for slot, adapter in enumerate(adapters):
        layer.set_slot(slot, adapter)
    x_rank = _shard(x, rank, 6)
    if rank == 1:
        x_rank[:, -1] = 100.0  # padding input meets zero columns of the weight and of A
    with lora_context(mapping, TorchLoRAOps()):
        got = layer(x_rank)
    errors["row"] = (got - _with_adapters(full_o, x, adapters, "o_proj")).abs().max().item()
    return errors


def _rank_main(rank: int, port: int, results) -> None:
    init_tensor_parallel(rank, WORLD, port, "cpu", shm_bytes=1 << 12)
    with torch.no_grad():
        results[rank] = _errors(rank)
    all_reduce(torch.zeros(1))  # both ranks done before either leaves


@pytest.fixture(scope="module")
def rank_errors() -> list[dict[str, float]]:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(free_port(), results), nprocs=WORLD)
        return [dict(results[r]) for r in range(WORLD)]


@pytest.mark.parametrize("layer", ["column", "row"])
def test_a_lora_linears_shard_matches_the_full_layer_with_adapters(rank_errors, layer):
    for rank in range(WORLD):
        assert rank_errors[rank][layer] < 1e-4, (rank, layer)

"""Each tensor-parallel layer on two gloo ranks against the single-rank layer with the same full
weights (float32): a column-parallel output is the full output's slice, a row-parallel output
and the vocabulary-parallel embedding the full output, the LM head's gathered logits the full
logits. The shapes leave padding (11 rows over two ranks) and replicated KV heads. GGUF blocks
cut for a rank (Q4_1) against the single-rank QuantizedLinear on the whole blocks."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from quire.distributed import parallel_state
from quire.distributed.parallel_state import all_reduce, init_tensor_parallel
from quire.executor.multiproc import free_port
from quire.kernels.cpu import qmatmul
from quire.layers.linear import PackedLinear, packed_linear_supported
from quire.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    Shard,
)
from quire.layers.quantized_linear import QuantizedLinear, QuantizedWeight, shard_of
from quire.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits

WORLD = 2
HIDDEN = 24
ODD = 11  # rows that do not divide by WORLD: each rank holds 6, rank 1 one padding row


def _shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank's `size` entries along `dim`, zero-padded past the end (what the loaders produce)."""
    start = rank * size
    part = full.narrow(dim, start, max(0, min(size, full.shape[dim] - start)))
    pad = list(full.shape)
    pad[dim] = size - part.shape[dim]
    return torch.cat([part, full.new_zeros(pad)], dim=dim)


def _errors(rank: int) -> dict[str, float]:
    """Max |parallel - reference| for each layer, on this rank."""
    torch.manual_seed(0)  # the same full weights and inputs on both ranks
    x = torch.randn(5, HIDDEN)
    errors = {}

    full = nn.Linear(HIDDEN, ODD, bias=True)
    column = ColumnParallelLinear(HIDDEN, ODD, bias=True)
    column.weight_loader(column.weight, full.weight.data)
    column.weight_loader(column.bias, full.bias.data)
    want = _shard(full(x), 1, rank, 6)
    if rank == 1:
        want[:, -1] = 0  # the padding row's output
    errors["column"] = (column(x) - want).abs().max().item()

    gate, up = nn.Linear(HIDDEN, 7, bias=False), nn.Linear(HIDDEN, 7, bias=False)
    merged = MergedColumnParallelLinear(HIDDEN, [7, 7])
    merged.weight_loader(merged.weight, gate.weight.data, 0)
    merged.weight_loader(merged.weight, up.weight.data, 1)
    want = torch.cat([_shard(gate(x), 1, rank, 4), _shard(up(x), 1, rank, 4)], dim=1)
    errors["merged_column"] = (merged(x) - want).abs().max().item()

    for name, num_kv_heads in (("qkv", 2), ("qkv_replicated_kv", 1)):
        head_dim = 3
        q, k, v = (nn.Linear(HIDDEN, n * head_dim) for n in (4, num_kv_heads, num_kv_heads))
        qkv = QKVParallelLinear(HIDDEN, head_dim, 4, num_kv_heads, bias=True)
        for shard, linear in zip("qkv", (q, k, v)):
            qkv.weight_loader(qkv.weight, linear.weight.data, shard)
            qkv.weight_loader(qkv.bias, linear.bias.data, shard)
        kv_rank = rank if num_kv_heads == WORLD else 0
        want = torch.cat(
            [
                _shard(q(x), 1, rank, 2 * head_dim),
                _shard(k(x), 1, kv_rank, head_dim),
                _shard(v(x), 1, kv_rank, head_dim),
            ],
            dim=1,
        )
        errors[name] = (qkv(x) - want).abs().max().item()

    x_odd = torch.randn(5, ODD)
    full = nn.Linear(ODD, HIDDEN, bias=True)
    row = RowParallelLinear(ODD, HIDDEN, bias=True)
    row.weight_loader(row.weight, full.weight.data)
    row.weight_loader(row.bias, full.bias.data)
    x_rank = _shard(x_odd, 1, rank, 6)
    if rank == 1:
        x_rank[:, -1] = 100.0  # padding input meets a zero weight column
    errors["row"] = (row(x_rank) - full(x_odd)).abs().max().item()

    table = torch.randn(ODD, HIDDEN)
    ids = torch.tensor([0, 5, 6, 10, 3, 7])
    embedding = VocabParallelEmbedding(ODD, HIDDEN)
    embedding.weight_loader(embedding.weight, table)
    errors["embedding"] = (embedding(ids) - nn.functional.embedding(ids, table)).abs().max().item()

    head = ParallelLMHead(HIDDEN, ODD)
    head.weight_loader(head.weight, table)
    logits = gather_logits(head(x), ODD)
    errors["lm_head"] = (logits - x @ table.T).abs().max().item()

    # a part larger than the shared-memory slot (4 KiB) goes through gloo
    wide = torch.randn(5, 600)
    parts = parallel_state.all_gather_last_dim(wide[:, rank * 300 : (rank + 1) * 300].clone())
    errors["gloo_all_gather"] = (parts - wide).abs().max().item()

    gloo_sum = torch.arange(6.0) * (rank + 1)
    shm = parallel_state._group.shm
    shm_sum = shm.all_reduce(torch.arange(6.0) * (rank + 1))
    torch.distributed.all_reduce(gloo_sum)
    errors["shm_all_reduce"] = (shm_sum - torch.arange(6.0) * 3).abs().max().item()
    errors["gloo_all_reduce"] = (gloo_sum - torch.arange(6.0) * 3).abs().max().item()

    if packed_linear_supported("cpu", torch.bfloat16):
        row16 = RowParallelLinear(ODD, HIDDEN, bias=True).to(torch.bfloat16)
        row16.weight_loader(row16.weight, full.weight.data.bfloat16())
        row16.weight_loader(row16.bias, full.bias.data.bfloat16())
        packed = PackedLinear.from_linear(row16, use_gemv=True)
        got = packed(_shard(x_odd, 1, rank, 6).bfloat16()).float()
        errors["packed_row_bf16"] = (got - full(x_odd)).abs().max().item() / 10  # bf16 scale
    if qmatmul.available():
        errors.update(_quantized_errors(rank))
    return errors


def _q4_1(rows: int, cols: int) -> QuantizedWeight:
    values = torch.randn(rows, cols).numpy()
    return QuantizedWeight(quantize(values, GGMLQuantizationType.Q4_1), "Q4_1", (rows, cols))


def _quantized_errors(rank: int) -> dict[str, float]:
    """Column shard: the full output's columns bit for bit (0 error). Row-parallel: the full
    output up to bf16 rounding of the two partial sums and their sum, as a fraction of the
    largest output."""
    k = 4 * qmatmul.QBLOCK  # two blocks per rank
    x = torch.randn(5, k).bfloat16()
    errors = {}

    full = _q4_1(ODD, k)
    column = ColumnParallelLinear(k, ODD)
    got = QuantizedLinear.from_linear(column, shard_of(column, full, None))(x).float()
    want = _shard(QuantizedLinear(full, None)(x).float(), 1, rank, 6)
    errors["quantized_column"] = (got - want).abs().max().item()

    full, bias = _q4_1(HIDDEN, k), torch.randn(HIDDEN)
    row = RowParallelLinear(k, HIDDEN, bias=True)
    row.weight_loader(row.bias, bias)
    half = k // WORLD
    parallel = QuantizedLinear.from_linear(row, shard_of(row, full, None))
    got = parallel(x[:, rank * half : (rank + 1) * half]).float()
    want = QuantizedLinear(full, bias)(x).float()
    errors["quantized_row"] = ((got - want).abs().max() / want.abs().max()).item()
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


LAYERS = [
    "column",
    "merged_column",
    "qkv",
    "qkv_replicated_kv",
    "row",
    "embedding",
    "lm_head",
    "shm_all_reduce",
    "gloo_all_reduce",
    "gloo_all_gather",
]


@pytest.mark.parametrize("layer", LAYERS)
def test_parallel_layer_matches_single_rank(rank_errors, layer):
    for rank in range(WORLD):
        assert rank_errors[rank][layer] < 1e-5, (rank, layer)


@pytest.mark.skipif(not qmatmul.available(), reason="the C kernels are off here")
def test_quantized_column_shard_is_the_full_outputs_columns(rank_errors):
    for rank in range(WORLD):
        assert rank_errors[rank]["quantized_column"] == 0.0


@pytest.mark.skipif(not qmatmul.available(), reason="the C kernels are off here")
def test_quantized_row_parallel_linear_sums_ranks(rank_errors):
    for rank in range(WORLD):
        assert rank_errors[rank]["quantized_row"] < 4 * 2**-8  # bf16: three roundings


def test_a_row_split_inside_a_block_keeps_no_blocks():
    # 96 input features over two ranks: 48 a rank, a block and a half
    full = _q4_1(ODD, 3 * qmatmul.QBLOCK)
    assert full.shard(RowParallelLinear(96, ODD).shard()) is full  # one rank: whole
    split = Shard(1, 48, 48, 96)
    assert full.shard(split) is None


@pytest.mark.skipif(
    not packed_linear_supported("cpu", torch.bfloat16), reason="oneDNN runs no bf16 here"
)
def test_packed_row_parallel_linear_sums_ranks(rank_errors):
    for rank in range(WORLD):
        assert rank_errors[rank]["packed_row_bf16"] < 1e-2

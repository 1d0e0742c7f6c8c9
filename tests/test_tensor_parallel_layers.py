"""Each tensor-parallel layer on two gloo ranks against the single-rank layer with the same full
weights (float32): a column-parallel output is the full output's slice, a row-parallel output
and the vocabulary-parallel embedding the full output, the LM head's gathered logits the full
logits. The shapes leave padding (11 rows over two ranks) and replicated KV heads. GGUF blocks
cut for a rank (Q4_1) against the single-rank QuantizedLinear on the whole blocks. For 4 query
heads and 2 KV heads, on every rank count that splits them (1, 2, 4: at 4 each KV head is
replicated on two ranks), the heads each rank's QKV projection holds and the attention layer's
output against the full attention."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from quire.attention.backend import AttentionMetadata
from quire.attention.forward_context import forward_context
from quire.attention.torch_backend import TorchAttentionBackend
from quire.distributed import parallel_state
from quire.distributed.parallel_state import all_reduce, init_tensor_parallel
from quire.executor.multiproc import free_port
from quire.kernels.cpu import qmatmul
from quire.layers.attention import Attention
from quire.layers.linear import PackedLinear, packed_linear_supported
from quire.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    Shard,
)
from quire.layers.quantized_linear import QuantizedLinear, QuantizedWeight, shard_of
from quire.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary
from quire.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits
from quire.model.model_config import ModelConfig, ModelShape

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


# ---- replicated KV heads: every rank count that splits 4 query heads and 2 KV heads --------

GQA = ModelConfig.from_dict(
    dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=ODD,
        hidden_size=HIDDEN,
        intermediate_size=ODD,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
)
# tp -> (the query heads, the KV heads) each rank holds, rank by rank: KV head r * 2 // tp
HEADS = {
    1: ([[0, 1, 2, 3]], [[0, 1]]),
    2: ([[0, 1], [2, 3]], [[0], [1]]),
    4: ([[0], [1], [2], [3]], [[0], [0], [1], [1]]),
}


def _heads_held(local: torch.Tensor, full: torch.Tensor) -> list[int]:
    """Which heads of `full` [tokens, heads, head_dim] each head of `local` is."""
    return [
        next(i for i in range(full.shape[1]) if torch.allclose(local[:, j], full[:, i]))
        for j in range(local.shape[1])
    ]


def _gqa_attention(rank: int) -> dict:
    """This rank's heads (by the full q, k, v outputs its QKV output repeats) and max |its
    Attention layer's output - the full layer's| over a causal prompt of 5 tokens."""
    torch.manual_seed(0)  # the same full weights and inputs on every rank
    heads, kv_heads, d = GQA.num_attention_heads, GQA.num_key_value_heads, GQA.head_dim
    x = torch.randn(5, HIDDEN)
    q, k, v = (nn.Linear(HIDDEN, n * d) for n in (heads, kv_heads, kv_heads))
    o = nn.Linear(heads * d, HIDDEN, bias=False)
    attention = Attention(0, HIDDEN, heads, kv_heads, d, qkv_bias=True)
    qkv = attention.qkv_proj
    for shard, linear in zip("qkv", (q, k, v)):
        qkv.weight_loader(qkv.weight, linear.weight.data, shard)
        qkv.weight_loader(qkv.bias, linear.bias.data, shard)
    attention.o_proj.weight_loader(attention.o_proj.weight, o.weight.data)

    # [5, local q + 2 local kv heads, d]
    local = qkv(x).view(5, -1, d).split([qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_heads], 1)
    held = {
        name: _heads_held(part, full(x).view(5, -1, d))
        for name, part, full in zip("qkv", local, (q, k, v))
    }

    cos, sin = RotaryEmbedding(d, 16, RopeConfig())(torch.arange(5), torch.float32)
    full_q = apply_rotary(q(x).view(5, heads, d), cos, sin).transpose(0, 1)
    full_k = apply_rotary(k(x).view(5, kv_heads, d), cos, sin).transpose(0, 1)
    full_v = v(x).view(5, kv_heads, d).transpose(0, 1)
    want = nn.functional.scaled_dot_product_attention(
        full_q, full_k, full_v, is_causal=True, enable_gqa=True
    )  # [heads, 5, d]
    want = o(want.transpose(0, 1).reshape(5, heads * d))

    cache = [(torch.zeros(1, 16, qkv.num_kv_heads, d), torch.zeros(1, 16, qkv.num_kv_heads, d))]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(5),
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=5,
        max_seq_len=5,
        query_start_loc_cpu=[0, 5],
        seq_lens_cpu=[5],
        num_decodes=0,
        num_decode_tokens=0,
    )
    with forward_context(metadata, cache, TorchAttentionBackend()):
        got = attention((cos, sin), x)
    return {"held": held, "attention": (got - want).abs().max().item()}


def _gqa_rank_main(rank: int, world: int, port: int, results) -> None:
    init_tensor_parallel(rank, world, port, "cpu", shm_bytes=1 << 12)
    with torch.no_grad():
        results[rank] = _gqa_attention(rank)
    all_reduce(torch.zeros(1))  # every rank done before any leaves


GQA_SHAPE = ModelShape(
    "gqa", GQA.num_attention_heads, GQA.num_key_value_heads, 2048, GQA.num_hidden_layers
)


@pytest.fixture(scope="module", params=GQA_SHAPE.tensor_parallel_sizes())
def gqa_ranks(request) -> tuple[int, list[dict]]:
    """(tp, each rank's result of `_gqa_attention`) for every rank count the shape allows."""
    tp = request.param
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_gqa_rank_main, args=(tp, free_port(), results), nprocs=tp)
        return tp, [results[r] for r in range(tp)]


def test_the_rank_counts_that_split_4_query_heads_and_2_kv_heads():
    assert GQA_SHAPE.tensor_parallel_sizes() == sorted(HEADS) == [1, 2, 4]


def test_each_rank_holds_its_query_heads_and_kv_head_rank_times_kv_heads_over_tp(gqa_ranks):
    tp, ranks = gqa_ranks
    query_heads, kv_heads = HEADS[tp]
    assert [r["held"]["q"] for r in ranks] == query_heads
    assert [r["held"]["k"] for r in ranks] == kv_heads
    assert [r["held"]["v"] for r in ranks] == kv_heads


def test_attention_on_every_rank_count_sums_to_the_full_layers_output(gqa_ranks):
    tp, ranks = gqa_ranks
    assert [r["attention"] < 1e-5 for r in ranks] == [True] * tp, [r["attention"] for r in ranks]

"""Quantized KV cache (`kv_cache_dtype` int8 / fp8 / fp8_e5m2): each token's row per KV head is
stored as one-byte codes and a float32 scale (quire/kernels/kv_format.py). The quantizer against
a numpy / torch reference and its error bound, the attention kernels against a float64 reference
over the dequantized K/V, the cache's blocks as data, the pool's capacity and the engine end to
end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_idle, token_prompts

from quire import LLM, SamplingParams, envs
from quire.attention.backend import AttentionMetadata
from quire.attention.torch_backend import TorchAttentionBackend
from quire.config import EngineConfig
from quire.kernels import cpu as cpu_kernels
from quire.kernels import kv_format
from quire.worker.kv_cache import KVBlocks, KVCache

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no C compiler")

QUANTIZED = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CODE_MAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# An fp8 code's relative rounding error (half its mantissa step) and, below the smallest
# normal, its absolute one (half the subnormal step), in units of the code.
FP8_ROUNDING = {"fp8_e4m3": (2.0**-4, 2.0**-10), "fp8_e5m2": (2.0**-3, 2.0**-17)}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16


def random_kv(
    num_tokens: int, seed: int, head_dim: int = HEAD_DIM
) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 K and V [num_tokens, KV_HEADS, head_dim] with an outlier channel (as real keys
    have) and the first token's first head all zeros."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_tokens, KV_HEADS, head_dim, generator=gen) for _ in "kv")
    k[..., 5] *= 30.0
    k[0, 0] = 0.0
    return k.bfloat16(), v.bfloat16()


def stored(name: str, k: torch.Tensor, v: torch.Tensor, slots: list[int]) -> KVCache:
    """A one-layer quantized cache with K/V stored at `slots` by the C quantizer."""
    num_blocks = max(slots) // BLOCK + 1
    cache = KVCache.allocate(1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, QUANTIZED[name], "cpu")
    k_cache, v_cache = cache.layers[0]
    cpu_kernels.store_kv(k, v, k_cache, v_cache, torch.tensor(slots))
    return cache


def rows(cache: KVCache, slots: list[int]) -> torch.Tensor:  # [2, len(slots), KV_HEADS, row]
    k, v = cache.layers[0]
    return torch.stack([c.flatten(0, 1)[slots] for c in (k, v)])


def dequantized64(rows: torch.Tensor) -> np.ndarray:
    """Independent of the kernels' dequantize: numpy float64 of torch's code values x scale."""
    head_dim = rows.shape[-1] - 4  # a row's codes, then its float32 scale
    codes = rows[..., :head_dim].to(torch.float64).numpy()
    scale = rows[..., head_dim:].contiguous().view(torch.float32).to(torch.float64).numpy()
    return codes * scale


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_each_row_scale_is_its_largest_magnitude_over_the_code_max(name):
    k, v = random_kv(9, 0)
    got = rows(stored(name, k, v, list(range(9))), list(range(9)))
    scale = got[..., HEAD_DIM:].contiguous().view(torch.float32)[..., 0]  # [2, 9, KV_HEADS]
    amax = torch.stack([k, v]).float().abs().amax(-1)
    expected = torch.where(amax > 0, amax / CODE_MAX[name], torch.ones_like(amax))
    torch.testing.assert_close(scale, expected, rtol=2**-23, atol=0)
    assert scale[0, 0, 0] == 1.0 and not got[0, 0, 0, :HEAD_DIM].view(torch.uint8).any()


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_codes_are_the_values_over_the_scale_rounded_to_nearest(name):
    """x * (1 / scale) in float32, rounded as torch rounds to int8 (half to even) or fp8."""
    k, v = random_kv(9, 1)
    got = rows(stored(name, k, v, list(range(9))), list(range(9)))
    scale = got[..., HEAD_DIM:].contiguous().view(torch.float32)
    y = torch.stack([k, v]).float() * (1.0 / scale)
    if name == "int8":
        expected = torch.round(y).clamp(-127, 127).to(torch.int8)
    else:
        expected = y.to(QUANTIZED[name])
    assert torch.equal(got[..., :HEAD_DIM].view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_round_trip_error_is_within_half_a_code_step(name):
    k, v = random_kv(40, 2)
    slots = [37, 3, 18, *range(40, 77)]
    got = rows(stored(name, k, v, slots), slots)
    x = torch.stack([k, v]).to(torch.float64).numpy()
    err = np.abs(dequantized64(got) - x)
    scale = got[..., HEAD_DIM:].contiguous().view(torch.float32).to(torch.float64).numpy()
    if name == "int8":
        bound = scale / 2
    else:
        relative, subnormal = FP8_ROUNDING[name]
        bound = np.maximum(np.abs(x) * relative, subnormal * scale)
    assert np.all(err <= bound * (1 + 1e-6) + 1e-30)


def test_capacity_per_byte_is_at_least_1_85_times_bf16_at_head_dim_64():
    bf16 = kv_format.bytes_per_token(KV_HEADS, HEAD_DIM, torch.bfloat16)
    for dtype in QUANTIZED.values():
        assert bf16 / kv_format.bytes_per_token(KV_HEADS, HEAD_DIM, dtype) == 128 / 68


def reference_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """float64 softmax attention of one query row [HEADS, D] over keys/values [L, KV_HEADS, D]."""
    group = HEADS // KV_HEADS
    k = np.repeat(keys, group, axis=1)  # [L, HEADS, D]
    vv = np.repeat(values, group, axis=1)
    scores = np.einsum("hd,lhd->hl", q, k) * 0.125  # the scale the kernels are called with
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hl,lhd->hd", p, vv)


def decode_over_shuffled_blocks(name: str, lens: list[int], seed: int, head_dim: int = HEAD_DIM):
    """The decode kernel's output for queries of len(lens) requests over one quantized cache
    (40 shuffled blocks each), with each request's float64 reference over its dequantized rows;
    and the queries, cache and tables, to call it again."""
    num_seqs = len(lens)
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(num_seqs * 40, generator=gen).view(num_seqs, 40).int()
    k, v = random_kv(num_seqs * 40 * BLOCK, seed + 1, head_dim)
    cache = KVCache.allocate(1, num_seqs * 40, BLOCK, KV_HEADS, head_dim, QUANTIZED[name], "cpu")
    k_cache, v_cache = cache.layers[0]
    flat = [
        int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK
        for s in range(num_seqs)
        for p in range(40 * BLOCK)
    ]
    cpu_kernels.store_kv(k, v, k_cache, v_cache, torch.tensor(flat))
    q = torch.randn(num_seqs, HEADS, head_dim, generator=gen).bfloat16()
    seq_lens = torch.tensor(lens).int()
    out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.125)
    expected = []
    for s, n in enumerate(lens):
        ctx = rows(cache, flat[s * 40 * BLOCK : s * 40 * BLOCK + n])
        expected.append(
            reference_attention(q[s].double().numpy(), dequantized64(ctx[0]), dequantized64(ctx[1]))
        )
    return out, np.stack(expected), (q, k_cache, v_cache, tables, seq_lens)


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_decode_kernel_is_attention_over_the_dequantized_rows(name):
    """Three requests over shuffled blocks (one longer than 512 positions: two partitions)."""
    out, expected, _ = decode_over_shuffled_blocks(name, [1, 37, 40 * BLOCK - 3], seed=3)
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=2**-8, atol=2e-3)


# The decode kernel built for other targets here: x86-64-v3 (AVX2 and FMA, no AVX-512: Zen 1-3,
# Haswell to Skylake) runs its AVX2 loop over quantized caches as over bf16 ones, x86-64-v2 the
# portable C loop (decode_attention_path "avx2" / "c").
DECODE_PATHS = {"x86-64-v3": 1, "x86-64-v2": 0}  # march: its paged_decode_path()


@pytest.mark.parametrize("head_dim", [64, 80])  # 80: AVX2's and C's only (AVX-512 takes 32s)
@pytest.mark.parametrize("march", list(DECODE_PATHS))
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_each_decode_loop_reads_quantized_rows_whatever_the_batch(
    name, march, head_dim, monkeypatch
):
    """Nine requests (one to three partitions, partial chunks) in one call: each is attention
    over its dequantized rows, and bit for bit what it gets alone or in pairs (a request's
    result depends on its context only, not on the batch or how the threads split it)."""
    monkeypatch.setattr(envs, "QUIRE_CPU_MARCH", march)
    lib = cpu_kernels.build_library.__wrapped__(cpu_kernels._SOURCE_DIR)
    assert lib is not None and lib.paged_decode_path() == DECODE_PATHS[march]
    monkeypatch.setattr(cpu_kernels, "load_library", lambda: lib)
    lens = [1, 15, 17, 100, 333, 16, 64, 600, 40 * BLOCK - 1]
    out, expected, (q, k_cache, v_cache, tables, seq_lens) = decode_over_shuffled_blocks(
        name, lens, seed=11, head_dim=head_dim
    )
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=2**-8, atol=2e-3)
    for size in (1, 2):
        for i in range(0, len(lens) - size + 1, size):
            part = cpu_kernels.paged_decode(
                q[i : i + size],
                k_cache,
                v_cache,
                tables[i : i + size],
                seq_lens[i : i + size],
                0.125,
            )
            assert torch.equal(part, out[i : i + size])


def code_values(name: str) -> np.ndarray:
    """The value of each of the 256 codes, float64, as kv_quant.h defines it: int8 as a signed
    byte; fp8 as sign, exponent and mantissa bits with no special values (codes past the
    format's max, never written, are ordinary numbers: e4m3 0x7F is 480, e5m2 0x7F 114688)."""
    codes = np.arange(256)
    if name == "int8":
        return codes.astype(np.uint8).view(np.int8).astype(np.float64)
    mant, bias = {"fp8_e4m3": (3, 7), "fp8_e5m2": (2, 15)}[name]
    e = (codes & 0x7F) >> mant
    m = (codes & ((1 << mant) - 1)) / 2.0**mant
    magnitude = np.where(e == 0, m * 2.0 ** (1 - bias), (1 + m) * 2.0 ** (e - bias))
    return np.where(codes & 0x80, -magnitude, magnitude)


@pytest.mark.parametrize("row_scale", [1.0, 2.0**20])
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_decode_converts_every_code_exactly(name, row_scale):
    """256 requests of 2 tokens, every row's scale a power of two: request r's second key is
    code r at dim r % 64 (zeros elsewhere; the first key all zeros), scored against a query
    that puts that score in [1, 2); its first value is 1 at dim 0, its second holds codes at
    dims 1..63. The decode kernel's output is bit for bit its output over a bf16 cache holding
    the rows' values (each exact in bf16): every code reaches QK and PV as its exact value. A
    scale of 2^20 is past where fp8 moves its exponent rebias into the softmax weights."""
    values = code_values(name)
    one = int(np.flatnonzero(values == 1.0)[0])
    r = torch.arange(256)
    k_codes = torch.zeros(256, 2, KV_HEADS, HEAD_DIM, dtype=torch.long)
    k_codes[r, 1, :, r % HEAD_DIM] = r[:, None]
    v_codes = torch.zeros(256, 2, KV_HEADS, HEAD_DIM, dtype=torch.long)
    v_codes[:, 0, :, 0] = one
    v_codes[:, 1, :, 1:] = ((r[:, None] * (HEAD_DIM - 1) + torch.arange(HEAD_DIM - 1)) % 256)[
        :, None
    ]
    quantized = KVCache.allocate(1, 256, BLOCK, KV_HEADS, HEAD_DIM, QUANTIZED[name], "cpu")
    plain = KVCache.allocate(1, 256, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
    for qc, pc, codes in zip(quantized.layers[0], plain.layers[0], (k_codes, v_codes)):
        qc.view(torch.uint8)[:, :2, :, :HEAD_DIM] = codes.to(torch.uint8)
        qc.view(torch.uint8)[:, :2, :, HEAD_DIM:] = torch.tensor([row_scale]).view(torch.uint8)
        exact = torch.from_numpy(values)[codes] * row_scale
        pc[:, :2] = exact.bfloat16()
        assert torch.equal(pc[:, :2].double(), exact)
    magnitude = np.abs(values)
    q_scale = 2.0 ** -np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    q = torch.zeros(256, HEADS, HEAD_DIM)
    q[r, :, r % HEAD_DIM] = torch.from_numpy(q_scale / (0.125 * row_scale)).float()[:, None]
    q = q.bfloat16()
    tables = torch.arange(256, dtype=torch.int32)[:, None]
    lens = torch.full((256,), 2, dtype=torch.int32)
    out = cpu_kernels.paged_decode(q, *quantized.layers[0], tables, lens, 0.125)
    expected = cpu_kernels.paged_decode(q, *plain.layers[0], tables, lens, 0.125)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@pytest.fixture(params=["native", "x86-64-v3"])
def prefill_build(request, monkeypatch) -> None:
    """The prefill kernel of this CPU's build, and of an x86-64-v3 one (its AVX2 loop, on any
    host; the same loop as native on an AVX2-only CPU)."""
    monkeypatch.setattr(envs, "QUIRE_CPU_MARCH", request.param)
    lib = cpu_kernels.build_library.__wrapped__(cpu_kernels._SOURCE_DIR)
    if lib is None or lib.prefill_attention_path() == 0:
        pytest.skip(f"no prefill kernel in the {request.param} build here")
    monkeypatch.setattr(cpu_kernels, "load_library", lambda: lib)
    assert cpu_kernels.supports_prefill_attention(torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM)


def test_prefill_reads_its_context_dequantized_to_bf16(prefill_build):
    """A prompt chunk of 20 after a cached prefix of 30 tokens, through the backend: each token
    attends causally over the dequantized rows (rounded to bf16, as the prefill kernel reads
    them), its own chunk's included."""
    k, v = random_kv(50, 5)
    cache = stored("int8", k[:30], v[:30], [16 * 3 + p for p in range(30)])  # blocks 3, 4
    k_cache, v_cache = cache.layers[0]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(20, HEADS, HEAD_DIM, generator=gen).bfloat16()
    tables = torch.tensor([[3, 4, 2, 0]], dtype=torch.int32)
    slots = torch.tensor([(3, 4, 2, 0)[p // BLOCK] * BLOCK + p % BLOCK for p in range(30, 50)])
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, 20], dtype=torch.int32),
        seq_lens=torch.tensor([50], dtype=torch.int32),
        block_tables=tables,
        max_query_len=20,
        max_seq_len=50,
        query_start_loc_cpu=[0, 20],
        seq_lens_cpu=[50],
        num_decodes=0,
        num_decode_tokens=0,
    )
    out = TorchAttentionBackend().forward(q, k[30:], v[30:], k_cache, v_cache, metadata, 0.125)
    ctx = rows(cache, [(3, 4, 2, 0)[p // BLOCK] * BLOCK + p % BLOCK for p in range(50)])
    bf16 = [torch.from_numpy(dequantized64(c)).bfloat16().double().numpy() for c in ctx]
    for i in range(20):
        expected = reference_attention(q[i].double().numpy(), bf16[0][: 31 + i], bf16[1][: 31 + i])
        np.testing.assert_allclose(out[i].double().numpy(), expected, rtol=2**-8, atol=2e-3)


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_prefill_kernel_reads_codes_as_their_bf16_rounded_values(name, prefill_build):
    """The prefill kernel on a quantized cache gives, bit for bit, what it gives on the same
    cache dequantized to bf16 by torch (code * scale in float32, rounded to nearest even),
    for two requests whose chunks follow cached prefixes, over blocks out of order."""
    k, v = random_kv(8 * BLOCK, 9)
    cache = stored(name, k, v, list(range(8 * BLOCK)))
    k_cache, v_cache = cache.layers[0]
    tables = torch.tensor([[2, 0, 5, 1], [7, 3, 4, 6]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 21, 30], dtype=torch.int32)
    seq_lens = torch.tensor([50, 64], dtype=torch.int32)
    q = torch.randn(30, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(10)).bfloat16()
    outs = []
    for caches in (
        (k_cache, v_cache),
        [kv_format.dequantize(c).bfloat16() for c in cache.layers[0]],
    ):
        out = torch.empty_like(q)
        cpu_kernels.prefill_attention(q, *caches, tables, query_start_loc, seq_lens, 0.125, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("name", ["int8", "fp8_e5m2"])
def test_blocks_move_and_copy_with_their_scales(name):
    gen = torch.Generator().manual_seed(7)
    caches = []
    for _ in range(2):
        cache = KVCache.allocate(2, 8, 4, KV_HEADS, HEAD_DIM, QUANTIZED[name], "cpu")
        for k, v in cache.layers:
            for t in (k, v):
                t.view(torch.uint8).copy_(torch.randint(0, 120, t.shape, generator=gen))
        caches.append(cache)
    source, target = caches
    blocks = source.read_blocks([5, 1])
    assert blocks.dtype == QUANTIZED[name]
    assert blocks.data.shape == (2, 2, 2, 4, KV_HEADS, HEAD_DIM + 4)
    target.write_blocks([0, 6], blocks)
    target.copy_blocks([(6, 3)])
    for (k, v), (src_k, src_v) in zip(target.layers, source.layers):
        for t, src in ((k, src_k), (v, src_v)):
            assert torch.equal(t[[0, 6, 3]].view(torch.uint8), src[[5, 1, 1]].view(torch.uint8))
    with pytest.raises(ValueError, match="do not fit"):
        target.write_blocks([0, 6], KVBlocks(blocks.data.view(torch.uint8)))


def test_an_unknown_kv_cache_dtype_is_a_value_error_listing_the_choices(tiny_llama):
    with pytest.raises(ValueError, match="auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2, int8; got 'q4'"):
        EngineConfig(model=tiny_llama, kv_cache_dtype="q4")


def test_fp8_means_e4m3():
    assert kv_format.check_kv_cache_dtype("fp8") == "fp8_e4m3"


def test_a_quantized_cache_on_the_triton_path_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="CPU attention path only"):
        EngineConfig(model=tiny_llama, attention_backend="triton", kv_cache_dtype="int8")


def test_a_quantized_cache_under_a_float32_model_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="needs bfloat16 activations"):
        LLM(tiny_llama, dtype="float32", kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def bf16_model(build_model, tmp_path_factory) -> str:
    return build_model(
        str(tmp_path_factory.mktemp("kvdtype")),
        "llama",
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        hidden_size=384,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
    )


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_the_pool_holds_1_85x_the_tokens_and_every_block_comes_back(bf16_model, name):
    kwargs = dict(dtype="bfloat16", kv_cache_memory=4 << 20, max_model_len=256)
    bf16 = LLM(bf16_model, **kwargs).engine
    llm = LLM(bf16_model, kv_cache_dtype=name, **kwargs)
    engine = llm.engine
    assert engine.num_kv_blocks >= 1.85 * bf16.num_kv_blocks
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
    outputs = llm.generate(token_prompts([40, 3, 70]), params, use_tqdm=False)
    assert [len(c.token_ids) for o in outputs for c in o.outputs] == [20] * 6
    assert_idle(engine)

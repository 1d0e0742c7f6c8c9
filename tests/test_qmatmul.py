"""The int8 kernel on GGUF blocks (qmatmul.c; qmatmul_k.c for the K-quants): each format against a
float64 reference of the same dequantized weights (`gguf.quants.dequantize`; the K-quants on
random super-block bytes) and the kernel's own int8 activations, within float32 accumulation plus
the final bf16 rounding; a row's bits independent of the batch and the threads; the activations
quantized as llama.cpp quantizes its q8 blocks; the portable C loop (a build without AVX-512)
within the same bound; K-quant rows not whole super-blocks refused; and the tests' numpy K-quant
quantizer writing bytes gguf reads back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import use_amx_order
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from quire import envs
from quire.bench.kquants import quantize_k
from quire.kernels import cpu as cpu_kernels
from quire.kernels.cpu import qmatmul, qmatmul_k

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="needs the C kernels")

QTYPES = ["Q8_0", "Q4_0", "Q4_1"]
K_QTYPES = ["Q4_K", "Q5_K", "Q6_K"]


def random_k_blocks(qtype: str, rows: int, in_features: int, rng) -> np.ndarray:
    """Random K-quant super-blocks [rows, K / 256 * bytes]: every code and sub-block scale byte
    random, d (and dmin) random float16 in [0.005, 0.015)."""
    supers = in_features // 256
    blocks = rng.integers(0, 256, (rows * supers, qmatmul_k.GGUF_BLOCK_BYTES[qtype]), np.uint8)

    def scale() -> np.ndarray:
        return rng.uniform(0.005, 0.015, rows * supers).astype(np.float16).view(np.uint8)

    if qtype == "Q6_K":
        blocks[:, 208:210] = scale().reshape(-1, 2)
    else:
        blocks[:, 0:2], blocks[:, 2:4] = scale().reshape(-1, 2), scale().reshape(-1, 2)
    return blocks.reshape(rows, -1)


def make_case(qtype: str, rows: int, out_features: int, in_features: int, seed: int = 0):
    """x [rows, in] bf16, the GGUF blocks of a random W [out, in] (K-quants: random block bytes),
    and W dequantized (float64)."""
    rng = np.random.default_rng(seed)
    if qtype in K_QTYPES:
        raw = random_k_blocks(qtype, out_features, in_features, rng)
    else:
        weight = rng.standard_normal((out_features, in_features), np.float32)
        raw = quantize(weight, GGMLQuantizationType[qtype])
    dequantized = dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float64)
    x = torch.from_numpy(rng.standard_normal((rows, in_features), np.float32)).bfloat16()
    return x, raw, dequantized


def reference(x: torch.Tensor, dequantized: np.ndarray, bias: torch.Tensor | None):
    """(x W^T + b in float64 over the kernel's int8 activations, the sum of |terms|)."""
    codes, scales, _ = qmatmul.quantize_rows(x)
    rows, k = codes.shape
    xq = (codes.double().view(rows, k // 32, 32) * scales.double()[..., None]).view(rows, k)
    exact = xq.numpy() @ dequantized.T
    magnitude = np.abs(xq.numpy()) @ np.abs(dequantized).T
    if bias is not None:
        exact = exact + bias.double().numpy()
        magnitude = magnitude + np.abs(bias.double().numpy())
    return exact, magnitude


def assert_within_bound(out: torch.Tensor, exact: np.ndarray, magnitude: np.ndarray) -> None:
    """float32 sums of K / 32 block terms (each within 2^-22 of its magnitude), then one bf16
    rounding (half an ulp: at most 2^-8 of the value)."""
    error = np.abs(out.double().numpy() - exact)
    bound = 2.0**-8 * np.abs(exact) + 2.0**-20 * magnitude
    assert (error <= bound).all(), (error - bound).max()


# K: one block, three, 33 blocks (K is always whole blocks of 32 in these formats; the K-quants'
# one, two and three super-blocks of 256); N: under one panel of 32, one more than a panel,
# several panels and a part.
SHAPES = [(7, 32), (33, 96), (100, 1056)]
K_SHAPES = [(7, 256), (33, 512), (100, 768)]
ROWS = [1, 2, 3, 4, 5, 9, 17]


@pytest.mark.parametrize(
    "qtype, out_features, in_features",
    [(q, *shape) for q in QTYPES for shape in SHAPES]
    + [(q, *shape) for q in K_QTYPES for shape in K_SHAPES],
)
def test_each_format_matches_a_float64_reference(qtype, out_features, in_features) -> None:
    for rows in ROWS:
        x, raw, dequantized = make_case(qtype, rows, out_features, in_features, seed=rows)
        packed = qmatmul.pack(raw, qtype, in_features)
        out = qmatmul.qmatmul(x, packed, qtype, None, out_features, torch.float32)
        assert out.shape == (rows, out_features)
        assert_within_bound(out, *reference(x, dequantized, None))


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES)
def test_bias_is_added_before_the_rounding(qtype) -> None:
    x, raw, dequantized = make_case(qtype, 3, 40, 256)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = qmatmul.pack(raw, qtype, 256)
    out = qmatmul.qmatmul(x, packed, qtype, bias, 40, torch.float32)
    assert_within_bound(out, *reference(x, dequantized, bias))
    assert torch.equal(qmatmul.qmatmul(x, packed, qtype, bias, 40), out.bfloat16())


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES)
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(qtype) -> None:
    x, raw, _ = make_case(qtype, 13, 70, 512)
    packed = qmatmul.pack(raw, qtype, 512)
    batch = qmatmul.qmatmul(x, packed, qtype, None, 70)
    for i in range(13):
        assert torch.equal(qmatmul.qmatmul(x[i : i + 1], packed, qtype, None, 70), batch[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qmatmul.qmatmul(x, packed, qtype, None, 70), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES)
def test_prompt_rows_on_amx_tiles_multiply_the_weight_rounded_to_bf16(
    qtype, kernel_settings
) -> None:
    """Where the bf16 matmul runs on AMX tiles, a step's prompt rows take the weight dequantized
    to bf16 (each weight gguf's float value, rounded once) times the rows as they are, summed in
    float32 (tdpbf16ps); the rows before `first_prompt_row` keep the int8 sums. The K-quants'
    random super-blocks cover every code, sub-block scale and min."""
    use_amx_order(True)
    assert qmatmul.prompt_path() == "amx-bf16"
    for out_features, in_features in K_SHAPES if qtype in K_QTYPES else SHAPES:
        x, raw, dequantized = make_case(qtype, 40, out_features, in_features)
        packed = qmatmul.pack(raw, qtype, in_features)
        weight = qmatmul.dequantize_bf16(packed, qtype, out_features, in_features)
        assert torch.equal(weight, torch.from_numpy(dequantized).bfloat16())
        out = qmatmul.qmatmul(x, packed, qtype, None, out_features, torch.float32, 9)
        exact = x[9:].double().numpy() @ weight.double().numpy().T
        magnitude = np.abs(x[9:].double().numpy()) @ np.abs(weight.double().numpy()).T
        error = np.abs(out[9:].double().numpy() - exact)
        assert (error <= 2.0**-8 * np.abs(exact) + 2.0**-20 * magnitude).all()
        int8 = qmatmul.qmatmul(x, packed, qtype, None, out_features, torch.float32)
        assert torch.equal(out[:9], int8[:9])
        assert not torch.equal(out[9:], int8[9:])  # the other numerics ran


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES)
def test_a_prompt_rows_bits_do_not_depend_on_the_batch_the_split_or_the_threads(
    qtype, kernel_settings
) -> None:
    use_amx_order(True)
    in_features = 512 if qtype in K_QTYPES else 576
    x, raw, _ = make_case(qtype, 45, 200, in_features)
    packed = qmatmul.pack(raw, qtype, in_features)
    prompt = qmatmul.qmatmul(x, packed, qtype, None, 200, first_prompt_row=0)
    for first in (1, 17, 33, 44):  # row groups of 32 cut at other rows
        assert torch.equal(
            qmatmul.qmatmul(x, packed, qtype, None, 200, first_prompt_row=first)[first:],
            prompt[first:],
        )
    for i in (0, 16, 31, 44):
        alone = qmatmul.qmatmul(x[i : i + 1], packed, qtype, None, 200, first_prompt_row=0)
        assert torch.equal(alone, prompt[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qmatmul.qmatmul(x, packed, qtype, None, 200, first_prompt_row=0), prompt)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])
def test_prompt_rows_keep_the_int8_sums_off_amx(qtype, kernel_settings) -> None:
    """Without the AMX order (no AMX, or EngineConfig.cpu_amx off), the prompt rows' numerics
    are the generated rows'."""
    use_amx_order(False)
    assert qmatmul.prompt_path() == qmatmul.path()
    in_features = 512
    x, raw, _ = make_case(qtype, 20, 70, in_features)
    packed = qmatmul.pack(raw, qtype, in_features)
    assert torch.equal(
        qmatmul.qmatmul(x, packed, qtype, None, 70, first_prompt_row=5),
        qmatmul.qmatmul(x, packed, qtype, None, 70),
    )


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES)
def test_gate_up_prompt_rows_on_amx_tiles_give_silu_and_mul_bits_in_one_pass(
    qtype, kernel_settings
) -> None:
    """amx_silu_and_mul never writes the gate|up products, and its bits are theirs rounded to
    bf16, then pointwise.silu_and_mul's (torch's bf16 SiLU times up, rounded once)."""
    from quire.kernels.cpu import pointwise

    use_amx_order(True)
    shapes = (
        [(45, 64, 256), (1, 32, 512)]
        if qtype in K_QTYPES
        else [(45, 64, 96), (1, 32, 32), (70, 160, 1056)]
    )
    for rows, d, in_features in shapes:
        x, raw, _ = make_case(qtype, rows, 2 * d, in_features, seed=rows)
        packed = qmatmul.pack(raw, qtype, in_features)
        products = qmatmul.qmatmul(x, packed, qtype, None, 2 * d, first_prompt_row=0)
        fused = qmatmul.amx_silu_and_mul(x, packed, qtype, d)
        assert torch.equal(fused, pointwise.silu_and_mul(products))
        i = rows // 2  # a row alone: its bits
        assert torch.equal(
            qmatmul.amx_silu_and_mul(x[i : i + 1], packed, qtype, d), fused[i : i + 1]
        )


@pytest.mark.parametrize("first", [0, 5, 20])
def test_a_gate_up_layer_fuses_its_prompt_rows_and_keeps_its_bits(
    first, kernel_settings, monkeypatch
) -> None:
    """QuantizedLinear.silu_and_mul: the step's generated rows (before `first`) through the
    int8 sums and silu_and_mul, its prompt rows fused on the tiles; every row as
    silu_and_mul(layer(x)) gives it."""
    from quire.layers import quantized_linear
    from quire.layers.activation import silu_and_mul
    from quire.layers.quantized_linear import QuantizedLinear, QuantizedWeight

    use_amx_order(True)
    monkeypatch.setattr(quantized_linear, "first_prompt_row", lambda rows: first)
    fused = []
    amx_silu_and_mul = qmatmul.amx_silu_and_mul
    monkeypatch.setattr(
        qmatmul, "amx_silu_and_mul", lambda x, *a: fused.append(len(x)) or amx_silu_and_mul(x, *a)
    )
    x, raw, _ = make_case("Q4_1", 20, 128, 96)
    layer = QuantizedLinear(QuantizedWeight(raw, "Q4_1", (128, 96)), None)
    assert torch.equal(layer.silu_and_mul(x), silu_and_mul(layer(x)))
    assert fused == ([20 - first] if first < 20 else [])


def test_strided_rows_give_the_contiguous_result() -> None:
    x, raw, _ = make_case("Q4_0", 5, 64, 128)
    wide = torch.zeros(5, 160, dtype=torch.bfloat16)
    wide[:, :128] = x
    packed = qmatmul.pack(raw, "Q4_0", 128)
    strided = qmatmul.qmatmul(wide[:, :128], packed, "Q4_0", None, 64)
    assert torch.equal(strided, qmatmul.qmatmul(x, packed, "Q4_0", None, 64))


def test_activations_are_quantized_per_block_of_32_as_llama_cpp_does() -> None:
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[1, 32:64] = 0  # an all-zero block: scale 0, codes 0
    codes, scales, sums = qmatmul.quantize_rows(x)
    blocks = x.float().numpy().reshape(3, 3, 32)
    amax = np.abs(blocks).max(axis=2)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    expected = np.rint(blocks * inverse[..., None]).astype(np.int8)
    assert np.array_equal(codes.numpy().reshape(3, 3, 32), expected)
    assert np.array_equal(scales.numpy(), amax / np.float32(127))
    assert np.array_equal(sums.numpy(), expected.astype(np.int32).sum(axis=2))
    assert np.abs(codes.numpy()).max() == 127


def test_pack_lays_out_panels_of_32_columns_by_groups_of_4() -> None:
    """Q8_0: per block, byte i of group g of column c is code 4g + i plus 128; then the 32
    columns' float16 scales."""
    _, raw, _ = make_case("Q8_0", 1, 32, 64)
    packed = qmatmul.pack(raw, "Q8_0", 64).numpy()
    assert packed.shape == (1, 2, 32 * 32 + 64)
    blocks = raw.reshape(32, 2, 34)
    c, b, g, i = 5, 1, 3, 2
    assert packed[0, b, g * 128 + c * 4 + i] == blocks[c, b, 2 + 4 * g + i] ^ 0x80
    assert packed[0, b, 1024 + 2 * c : 1024 + 2 * c + 2].tobytes() == blocks[c, b, :2].tobytes()


def test_shapes_the_kernel_does_not_take_raise() -> None:
    x, raw, _ = make_case("Q8_0", 2, 32, 64)
    packed = qmatmul.pack(raw, "Q8_0", 64)
    with pytest.raises(ValueError, match="columns"):
        qmatmul.qmatmul(x[:, :32], packed, "Q8_0", None, 32)
    with pytest.raises(ValueError, match="bf16"):
        qmatmul.qmatmul(x.float(), packed, "Q8_0", None, 32)
    with pytest.raises(ValueError, match="not one of"):
        qmatmul.pack(raw, "Q5_0", 64)
    # GGUF's block formats hold whole blocks of 32 along K
    with pytest.raises(ValueError, match="not a multiple of 32"):
        qmatmul.pack(raw, "Q8_0", 48)


# A build for another target: x86-64-v3 (AVX2, no AVX-512: Zen 2/3, Haswell to Skylake) runs
# the AVX2 loops, x86-64-v2 the plain C ones.
PORTABLE = {"x86-64-v3": 1, "x86-64-v2": 0}  # march: its qmatmul_path()


@pytest.mark.parametrize("march", list(PORTABLE))
@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES)
def test_the_portable_loops_match_the_reference_too(qtype, march, monkeypatch) -> None:
    """The AVX2 and plain C loops: the same sums in the same order as AVX-512 VNNI's, so the
    same bits; and the same bf16 weights for the AMX prompt loop."""
    monkeypatch.setattr(envs, "QUIRE_CPU_MARCH", march)
    portable = cpu_kernels.build_library.__wrapped__(cpu_kernels._SOURCE_DIR)
    assert portable is not None and portable.qmatmul_vnni() == 0
    assert portable.qmatmul_path() == PORTABLE[march]
    x, raw, dequantized = make_case(qtype, 5, 33, 512)
    packed = qmatmul.pack(raw, qtype, 512)
    native = qmatmul.qmatmul(x, packed, qtype, None, 33, torch.float32)
    monkeypatch.setattr(qmatmul, "load_library", lambda: portable)
    out = qmatmul.qmatmul(x, packed, qtype, None, 33, torch.float32)
    assert_within_bound(out, *reference(x, dequantized, None))
    assert torch.equal(out, native)
    # the AMX prompt loop's weights, as the portable C dequantizes them
    weight = qmatmul.dequantize_bf16(packed, qtype, 33, 512)
    assert torch.equal(weight, torch.from_numpy(dequantized).bfloat16())


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_k_quant_rows_not_whole_super_blocks_are_refused(qtype) -> None:
    x, raw, _ = make_case(qtype, 2, 32, 512)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        qmatmul.pack(raw, qtype, 480)
    packed = qmatmul.pack(raw, qtype, 512)
    assert packed.shape == (1, 2, qmatmul_k.record_bytes(qtype))
    with pytest.raises(ValueError, match="columns"):
        qmatmul.qmatmul(x[:, :256], packed, qtype, None, 32)


@pytest.mark.parametrize(
    ("qtype", "legacy"), [("Q4_K", "Q4_0"), ("Q5_K", "Q5_0"), ("Q6_K", "Q5_0")]
)
def test_the_numpy_k_quantizer_writes_blocks_gguf_reads_back(qtype, legacy) -> None:
    """Its bytes, dequantized by the gguf package, are closer to the input than the gguf
    package's own quantizer of as many bits or fewer gets."""
    values = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    raw = quantize_k(values, qtype)
    assert raw.shape == (16, 2 * qmatmul_k.GGUF_BLOCK_BYTES[qtype])
    error = dequantize(raw, GGMLQuantizationType[qtype]) - values
    legacy_raw = quantize(values, GGMLQuantizationType[legacy])
    legacy_error = dequantize(legacy_raw, GGMLQuantizationType[legacy]) - values
    assert np.sqrt((error**2).mean()) < np.sqrt((legacy_error**2).mean())
    with pytest.raises(ValueError, match="super-blocks of 256"):
        quantize_k(values[:, :480], qtype)


def shards_of(linear, types: dict[str, str]) -> dict:
    """QuantizedWeights for a q|k|v linear's shards, of the given types (in any order), and the
    full weight, dequantized, in q|k|v order."""
    from quire.layers.quantized_linear import QuantizedWeight

    rng = np.random.default_rng(0)
    shards = {}
    for shard, qtype in types.items():
        n = linear.local_heads[shard] * linear.head_dim
        values = rng.standard_normal((n, linear.in_features), np.float32)
        raw = quantize(values, GGMLQuantizationType[qtype])
        shards[shard] = QuantizedWeight(raw, qtype, (n, linear.in_features))
    return shards, torch.cat([shards[shard].dequantize() for shard in "qkv"])


def test_a_fused_linear_of_one_type_becomes_one_quantized_linear() -> None:
    from quire.layers.parallel_linear import QKVParallelLinear
    from quire.layers.quantized_linear import QuantizedLinear, quantize_linear_layers

    holder = torch.nn.Module()
    holder.qkv = QKVParallelLinear(64, 32, 2, 1, bias=False)
    shards, full = shards_of(holder.qkv, {"v": "Q4_0", "q": "Q4_0", "k": "Q4_0"})
    holder.qkv.quantized_shards = shards
    assert quantize_linear_layers(holder) == 1
    assert isinstance(holder.qkv, QuantizedLinear) and holder.qkv.out_features == 128
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    exact, magnitude = reference(x, full.double().numpy(), None)
    assert_within_bound(holder.qkv(x, torch.float32), exact, magnitude)  # rows in q|k|v order


def test_a_fused_linear_of_mixed_types_keeps_each_type_as_a_part() -> None:
    """q and k in Q4_0, v in Q8_0: one QuantizedLinear over two parts, each summed as its own
    type's kernel sums it; a row's bits do not depend on the batch."""
    from quire.layers.parallel_linear import QKVParallelLinear
    from quire.layers.quantized_linear import QuantizedLinear, quantize_linear_layers

    holder = torch.nn.Module()
    holder.qkv = QKVParallelLinear(64, 32, 2, 1, bias=False)
    shards, full = shards_of(holder.qkv, {"q": "Q4_0", "k": "Q4_0", "v": "Q8_0"})
    holder.qkv.quantized_shards = shards
    assert quantize_linear_layers(holder) == 1
    assert isinstance(holder.qkv, QuantizedLinear) and holder.qkv.qtype == "Q4_0+Q8_0"
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    out = holder.qkv(x, torch.float32)
    assert_within_bound(out, *reference(x, full.double().numpy(), None))
    assert torch.equal(holder.qkv(x[2:3], torch.float32), out[2:3])


def test_a_fused_linear_in_parts_takes_each_parts_prompt_loop(kernel_settings, monkeypatch) -> None:
    """A Q4_K_M file's q|k|v (q and k in Q4_K, v in Q6_K) on AMX tiles: each part's prompt rows
    its dequantized weight's bf16 products, the generated rows each part's int8 sums; a prompt
    row's bits alone as in the batch. Its gate|up silu goes through the products (no fused pass
    over parts), with the same bits."""
    from quire.layers import quantized_linear
    from quire.layers.activation import silu_and_mul
    from quire.layers.parallel_linear import QKVParallelLinear
    from quire.layers.quantized_linear import (
        QuantizedLinear,
        QuantizedWeight,
        quantize_linear_layers,
    )

    use_amx_order(True)
    holder = torch.nn.Module()
    holder.qkv = QKVParallelLinear(512, 32, 4, 2, bias=False)
    rng = np.random.default_rng(3)
    shards = {}
    for shard, qtype in {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}.items():
        n = holder.qkv.local_heads[shard] * holder.qkv.head_dim
        shards[shard] = QuantizedWeight(random_k_blocks(qtype, n, 512, rng), qtype, (n, 512))
    holder.qkv.quantized_shards = shards
    assert quantize_linear_layers(holder) == 1
    layer = holder.qkv
    assert isinstance(layer, QuantizedLinear) and layer.qtype == "Q4_K+Q6_K"
    x = torch.from_numpy(rng.standard_normal((20, 512), np.float32)).bfloat16()
    # rows 0..5 generated tokens, the rest prompt tokens; a row alone is a prompt token
    monkeypatch.setattr(quantized_linear, "first_prompt_row", lambda rows: 6 if rows > 1 else 0)
    out = layer(x, torch.float32)
    column = 0
    for shard in "qkv":
        weight = shards[shard]
        n = weight.shape[0]
        packed = qmatmul.pack(weight.raw, weight.qtype, 512)
        alone = qmatmul.qmatmul(x, packed, weight.qtype, None, n, torch.float32, 6)
        assert torch.equal(out[:, column : column + n], alone)
        column += n
    assert torch.equal(layer(x[10:11], torch.float32), out[10:11])  # a prompt row alone
    gate_up = QuantizedLinear(
        [
            QuantizedWeight(random_k_blocks(qtype, 32, 512, rng), qtype, (32, 512))
            for qtype in ("Q4_K", "Q6_K")
        ],
        None,
    )
    assert gate_up.qtype == "Q4_K+Q6_K"
    assert torch.equal(gate_up.silu_and_mul(x), silu_and_mul(gate_up(x)))


def test_a_fused_linear_with_a_float_shard_is_dequantized_in_place() -> None:
    from quire.layers.parallel_linear import QKVParallelLinear
    from quire.layers.quantized_linear import quantize_linear_layers

    holder = torch.nn.Module()
    holder.qkv = QKVParallelLinear(64, 32, 2, 1, bias=False)
    shards, full = shards_of(holder.qkv, {"q": "Q4_0", "k": "Q4_0", "v": "Q8_0"})
    holder.qkv.weight_loader(holder.qkv.weight, shards.pop("v").dequantize(), "v")
    holder.qkv.quantized_shards = shards
    assert quantize_linear_layers(holder) == 0
    assert type(holder.qkv) is QKVParallelLinear and not hasattr(holder.qkv, "quantized_shards")
    assert torch.equal(holder.qkv.weight.data, full)


def test_q8_0_blocks_dequantize_as_gguf_dequantizes_them() -> None:
    """QuantizedWeight.dequantize's torch path for Q8_0 (the tied embedding of the default model)
    gives gguf's float32 values bit for bit: random bytes, so every code and every float16 scale
    (subnormals, negatives, large) appears."""
    from quire.layers.quantized_linear import QuantizedWeight

    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (48, 4 * 34), np.uint8)
    scales = rng.standard_normal((48, 4)).astype(np.float16)
    scales[0, 0] = np.float16(3e-7)  # subnormal
    for block in range(4):
        raw[:, block * 34 : block * 34 + 2] = scales[:, block : block + 1].view(np.uint8)
    got = QuantizedWeight(raw, "Q8_0", (48, 128)).dequantize()
    expected = dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32)
    assert got.dtype == torch.float32 and got.shape == (48, 128)
    assert torch.equal(got, torch.from_numpy(expected))

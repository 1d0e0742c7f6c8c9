"""The int8 kernel on GGUF K-quant super-blocks (qmatmul_k.c): Q4_K, Q5_K and Q6_K on random block
bytes against a float64 reference of `gguf.quants.dequantize` and the kernel's own int8
activations, within float32 accumulation plus the final bf16 rounding; a row's bits independent
of the batch and the threads; K not a multiple of 256 refused; the portable C loop within the
same bound; and the tests' numpy K-quant quantizer writing bytes gguf reads back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from test_qmatmul import assert_within_bound, reference

from quire import envs
from quire.bench.kquants import quantize_k
from quire.kernels import cpu as cpu_kernels
from quire.kernels.cpu import qmatmul, qmatmul_k

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="needs the C kernels")

QTYPES = ["Q4_K", "Q5_K", "Q6_K"]


def random_blocks(qtype: str, rows: int, in_features: int, rng) -> np.ndarray:
    """Random super-blocks [rows, K / 256 * bytes]: every code and sub-block scale byte random,
    d (and dmin) random float16 in [0.005, 0.015)."""
    supers = in_features // 256
    blocks = rng.integers(0, 256, (rows * supers, qmatmul_k.GGUF_BLOCK_BYTES[qtype]), np.uint8)

    def scale() -> np.ndarray:
        values = rng.uniform(0.005, 0.015, rows * supers).astype(np.float16)
        return values.view(np.uint8).reshape(-1, 2)

    if qtype == "Q6_K":
        blocks[:, 208:210] = scale()
    else:
        blocks[:, 0:2], blocks[:, 2:4] = scale(), scale()
    return blocks.reshape(rows, -1)


def make_case(qtype: str, rows: int, out_features: int, in_features: int, seed: int = 0):
    """x [rows, in] bf16, random blocks of W [out, in], and W dequantized by gguf (float64)."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, out_features, in_features, rng)
    dequantized = dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float64)
    x = torch.from_numpy(rng.standard_normal((rows, in_features), np.float32)).bfloat16()
    return x, raw, dequantized


# K: one super-block, two, three; N: under one panel of 32, one more than a panel, several and a part.
SHAPES = [(7, 256), (33, 512), (100, 768)]
ROWS = [1, 2, 3, 4, 5, 9]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_each_k_quant_matches_a_float64_reference(qtype, out_features, in_features) -> None:
    for rows in ROWS:
        x, raw, dequantized = make_case(qtype, rows, out_features, in_features, seed=rows)
        packed = qmatmul.pack(raw, qtype, in_features)
        assert packed.shape == (
            -(-out_features // 32),
            in_features // 256,
            qmatmul_k.record_bytes(qtype),
        )
        out = qmatmul.qmatmul(x, packed, qtype, None, out_features, torch.float32)
        assert out.shape == (rows, out_features)
        assert_within_bound(out, *reference(x, dequantized, None))


@pytest.mark.parametrize("qtype", QTYPES)
def test_bias_is_added_before_the_rounding(qtype) -> None:
    x, raw, dequantized = make_case(qtype, 3, 40, 256)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = qmatmul.pack(raw, qtype, 256)
    out = qmatmul.qmatmul(x, packed, qtype, bias, 40, torch.float32)
    assert_within_bound(out, *reference(x, dequantized, bias))
    assert torch.equal(qmatmul.qmatmul(x, packed, qtype, bias, 40), out.bfloat16())


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(qtype) -> None:
    x, raw, _ = make_case(qtype, 11, 70, 512)
    packed = qmatmul.pack(raw, qtype, 512)
    batch = qmatmul.qmatmul(x, packed, qtype, None, 70)
    for i in range(11):
        assert torch.equal(qmatmul.qmatmul(x[i : i + 1], packed, qtype, None, 70), batch[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qmatmul.qmatmul(x, packed, qtype, None, 70), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", QTYPES)
def test_k_not_a_multiple_of_the_super_block_is_refused(qtype) -> None:
    x, raw, _ = make_case(qtype, 2, 32, 512)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        qmatmul.pack(raw, qtype, 480)
    packed = qmatmul.pack(raw, qtype, 512)
    with pytest.raises(ValueError, match="columns"):
        qmatmul.qmatmul(x[:, :256], packed, qtype, None, 32)


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_portable_loop_matches_the_reference_too(qtype, monkeypatch) -> None:
    """A build for x86-64-v3 (AVX2, no AVX-512: what an older CPU gets) runs the plain C loop."""
    monkeypatch.setattr(envs, "QUIRE_CPU_MARCH", "x86-64-v3")
    portable = cpu_kernels.build_library.__wrapped__(cpu_kernels._SOURCE_DIR)
    assert portable is not None and portable.qmatmul_vnni() == 0
    x, raw, dequantized = make_case(qtype, 5, 33, 512)
    packed = qmatmul.pack(raw, qtype, 512)
    native = qmatmul.qmatmul(x, packed, qtype, None, 33, torch.float32)
    monkeypatch.setattr(qmatmul, "load_library", lambda: portable)
    out = qmatmul.qmatmul(x, packed, qtype, None, 33, torch.float32)
    assert_within_bound(out, *reference(x, dequantized, None))
    assert torch.equal(out, native)  # the same sums in the same order


@pytest.mark.parametrize(
    ("qtype", "legacy"), [("Q4_K", "Q4_0"), ("Q5_K", "Q5_0"), ("Q6_K", "Q5_0")]
)
def test_the_numpy_quantizer_writes_blocks_gguf_reads_back(qtype, legacy) -> None:
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

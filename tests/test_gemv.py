"""The GEMV kernel (bf16 x W^T + b for up to 8 rows) gives oneDNN's bits (torch's bf16 linear on
CPU), a row the same bits whatever the batch, threads or row stride, and PackedLinear uses it for
up to 8 rows only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quire.kernels.cpu import gemv
from quire.layers.linear import PackedLinear, packed_linear_supported

pytestmark = pytest.mark.skipif(
    not gemv.available(), reason="the GEMV kernel needs a C compiler and AVX-512 BF16"
)


def make_case(
    rows: int, out_features: int, in_features: int, bias: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [rows, in], W [out, in] (scaled so outputs are O(1)), b [out] or None; all bf16."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    return x, weight, b


def run(x, weight, b, out_dtype=torch.bfloat16) -> torch.Tensor:
    """gemv.gemv with the weight packed and the block size found as PackedLinear finds them."""
    out_features, in_features = weight.shape
    k_block = gemv.k_block_for(out_features, in_features, b is not None)
    assert k_block is not None
    return gemv.gemv(x, gemv.pack(weight), b, out_features, k_block, out_dtype)


@pytest.mark.parametrize("out_features", [7, 130, 1000])  # 7, 130: a padded panel
@pytest.mark.parametrize("in_features", [32, 64, 576, 1000, 1536, 3072])  # one, two, 3 blocks
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_gives_torch_bf16_linear_bits(out_features, in_features, bias) -> None:
    for rows in range(1, gemv.GEMV_MAX_ROWS + 1):
        x, weight, b = make_case(rows, out_features, in_features, bias, seed=rows)
        out = run(x, weight, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        assert torch.equal(out, F.linear(x, weight, b)), (out != F.linear(x, weight, b)).sum()


@pytest.mark.parametrize("in_features", [576, 1536, 3072])
def test_the_probe_tells_block_sizes_apart(in_features) -> None:
    # k_block_for picks the block size whose bits match oneDNN's on a probe; every other block
    # size must fail on it, or a wrong one could be picked.
    weight, x = gemv._probe(256, in_features)
    packed = gemv.pack(weight)
    right = gemv.k_block_for(256, in_features, False)
    expected = F.linear(x, weight)
    assert torch.equal(gemv.gemv(x, packed, None, 256, right), expected)
    # Blocks as wide as K or wider all sum K in one block: check each distinct one once.
    blocks = (64, 128, 256, 512, 1024, 2048, in_features)
    for k_block in {min(kb, in_features) for kb in blocks} - {right}:
        wrong = gemv.gemv(x, packed, None, 256, k_block)
        assert (wrong != expected).float().mean() > 0.05, k_block


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_output_is_the_bf16_output_widened(rows, bias) -> None:
    x, weight, b = make_case(rows, 130, 576, bias)
    out = run(x, weight, b, torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, run(x, weight, b).float())


def test_strided_rows_give_the_contiguous_result() -> None:
    x, weight, b = make_case(5, 130, 576, True)
    expected = run(x, weight, b)
    wide = torch.zeros(5, 576 + 96, dtype=torch.bfloat16)
    wide[:, 32 : 32 + 576] = x
    row_strided = wide[:, 32 : 32 + 576]  # row stride 672, offset start
    assert not row_strided.is_contiguous()
    assert torch.equal(run(row_strided, weight, b), expected)
    column_strided = x.t().contiguous().t()  # column stride 5
    assert torch.equal(run(column_strided, weight, b), expected)


def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch() -> None:
    x, weight, b = make_case(gemv.GEMV_MAX_ROWS, 1000, 1536, True)  # enough outputs to catch a
    batch = run(x, weight, b)  # different summation order, which changes ~0.3% of them
    for i in range(gemv.GEMV_MAX_ROWS):
        assert torch.equal(run(x[i : i + 1], weight, b), batch[i : i + 1]), i
        assert torch.equal(run(x[: i + 1], weight, b), batch[: i + 1]), i


def test_result_does_not_depend_on_the_thread_count() -> None:
    x, weight, b = make_case(6, 1000, 576, True)  # 32 panels: split across threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x, weight, b)
        torch.set_num_threads(2)
        two = run(x, weight, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_pack_holds_panels_of_32_outputs_by_column_pairs() -> None:
    _, weight, _ = make_case(1, 130, 96, False)
    packed = gemv.pack(weight)
    assert packed.shape == (5, 48, 32, 2) and packed.dtype == torch.bfloat16
    n = torch.arange(130)[:, None]
    k = torch.arange(96)[None, :]
    # packed[p, c, j, i] = W[32 p + j, 2 c + i]
    assert torch.equal(packed[n // 32, k // 2, n % 32, k % 2], weight)
    assert torch.equal(packed[4, :, 2:], torch.zeros(48, 30, 2, dtype=torch.bfloat16))  # pad


@pytest.mark.parametrize("rows", [0, gemv.GEMV_MAX_ROWS + 1])
def test_row_counts_outside_one_to_eight_raise(rows) -> None:
    x, weight, _ = make_case(rows, 8, 64, False)
    with pytest.raises(ValueError, match=f"{rows} rows"):
        gemv.gemv(x, gemv.pack(weight), None, 8, 64)


def test_odd_columns_are_unsupported_and_a_mismatched_weight_raises() -> None:
    x, weight, _ = make_case(2, 8, 47, False)
    assert not gemv.supported(weight)
    with pytest.raises(ValueError, match="47 columns"):
        gemv.gemv(x, torch.zeros(1, 24, 32, 2, dtype=torch.bfloat16), None, 8, 48)
    with pytest.raises(ValueError, match="bf16 only"):
        gemv.gemv(x.float(), torch.zeros(1, 24, 32, 2, dtype=torch.bfloat16), None, 8, 48)


def test_only_bf16_weights_are_supported() -> None:
    _, weight, _ = make_case(1, 8, 64, False)
    assert gemv.supported(weight)
    assert not gemv.supported(weight.float())
    assert not gemv.supported(weight.half())


@pytest.fixture
def gemv_calls(monkeypatch) -> list[int]:
    """The row count of every gemv.gemv call (PackedLinear calls it through its module)."""
    calls: list[int] = []
    real = gemv.gemv

    def spy(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gemv, "gemv", spy)
    return calls


needs_onednn = pytest.mark.skipif(
    not packed_linear_supported("cpu", torch.bfloat16), reason="torch has no oneDNN here"
)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_runs_up_to_eight_rows_in_the_gemv_kernel(gemv_calls, bias) -> None:
    x, weight, b = make_case(gemv.GEMV_MAX_ROWS, 130, 576, bias)
    linear = PackedLinear(weight, b)
    assert linear.gemv_weight is not None
    for rows in range(1, gemv.GEMV_MAX_ROWS + 1):
        expected = F.linear(x[:rows], weight, b)
        gemv_calls.clear()
        assert torch.equal(linear(x[:rows]), expected)
        assert gemv_calls == [rows]
        widened = linear(x[:rows], out_dtype=torch.float32)
        assert widened.dtype == torch.float32 and torch.equal(widened, expected.float())
    gemv_calls.clear()
    out = linear(x.view(2, 4, 576))  # leading dimensions flattened: 8 rows
    assert gemv_calls == [8] and torch.equal(out, linear(x).view(2, 4, 130))


@needs_onednn
@pytest.mark.parametrize("rows", [gemv.GEMV_MAX_ROWS + 1, 33])
def test_packed_linear_runs_more_rows_in_onednn(gemv_calls, rows) -> None:
    x, weight, b = make_case(rows, 130, 576, True)
    linear = PackedLinear(weight, b)
    out = linear(x)
    assert gemv_calls == []
    assert torch.equal(out, F.linear(x, weight, b))  # oneDNN's packed weight: nn.Linear's bits
    assert torch.equal(linear(x, out_dtype=torch.float32), out.float())


@needs_onednn
def test_quire_gemv_0_keeps_no_gemv_copy(gemv_calls, monkeypatch) -> None:
    monkeypatch.setenv("QUIRE_GEMV", "0")
    x, weight, b = make_case(1, 130, 576, True)
    linear = PackedLinear(weight, b)
    assert linear.gemv_weight is None
    assert torch.equal(linear(x), F.linear(x, weight, b))
    assert gemv_calls == []


@needs_onednn
def test_packed_linear_keeps_no_gemv_copy_for_unsupported_columns(gemv_calls) -> None:
    x, weight, _ = make_case(1, 16, 39, False)
    linear = PackedLinear(weight, None)
    assert linear.gemv_weight is None
    assert torch.equal(linear(x), F.linear(x, weight))
    assert gemv_calls == []


@needs_onednn
def test_no_gemv_copy_when_no_block_size_gives_onednns_bits(gemv_calls, monkeypatch) -> None:
    # A oneDNN that sums some other way (another version or machine): the kernel must not be
    # used, or a request's tokens would depend on which path its steps took.
    def other_sums(x, weight, bias):
        return F.linear(
            x.float(), weight.float(), None if bias is None else bias.float()
        ).bfloat16()

    monkeypatch.setattr(gemv, "_onednn_linear", other_sums)
    gemv.k_block_for.cache_clear()
    try:
        x, weight, b = make_case(1, 130, 576, True)
        assert gemv.k_block_for(130, 576, True) is None
        linear = PackedLinear(weight, b)
        assert linear.gemv_weight is None
        gemv_calls.clear()  # the probing itself ran the kernel
        assert torch.equal(linear(x), F.linear(x, weight, b))
        assert gemv_calls == []
    finally:
        gemv.k_block_for.cache_clear()

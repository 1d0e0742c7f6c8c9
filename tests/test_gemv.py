"""The GEMV kernel (bf16 x W^T + b for any number of rows, in passes of 8 rows per weight panel)
gives oneDNN's bits (torch's bf16 linear on CPU), a row the same bits whatever the batch, threads or
row stride, and PackedLinear runs every row count in it (on a CPU with AMX, only up to
gemv.max_rows(): oneDNN runs more)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from quire.kernels import cpu as cpu_kernels
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


# Row counts: each size of one 8-row pass, then several passes of balanced sizes (9 = 4 + 5,
# 17 = 5 + 6 + 6, 24 = 3 x 8, 33 = 5 passes of 6 or 7, 100 = 13 of 7 or 8).
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 24, 33, 64, 100]


@pytest.mark.parametrize("out_features", [7, 130, 1000])  # 7, 130: a padded panel
@pytest.mark.parametrize("in_features", [32, 64, 576, 1000, 1536, 3072])  # one, two, 3 blocks
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_gives_torch_bf16_linear_bits(out_features, in_features, bias) -> None:
    for rows in ROWS:
        x, weight, b = make_case(rows, out_features, in_features, bias, seed=rows)
        out = run(x, weight, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        # oneDNN sums a lone row of K > 1,024 in blocks of 512, and 2 rows or more in blocks of
        # 1,024 (the kernel's order at every row count): compare with oneDNN on 2 rows or more.
        expected = F.linear(x.repeat(2, 1), weight, b)[:rows]
        assert torch.equal(out, expected), (out != expected).sum()


def test_a_lone_row_of_more_than_1024_columns_is_summed_as_in_a_batch() -> None:
    # The case where oneDNN's lone-row order differs from its batch order in one output: the
    # kernel gives the batch order for the lone row too, so a row's bits never depend on the
    # batch (quire runs every row count in the kernel).
    _, weight, _ = make_case(1, 1000, 1536, False)
    x = torch.randn(1, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    batch = F.linear(x.repeat(2, 1), weight)[:1]
    assert not torch.equal(F.linear(x, weight), batch)  # oneDNN: lone row != row in a batch
    assert torch.equal(run(x, weight, None), batch)


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


@pytest.mark.parametrize("rows", [1, 3, 8, 19])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_output_is_the_bf16_output_widened(rows, bias) -> None:
    x, weight, b = make_case(rows, 130, 576, bias)
    out = run(x, weight, b, torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, run(x, weight, b).float())


@pytest.mark.parametrize("rows", [5, 13])  # one pass; two, the second starting at row 6
def test_strided_rows_give_the_contiguous_result(rows) -> None:
    x, weight, b = make_case(rows, 130, 576, True)
    expected = run(x, weight, b)
    wide = torch.zeros(rows, 576 + 96, dtype=torch.bfloat16)
    wide[:, 32 : 32 + 576] = x
    row_strided = wide[:, 32 : 32 + 576]  # row stride 672, offset start
    assert not row_strided.is_contiguous()
    assert torch.equal(run(row_strided, weight, b), expected)
    column_strided = x.t().contiguous().t()  # column stride `rows`
    assert torch.equal(run(column_strided, weight, b), expected)


def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch() -> None:
    # 20 rows: the prefixes take one to three passes (20 = 6 + 7 + 7), so a row's place in its
    # pass, and the pass it is in, change with the batch.
    x, weight, b = make_case(20, 1000, 1536, True)  # enough outputs to catch a different
    batch = run(x, weight, b)  # summation order, which changes ~0.3% of them
    for i in range(20):
        assert torch.equal(run(x[i : i + 1], weight, b), batch[i : i + 1]), i
        assert torch.equal(run(x[: i + 1], weight, b), batch[: i + 1]), i


@pytest.mark.parametrize("rows", [6, 20])
def test_result_does_not_depend_on_the_thread_count(rows) -> None:
    x, weight, b = make_case(rows, 1000, 576, True)  # 32 panels: split across threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x, weight, b)
        torch.set_num_threads(2)
        two = run(x, weight, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("fma", [False, True])
def test_both_inner_loops_give_onednns_bits(fma, kernel_settings) -> None:
    """vdpbf16ps and its emulation by two FMAs (picked by a timing probe, forced here as
    EngineConfig.gemv_fma does) give the same bits: oneDNN's from two rows on, a lone row's as
    in a batch."""
    cpu_kernels.configure(cpu_kernels.KernelSettings(enabled=True, gemv_fma=fma))
    assert cpu_kernels.load_library().gemv_bf16_uses_fma() == fma
    gen = torch.Generator().manual_seed(0)
    for k in (576, 1536, 3072):
        x = torch.randn(19, k, generator=gen).bfloat16()
        w = (torch.randn(130, k, generator=gen) / k**0.5).bfloat16()
        b = torch.randn(130, generator=gen).bfloat16()
        k_block = gemv.k_block_for(130, k, True)
        out = gemv.gemv(x, gemv.pack(w), b, 130, k_block)
        assert torch.equal(out[1:], F.linear(x[1:], w, b)), k  # oneDNN's bits from two rows on
        assert torch.equal(out[:1], gemv.gemv(x[:1], gemv.pack(w), b, 130, k_block)), k


def test_pack_holds_panels_of_32_outputs_by_column_pairs() -> None:
    _, weight, _ = make_case(1, 130, 96, False)
    packed = gemv.pack(weight)
    assert packed.shape == (5, 48, 32, 2) and packed.dtype == torch.bfloat16
    n = torch.arange(130)[:, None]
    k = torch.arange(96)[None, :]
    # packed[p, c, j, i] = W[32 p + j, 2 c + i]
    assert torch.equal(packed[n // 32, k // 2, n % 32, k % 2], weight)
    assert torch.equal(packed[4, :, 2:], torch.zeros(48, 30, 2, dtype=torch.bfloat16))  # pad


def test_zero_rows_raise() -> None:
    x, weight, _ = make_case(0, 8, 64, False)
    with pytest.raises(ValueError, match="0 rows"):
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
    not packed_linear_supported("cpu", torch.bfloat16),
    reason="torch's oneDNN does not run bf16 on this CPU",
)


@pytest.fixture
def amx(monkeypatch):
    """amx(present): gemv.max_rows() as on a CPU with or without AMX tiles (its cache cleared
    then, and again after the test)."""

    def set_amx(present: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: present, raising=False)
        gemv.max_rows.cache_clear()

    yield set_amx
    gemv.max_rows.cache_clear()


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_runs_up_to_max_rows_in_the_gemv_kernel(gemv_calls, bias) -> None:
    x, weight, b = make_case(max(ROWS), 130, 576, bias)
    linear = PackedLinear(weight, b, use_gemv=True)
    assert linear.gemv_weight is not None
    for rows in ROWS:
        expected = F.linear(x[:rows], weight, b)
        gemv_calls.clear()
        assert torch.equal(linear(x[:rows]), expected)
        assert gemv_calls == ([rows] if rows <= gemv.max_rows() else [])
        widened = linear(x[:rows], out_dtype=torch.float32)
        assert widened.dtype == torch.float32 and torch.equal(widened, expected.float())
    gemv_calls.clear()
    out = linear(x[:24].view(2, 3, 4, 576))  # leading dimensions flattened: 24 rows
    assert gemv_calls == [24] and torch.equal(out, linear(x[:24]).view(2, 3, 4, 130))


@needs_onednn
def test_without_amx_packed_linear_runs_every_row_count_in_the_gemv_kernel(gemv_calls, amx) -> None:
    amx(False)
    assert gemv.max_rows() == sys.maxsize
    x, weight, b = make_case(600, 40, 64, True)  # a small weight keeps 600 rows cheap
    linear = PackedLinear(weight, b, use_gemv=True)
    assert linear.gemv_weight is not None and linear.packed_weight is None  # no oneDNN copy
    gemv_calls.clear()
    assert torch.equal(linear(x), F.linear(x, weight, b))
    assert gemv_calls == [600]


@needs_onednn
@pytest.mark.parametrize("rows", [33, 100])
def test_with_amx_packed_linear_runs_more_than_32_rows_in_onednn(gemv_calls, amx, rows) -> None:
    amx(True)
    assert gemv.max_rows() == 32
    x, weight, b = make_case(rows, 130, 576, True)
    linear = PackedLinear(weight, b, use_gemv=True)
    assert linear.gemv_weight is not None and linear.packed_weight is not None
    gemv_calls.clear()
    assert torch.equal(linear(x[:32]), F.linear(x[:32], weight, b))
    assert gemv_calls == [32]
    gemv_calls.clear()
    out = linear(x)
    assert torch.equal(out, F.linear(x, weight, b))  # oneDNN's packed weight: nn.Linear's bits
    assert torch.equal(linear(x, out_dtype=torch.float32), out.float())
    assert gemv_calls == []


@needs_onednn
def test_gemv_off_keeps_no_gemv_copy(gemv_calls) -> None:
    x, weight, b = make_case(1, 130, 576, True)
    linear = PackedLinear(weight, b, use_gemv=False)
    assert linear.gemv_weight is None
    assert torch.equal(linear(x), F.linear(x, weight, b))
    assert gemv_calls == []


@needs_onednn
def test_packed_linear_keeps_no_gemv_copy_for_unsupported_columns(gemv_calls) -> None:
    x, weight, _ = make_case(1, 16, 39, False)
    linear = PackedLinear(weight, None, use_gemv=True)
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
    gemv._matching_k_block.cache_clear()
    try:
        x, weight, b = make_case(1, 130, 576, True)
        assert gemv.k_block_for(130, 576, True) is None
        linear = PackedLinear(weight, b, use_gemv=True)
        assert linear.gemv_weight is None
        gemv_calls.clear()  # the probing itself ran the kernel
        assert torch.equal(linear(x), F.linear(x, weight, b))
        assert gemv_calls == []
    finally:
        gemv._matching_k_block.cache_clear()


@pytest.mark.parametrize("fma", [False, True])
def test_the_engine_config_picks_the_inner_loop(tiny_llama, kernel_settings, fma) -> None:
    from quire import LLM

    LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=16, gemv_fma=fma)
    assert cpu_kernels.load_library().gemv_bf16_uses_fma() == fma

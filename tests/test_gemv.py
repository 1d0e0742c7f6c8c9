"""The GEMV kernel (bf16 x W^T + b for any number of rows) gives a row the same bits whatever the
batch, threads or row stride, in each of its orders: AVX-512 (passes of 8 rows per weight panel,
oneDNN's bits where oneDNN does not run on AMX tiles; the AVX2 kernel sums in the same order) and
AMX tiles (matmul_amx.c, on CPUs that have them); PackedLinear runs every row count in it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import use_amx_order

from quire.kernels import cpu as cpu_kernels
from quire.kernels.cpu import gemv
from quire.layers.linear import PackedLinear, onednn_runs_bf16

pytestmark = pytest.mark.skipif(
    not gemv.available(), reason="the GEMV kernel needs a C compiler and AVX-512 BF16 or AVX2"
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


@pytest.fixture(params=["avx512", "amx"])
def order(request, kernel_settings) -> str:
    """Each order the kernel sums in on this CPU, set as EngineConfig.cpu_amx sets it: "avx512"
    everywhere the kernel runs, "amx" where AMX tiles run too."""
    amx = request.param == "amx"
    use_amx_order(amx)
    assert gemv.uses_amx() == amx
    return request.param


@pytest.fixture
def amx_order(kernel_settings) -> None:
    """The kernel on AMX tiles, on CPUs that have them."""
    use_amx_order(True)


def onednn_order_reproducible() -> bool:
    """Whether the AVX-512 order reproduces torch's bf16 linear here: not where oneDNN runs on
    AMX tiles (hide them with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 to cover these tests there),
    nor where it has no bf16 at all (AVX2: test_each_output_sums_its_pairs_in_order covers it)."""
    return onednn_runs_bf16() and gemv._matching_k_block(256, 1536, False) is not None


@pytest.fixture
def onednn_order(kernel_settings) -> None:
    """The kernel in its AVX-512 order, where that order is oneDNN's."""
    cpu_kernels.configure(cpu_kernels.KernelSettings(enabled=True, gemv_fma=None, amx=False))
    if not onednn_order_reproducible():
        pytest.skip("oneDNN runs on AMX tiles here, or has no bf16: its bits are not the kernel's")


def pairs_in_order(x, weight, b, k_block) -> torch.Tensor:
    """The AVX-512 order in float32, one step at a time: per output, the odd then the even
    product of each column pair added to a sum restarted every k_block columns (each product of
    two bf16 is exact in float32, so a step is the FMA's one rounding), the blocks' sums added in
    order, then the bias, rounded once to bf16."""
    xf, wf = x.float(), weight.float()
    total = torch.zeros(x.shape[0], weight.shape[0])
    for k0 in range(0, x.shape[1], k_block):
        acc = torch.zeros_like(total)
        for k in range(k0, min(k0 + k_block, x.shape[1]), 2):
            acc = acc + xf[:, k + 1, None] * wf[:, k + 1]
            acc = acc + xf[:, k, None] * wf[:, k]
        total = acc if k0 == 0 else total + acc
    return (total if b is None else total + b.float()).bfloat16()


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
def test_gemv_gives_torch_bf16_linear_bits(out_features, in_features, bias, onednn_order) -> None:
    for rows in ROWS:
        x, weight, b = make_case(rows, out_features, in_features, bias, seed=rows)
        out = run(x, weight, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        # oneDNN sums a lone row of K > 1,024 in blocks of 512, and 2 rows or more in blocks of
        # 1,024 (the kernel's order at every row count): compare with oneDNN on 2 rows or more.
        expected = F.linear(x.repeat(2, 1), weight, b)[:rows]
        assert torch.equal(out, expected), (out != expected).sum()


@pytest.mark.parametrize("in_features", [32, 576, 1536, 3072])  # one, two and three blocks
@pytest.mark.parametrize("bias", [False, True])
def test_each_output_sums_its_pairs_in_order(in_features, bias, kernel_settings) -> None:
    """The AVX-512 loops and the AVX2 kernel take every sum in one order, written out here, so
    hosts with and without AVX-512 give the same bits (AMX tiles have their own order)."""
    cpu_kernels.configure(cpu_kernels.KernelSettings(enabled=True, gemv_fma=None, amx=False))
    for rows in (1, 2, 5, 9):
        x, weight, b = make_case(rows, 130, in_features, bias, seed=rows)
        k_block = gemv.k_block_for(130, in_features, bias)
        assert torch.equal(run(x, weight, b), pairs_in_order(x, weight, b, k_block)), rows


@pytest.mark.parametrize("out_features", [7, 130, 1000])
@pytest.mark.parametrize("in_features", [32, 64, 576, 1000, 1536, 3072])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_gives_the_product_within_a_bf16_rounding(
    out_features, in_features, bias, amx_order
) -> None:
    """On AMX tiles (a chain of tile products, then the last K % 32 columns by pairs): each
    output is the exact product rounded to bf16, or one of its two bf16 neighbours (up to the
    float32 sums' own rounding, where the products cancel)."""
    for rows in ROWS:
        x, weight, b = make_case(rows, out_features, in_features, bias, seed=rows)
        out = run(x, weight, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        ulp = 2.0 ** (torch.frexp(exact.abs().clamp_min(1e-30))[1] - 8)  # bf16's step there
        # float32 sums of a few hundred products: their rounding, far below a bf16 step
        float32_sums = 2.0**-20 * (x.double().abs() @ weight.double().abs().T)
        error = (out.double() - exact).abs()
        assert (error <= ulp + float32_sums).all(), (rows, (error - ulp - float32_sums).max())


def test_a_lone_row_of_more_than_1024_columns_is_summed_as_in_a_batch(onednn_order) -> None:
    # The case where oneDNN's lone-row order differs from its batch order in one output: the
    # kernel gives the batch order for the lone row too, so a row's bits never depend on the
    # batch (quire runs every row count in the kernel).
    _, weight, _ = make_case(1, 1000, 1536, False)
    x = torch.randn(1, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    batch = F.linear(x.repeat(2, 1), weight)[:1]
    assert not torch.equal(F.linear(x, weight), batch)  # oneDNN: lone row != row in a batch
    assert torch.equal(run(x, weight, None), batch)


@pytest.mark.parametrize("in_features", [576, 1536, 3072])
def test_the_probe_tells_block_sizes_apart(in_features, onednn_order) -> None:
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
def test_float32_output_is_the_bf16_output_widened(rows, bias, order) -> None:
    x, weight, b = make_case(rows, 130, 576, bias)
    out = run(x, weight, b, torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, run(x, weight, b).float())


@pytest.mark.parametrize("rows", [5, 13])  # one pass; two, the second starting at row 6
def test_strided_rows_give_the_contiguous_result(rows, order) -> None:
    x, weight, b = make_case(rows, 130, 576, True)
    expected = run(x, weight, b)
    wide = torch.zeros(rows, 576 + 96, dtype=torch.bfloat16)
    wide[:, 32 : 32 + 576] = x
    row_strided = wide[:, 32 : 32 + 576]  # row stride 672, offset start
    assert not row_strided.is_contiguous()
    assert torch.equal(run(row_strided, weight, b), expected)
    column_strided = x.t().contiguous().t()  # column stride `rows`
    assert torch.equal(run(column_strided, weight, b), expected)


@pytest.mark.parametrize("in_features", [1536, 1000])  # 1000: AMX's last 8 columns by pairs
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(order, in_features) -> None:
    # 70 rows: AVX-512's prefixes take one to nine passes (20 = 6 + 7 + 7, ...), AMX's one to
    # three groups of up to 32 rows on tiles of 1 to 16 rows, so a row's place in its pass or
    # tile, and the pass it is in, change with the batch.
    x, weight, b = make_case(70, 1000, in_features, True)  # enough outputs to catch a
    batch = run(x, weight, b)  # different summation order, which changes ~0.3% of them
    for i in range(70):
        assert torch.equal(run(x[i : i + 1], weight, b), batch[i : i + 1]), i
        assert torch.equal(run(x[: i + 1], weight, b), batch[: i + 1]), i


@pytest.mark.parametrize("rows", [6, 20])
def test_result_does_not_depend_on_the_thread_count(rows, order) -> None:
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


def test_both_inner_loops_give_the_same_bits(kernel_settings) -> None:
    """vdpbf16ps and its emulation by two FMAs (picked by a timing probe, forced here as
    EngineConfig.gemv_fma does) give the same bits, for a lone row as in a batch; where the
    AVX-512 order is oneDNN's, oneDNN's bits from two rows on."""
    if gemv.path() == "avx2-fma":
        pytest.skip("the AVX2 kernel has the FMA loop only")
    gen = torch.Generator().manual_seed(0)
    for k in (576, 1536, 3072):
        x = torch.randn(19, k, generator=gen).bfloat16()
        w = (torch.randn(130, k, generator=gen) / k**0.5).bfloat16()
        b = torch.randn(130, generator=gen).bfloat16()
        outs = []
        for fma in (False, True):
            cpu_kernels.configure(cpu_kernels.KernelSettings(enabled=True, gemv_fma=fma, amx=False))
            assert gemv.path() == ("avx512-fma" if fma else "avx512-bf16")
            k_block = gemv.k_block_for(130, k, True)
            outs.append(gemv.gemv(x, gemv.pack(w), b, 130, k_block))
            assert torch.equal(outs[-1][:1], gemv.gemv(x[:1], gemv.pack(w), b, 130, k_block))
        assert torch.equal(outs[0], outs[1]), k
        if onednn_order_reproducible():
            assert torch.equal(outs[0][1:], F.linear(x[1:], w, b)), k


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
    not onednn_runs_bf16(), reason="torch's oneDNN does not run bf16 on this CPU"
)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_runs_every_row_count_in_the_gemv_kernel(gemv_calls, order, bias) -> None:
    x, weight, b = make_case(600, 130, 576, bias)
    linear = PackedLinear(weight, b, use_gemv=True)
    assert linear.gemv_weight is not None and linear.packed_weight is None  # no oneDNN copy
    for rows in [*ROWS, 600]:
        gemv_calls.clear()
        out = linear(x[:rows])
        assert gemv_calls == [rows]
        assert torch.equal(out, run(x[:rows], weight, b))
        widened = linear(x[:rows], out_dtype=torch.float32)
        assert widened.dtype == torch.float32 and torch.equal(widened, out.float())
    gemv_calls.clear()
    out = linear(x[:24].view(2, 3, 4, 576))  # leading dimensions flattened: 24 rows
    assert gemv_calls == [24] and torch.equal(out, linear(x[:24]).view(2, 3, 4, 130))


@needs_onednn
def test_packed_linear_gives_torch_bf16_linear_bits_in_onednns_order(onednn_order) -> None:
    x, weight, b = make_case(100, 130, 576, True)
    linear = PackedLinear(weight, b, use_gemv=True)
    for rows in ROWS:
        assert torch.equal(linear(x[:rows]), F.linear(x[:rows], weight, b)), rows


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
def test_own_order_when_no_block_size_gives_onednns_bits(
    gemv_calls, monkeypatch, kernel_settings
) -> None:
    # A oneDNN that sums some other way (oneDNN on AMX tiles while the kernel keeps to AVX-512,
    # another version): the kernel keeps oneDNN's usual block and runs every row count, so a
    # request's tokens do not depend on the batch its steps ran in.
    def other_sums(x, weight, bias):
        return F.linear(
            x.float(), weight.float(), None if bias is None else bias.float()
        ).bfloat16()

    cpu_kernels.configure(cpu_kernels.KernelSettings(enabled=True, gemv_fma=None, amx=False))
    monkeypatch.setattr(gemv, "_onednn_linear", other_sums)
    gemv._matching_k_block.cache_clear()
    try:
        x, weight, b = make_case(40, 130, 1536, True)
        assert gemv.k_block_for(130, 1536, True) == 1024
        linear = PackedLinear(weight, b, use_gemv=True)
        assert linear.gemv_weight is not None and linear.packed_weight is None
        gemv_calls.clear()  # the probing itself ran the kernel
        batch = linear(x)
        assert torch.equal(linear(x[:1]), batch[:1])
        assert gemv_calls == [40, 1]
    finally:
        gemv._matching_k_block.cache_clear()


@pytest.mark.parametrize("fma", [False, True])
def test_the_engine_config_picks_the_inner_loop(tiny_llama, kernel_settings, fma) -> None:
    from quire import LLM

    LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=16, gemv_fma=fma)
    avx2 = gemv.path() == "avx2-fma"  # the FMA loop only
    assert cpu_kernels.load_library().gemv_bf16_uses_fma() == (fma or avx2)


@pytest.mark.parametrize("cpu_amx", [False, True])
def test_the_engine_config_picks_amx_where_it_runs(tiny_llama, kernel_settings, cpu_amx) -> None:
    from quire import LLM

    LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=16, cpu_amx=cpu_amx)
    assert gemv.uses_amx() == (cpu_amx and gemv.amx_available())
    expected = {"amx"} if gemv.uses_amx() else {"avx512-fma", "avx512-bf16", "avx2-fma"}
    assert gemv.path() in expected

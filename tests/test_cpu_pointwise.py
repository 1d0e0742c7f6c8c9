"""The C add + RMSNorm, rotary and SiLU-and-mul kernels give the same bits as Hugging Face's bf16
modules, and the C argmax the same indices as torch.argmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (
    apply_rotary_pos_emb as hf_apply_rotary_pos_emb,
)

from quire.kernels.cpu import pointwise
from quire.layers.activation import silu_and_mul
from quire.layers.norm import RMSNorm
from quire.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(
    not pointwise.supported(torch.empty(0, dtype=torch.bfloat16)), reason="no C compiler"
)


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for float32 summation order in the mean square: a last-bit difference at most in
    the normalized value, which is rounded to bf16 before the weight multiplies it, so up to two
    of the output's (an AMD EPYC Zen 1 here: 5 of 18,432 values, each a rounding tie of x * rstd,
    whose rstd's last float32 bit differs from torch's)."""
    torch.testing.assert_close(actual, expected, rtol=2**-6, atol=1e-6)
    assert (actual != expected).float().mean().item() < 0.01


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("rows", [1, 5, 31, 32, 200])  # 32+ rows run on all threads
@pytest.mark.parametrize("dim", [64, 576, 1000])
def test_add_rms_norm_matches_hugging_face(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=gen).bfloat16()
    residual = torch.randn(rows, dim, generator=gen).bfloat16()
    weight = torch.randn(dim, generator=gen).bfloat16()
    expected_sum = residual + x
    updated = residual.clone()
    out = pointwise.add_rms_norm(x, updated, weight, 1e-6)
    assert torch.equal(updated, expected_sum)
    assert_within_one_ulp(out, hf_rms_norm(expected_sum, weight, 1e-6))
    assert_within_one_ulp(
        pointwise.add_rms_norm(x, None, weight, 1e-6), hf_rms_norm(x, weight, 1e-6)
    )


def test_norm_reads_strided_rows() -> None:
    x = torch.randn(7, 2, 64).bfloat16()[:, 1]  # row stride 128
    weight = torch.ones(64, dtype=torch.bfloat16)
    assert torch.equal(pointwise.add_rms_norm(x, None, weight, 1e-5), hf_rms_norm(x, weight, 1e-5))


def test_rms_norm_module_gives_the_same_result_in_both_paths() -> None:
    norm = RMSNorm(96, 1e-5).bfloat16()
    norm.weight.data.normal_()
    x, residual = torch.randn(2, 9, 96).bfloat16().unbind(0)
    out, summed = norm(x, residual.clone())  # the C kernel (2-D, contiguous residual)
    with torch.no_grad():
        ref_out, ref_sum = norm(x[None], residual[None])  # 3-D: the torch path
    assert torch.equal(summed, ref_sum[0])
    # torch's kernel rounds once where Hugging Face (and the C kernel) round before the weight.
    torch.testing.assert_close(out, ref_out[0], rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_in_place_on_a_qkv_view_matches_hugging_face(tokens: int, head_dim: int) -> None:
    """9 query and 3 key heads rotated in place by the C kernel, as transformers' Llama rotary
    (`apply_rotary_pos_emb`, bf16) rotates them; quire's torch path gives the same bits."""
    gen = torch.Generator().manual_seed(tokens + head_dim)
    qkv = torch.randn(tokens, 9 + 2 * 3, head_dim, generator=gen).bfloat16()
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 100
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()  # [tokens, 1, head_dim]
    qk = qkv[:, :12]  # queries and keys, V untouched
    hf_q, hf_k = hf_apply_rotary_pos_emb(qk[:, :9], qk[:, 9:], cos[:, 0], sin[:, 0])
    expected = torch.cat([hf_q, hf_k], dim=1)
    assert torch.equal(apply_rotary(qk, cos, sin), expected)
    v_before = qkv[:, 12:].clone()
    assert pointwise.rotary_supported(qk)
    pointwise.rotary_(qk, cos, sin)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, 12:], v_before)


def test_only_packed_heads_are_rotated_in_place() -> None:
    x = torch.randn(4, 6, 32).bfloat16()
    assert not pointwise.rotary_supported(x[:, ::2])
    assert not pointwise.rotary_supported(x.float())


def test_per_head_norm_of_a_strided_qkv_view_matches_hugging_face() -> None:
    """Qwen3's q/k norm: RMSNorm over head_dim of a [tokens, heads, head_dim] view into qkv."""
    norm = RMSNorm(32, 1e-6).bfloat16()
    norm.weight.data.normal_()
    qkv = torch.randn(5, 10, 32).bfloat16()
    q = qkv[:, :6]
    with torch.no_grad():
        out = norm(q)
    assert out.shape == q.shape
    assert_within_one_ulp(out, hf_rms_norm(q, norm.weight.detach(), 1e-6))


@pytest.mark.parametrize("rows", [1, 3, 4, 37])  # 4+ rows run on all threads
@pytest.mark.parametrize("d", [64, 1536, 1000])
def test_silu_and_mul_is_torch_bit_for_bit(rows: int, d: int) -> None:
    gen = torch.Generator().manual_seed(rows * d)
    gate_up = (torch.randn(rows, 2 * d, generator=gen) * 8).bfloat16()
    # Every kind of value the table must hold: zeros, subnormals, huge, infinities and NaN.
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, float("inf"), -float("inf")])
    gate_up[0, : len(special)] = special.bfloat16()
    gate_up[0, d : d + len(special)] = special.flip(0).bfloat16()
    gate_up[-1, 0] = float("nan")
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = silu_and_mul(gate_up)
    assert out.shape == (rows, d) and out.dtype == torch.bfloat16
    nan = expected.isnan()  # 0 * inf and the NaN row: NaN either way, payloads aside
    assert nan.sum() >= 4 and torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


def test_silu_and_mul_falls_back_to_torch_off_the_kernel() -> None:
    gate_up = torch.randn(2, 3, 8)  # float32, 3-d: torch's ops
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("cols", [1, 15, 16, 17, 49152])
def test_argmax_is_torch_argmax(rows: int, cols: int) -> None:
    """Values, ties (the first maximum wins), NaNs (the first NaN wins, wherever it is), and
    rows of -inf or inf only."""
    gen = torch.Generator().manual_seed(rows * cols)
    cases = [
        torch.randn(rows, cols, generator=gen),
        torch.randint(0, 3, (rows, cols), generator=gen).float(),
        torch.full((rows, cols), float("-inf")),
        torch.full((rows, cols), float("inf")),
    ]
    with_nans = torch.randn(rows, cols, generator=gen)
    with_nans.view(-1)[torch.randint(0, rows * cols, (rows,), generator=gen)] = float("nan")
    with_nans[-1, -1] = float("nan")  # in the scalar tail of the vector loop
    cases.append(with_nans)
    for x in cases:
        assert torch.equal(pointwise.argmax(x), x.argmax(dim=-1))


def test_argmax_of_a_strided_or_bf16_tensor_is_torch_argmax() -> None:
    x = torch.randn(4, 100)
    assert torch.equal(pointwise.argmax(x[:, ::2]), x[:, ::2].argmax(dim=-1))
    assert torch.equal(pointwise.argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 64])  # SiLU computed (decode), SiLU from the table (prefill)
def test_silu_and_mul_is_torch_bit_for_bit_on_every_gate_value(rows: int) -> None:
    """All 65536 bf16 gate patterns (NaNs, infinities, subnormals, the overflow of exp(-g) below
    -88, values whose SiLU lies next to a bf16 rounding tie), each against two values of up."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for up in (torch.ones_like(every), (torch.randn(every.numel(), generator=gen) * 50).bfloat16()):
        gate_up = torch.cat([every, up]).view(1, -1).expand(rows, -1).contiguous()
        out = pointwise.silu_and_mul(gate_up)[-1]
        expected = F.silu(every) * up
        same = (out.view(torch.int16) == expected.view(torch.int16)) | (
            out.isnan() & expected.isnan()
        )
        assert same.all(), every[~same][:8]

"""The GPU's fused pointwise kernels (quire/kernels/pointwise.py) against the PyTorch ops they
replace: residual add + RMSNorm, q/k RMSNorm + rotary in the qkv buffer, SiLU-and-mul.

Without CUDA they run in Triton's interpreter on small shapes (conftest.py sets TRITON_INTERPRET);
the tests marked `gpu` run the benchmark model's shapes in bf16, the modules' dispatch to them
(inside `fused_pointwise()`, as CUDA graphs capture them), and a Qwen3 model's greedy tokens on
the GPU, graphs and eager steps, against the CPU's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from quire import LLM, SamplingParams  # noqa: E402
from quire.kernels import fused_pointwise, gpu_pointwise, pointwise  # noqa: E402
from quire.layers.rotary import apply_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(pointwise._add_rms_norm_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "quire.kernels was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
EPS = 1e-6
# Triton's interpreter truncates float32 to bf16 where a GPU rounds to nearest even: one ulp.
ROUNDING_ULPS = 0 if DEVICE == "cuda" else 1


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in units of b's last place (bf16: 8 bits)."""
    ulp = torch.finfo(b.dtype).eps * b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return int(((a.float() - b.float()).abs() / ulp).ceil().max())


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)


def reference_add_rms_norm(x, residual, weight):
    summed = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    normed = F.rms_norm(summed.float(), weight.shape, weight.float(), EPS)
    return normed.to(x.dtype), summed


def reference_qk_norm_rotary(qk, num_q_heads, cos, sin, q_weight, k_weight, k_eps=EPS):
    if q_weight is not None:
        q, k = qk.split([num_q_heads, qk.shape[1] - num_q_heads], dim=1)
        qk = torch.cat(
            [
                F.rms_norm(q, q_weight.shape, q_weight, EPS),
                F.rms_norm(k, k_weight.shape, k_weight, k_eps),
            ],
            dim=1,
        )
    return apply_rotary(qk, cos, sin)


def assert_rotated_close(rotated: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16: the module rounds x cos, rotated x sin and their sum apart, the kernel once. Near a
    cancellation an ulp of the products is many ulps of the sum, so the bound is two ulps of
    the larger of the two, per element."""
    products = expected.float().abs() + rotated.float().abs().amax(dim=-1, keepdim=True)
    bound = 2 * torch.finfo(torch.bfloat16).eps * products
    assert ((rotated.float() - expected.float()).abs() <= bound).all()


def rotary_tables(tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    positions = torch.arange(tokens, dtype=torch.float32) * 7 + 3
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [tokens, 1, head_dim]
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


# ---- residual add + RMSNorm -------------------------------------------------------------------


@pytest.mark.parametrize("dim", [64, 80])
def test_add_rms_norm_equals_torch_and_writes_the_sum_into_the_residual(dim):
    x, residual, weight = randn(5, dim), randn(5, dim, seed=1), randn(dim, seed=2)
    expected, expected_sum = reference_add_rms_norm(x, residual, weight)
    out = pointwise.add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(residual, expected_sum)


def test_add_rms_norm_without_a_residual_is_rms_norm():
    x, weight = randn(3, 64), randn(64, seed=2)
    torch.testing.assert_close(
        pointwise.add_rms_norm(x, None, weight, EPS),
        reference_add_rms_norm(x, None, weight)[0],
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_reads_rows_of_a_strided_input(with_residual):
    wide, weight = randn(4, 96), randn(64, seed=2)
    x = wide[:, :64]  # rows 96 apart; the residual and the output are packed
    residual = randn(4, 64, seed=1) if with_residual else None
    expected, expected_sum = reference_add_rms_norm(x.contiguous(), residual, weight)
    out = pointwise.add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if with_residual:
        assert torch.equal(residual, expected_sum)


def test_add_rms_norm_in_bf16_rounds_the_sum_as_torch_and_its_output_within_an_ulp():
    x, residual = randn(6, 64, dtype=torch.bfloat16), randn(6, 64, dtype=torch.bfloat16, seed=1)
    weight = randn(64, dtype=torch.bfloat16, seed=2)
    expected, expected_sum = reference_add_rms_norm(x, residual, weight)
    out = pointwise.add_rms_norm(x, residual, weight, EPS)
    assert ulps_apart(residual, expected_sum) <= ROUNDING_ULPS
    assert ulps_apart(out, expected) <= 1 + ROUNDING_ULPS


def test_add_rms_norm_in_fp16_is_within_an_ulp_of_torch():
    x, residual = randn(6, 80, dtype=torch.float16), randn(6, 80, dtype=torch.float16, seed=1)
    weight = randn(80, dtype=torch.float16, seed=2)
    expected, expected_sum = reference_add_rms_norm(x, residual, weight)
    out = pointwise.add_rms_norm(x, residual, weight, EPS)
    assert ulps_apart(residual, expected_sum) <= 1 and ulps_apart(out, expected) <= 1


def test_a_row_normed_alone_has_the_bits_it_has_in_a_batch():
    x, weight = randn(7, 64, dtype=torch.bfloat16), randn(64, dtype=torch.bfloat16, seed=2)
    batch = pointwise.add_rms_norm(x, None, weight, EPS)
    assert torch.equal(pointwise.add_rms_norm(x[3:4], None, weight, EPS), batch[3:4])


# ---- q/k RMSNorm + rotary ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, qk_norm",
    [(6, 2, 16, True), (4, 2, 32, False), (3, 1, 80, True)],
)
def test_qk_norm_rotary_equals_the_modules_ops_and_leaves_v_alone(
    num_q_heads, num_kv_heads, head_dim, qk_norm
):
    tokens = 5
    qkv = randn(tokens, num_q_heads + 2 * num_kv_heads, head_dim)
    v_before = qkv[:, num_q_heads + num_kv_heads :].clone()
    qk = qkv[:, : num_q_heads + num_kv_heads]
    cos, sin = rotary_tables(tokens, head_dim, torch.float32)
    weights = (randn(head_dim, seed=3), randn(head_dim, seed=4)) if qk_norm else (None, None)
    k_eps = 0.5  # not the queries' eps, large enough to show which one a head takes
    expected = reference_qk_norm_rotary(qk.clone(), num_q_heads, cos, sin, *weights, k_eps)
    pointwise.qk_norm_rotary_(qk, num_q_heads, cos, sin, *weights, EPS, k_eps)
    torch.testing.assert_close(qk, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, num_q_heads + num_kv_heads :], v_before)


def check_bf16_qk_norm_rotary(tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int):
    qk = randn(tokens, num_q_heads + num_kv_heads, head_dim, dtype=torch.bfloat16)
    cos, sin = rotary_tables(tokens, head_dim, torch.bfloat16)
    weights = (
        randn(head_dim, dtype=torch.bfloat16, seed=3),
        randn(head_dim, dtype=torch.bfloat16, seed=4),
    )
    expected = reference_qk_norm_rotary(qk.clone(), num_q_heads, cos, sin, *weights)
    pointwise.qk_norm_rotary_(qk, num_q_heads, cos, sin, *weights, EPS, EPS)
    assert_rotated_close(qk, expected)


def test_qk_norm_rotary_in_bf16_is_within_two_ulps_of_the_modules_step_by_step_rounding():
    check_bf16_qk_norm_rotary(tokens=4, num_q_heads=4, num_kv_heads=2, head_dim=32)


# ---- SiLU-and-mul ----------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [48, 1500])  # 1500: two column tiles of 1024
@pytest.mark.parametrize("strided", [False, True])
def test_silu_and_mul_equals_torch(dim, strided):
    gate_up = randn(3, 2 * dim + 16)[:, : 2 * dim] if strided else randn(3, 2 * dim)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        pointwise.silu_and_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5
    )


# ---- on a GPU: the model's shapes, the modules' dispatch, a model's tokens -------------------


@pytest.mark.gpu
@requires_cuda
def test_benchmark_model_shapes_in_bf16_agree_with_torch():
    tokens, hidden, num_q_heads, num_kv_heads, head_dim = 300, 1024, 16, 8, 128
    x, residual = (
        randn(tokens, hidden, dtype=torch.bfloat16),
        randn(tokens, hidden, dtype=torch.bfloat16, seed=1),
    )
    weight = randn(hidden, dtype=torch.bfloat16, seed=2)
    expected, _ = reference_add_rms_norm(x, residual.clone(), weight)
    assert ulps_apart(pointwise.add_rms_norm(x, residual, weight, EPS), expected) <= 1

    check_bf16_qk_norm_rotary(tokens, num_q_heads, num_kv_heads, head_dim)

    gate_up = randn(tokens, 6144, dtype=torch.bfloat16, seed=5)
    gate, up = gate_up.chunk(2, dim=-1)
    assert ulps_apart(pointwise.silu_and_mul(gate_up), F.silu(gate) * up) <= 1


def test_the_fused_kernels_are_for_cuda_tensors_inside_fused_pointwise_only():
    x = torch.zeros(2, 64)
    with fused_pointwise():
        assert gpu_pointwise(x) is None  # a CPU tensor
    if torch.cuda.is_available():
        assert gpu_pointwise(x.cuda()) is None
        with fused_pointwise():
            assert gpu_pointwise(x.cuda()) is pointwise


@pytest.mark.gpu
@requires_cuda
def test_the_modules_run_the_fused_kernels_inside_fused_pointwise():
    from quire.layers.activation import silu_and_mul
    from quire.layers.norm import RMSNorm

    norm = RMSNorm(64, EPS).to(DEVICE, torch.bfloat16)
    x, residual = randn(4, 64, dtype=torch.bfloat16), randn(4, 64, dtype=torch.bfloat16, seed=1)
    gate_up = randn(4, 96, dtype=torch.bfloat16)
    fused = pointwise.add_rms_norm(x, residual.clone(), norm.weight, EPS)
    with fused_pointwise():
        out, summed = norm(x, residual)
        activation = silu_and_mul(gate_up)
    assert torch.equal(out, fused) and summed is residual
    assert torch.equal(activation, pointwise.silu_and_mul(gate_up))


@pytest.mark.gpu
@requires_cuda
def test_a_qwen3_model_on_the_gpu_gives_the_cpu_greedy_tokens(tiny_models):
    prompts = [[5 + 3 * i + j for j in range(n)] for i, n in enumerate((3, 19, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)

    def tokens(device: str) -> list[list[int]]:
        llm = LLM(tiny_models["qwen3"], dtype="float32", device=device, num_kv_blocks=64)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert tokens("cuda") == tokens("cpu")

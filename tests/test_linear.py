"""Pre-packed oneDNN linear layers (and the GEMV kernel PackedLinear runs for a few rows) give the
same bits as nn.Linear, and the engine's bf16 outputs do not change when its weights are packed,
the decode steps then running one C call per layer."""

from __future__ import annotations

import pytest
import torch
from conftest import load_model_alone, make_llm
from torch import nn

from quire import SamplingParams
from quire.kernels.cpu import gemv
from quire.layers import linear as linear_module
from quire.layers.linear import (
    PackedLinear,
    onednn_runs_bf16,
    pack_linear_layers,
    packed_linear_supported,
)

pytestmark = pytest.mark.skipif(
    not packed_linear_supported("cpu", torch.bfloat16),
    reason="neither torch's oneDNN nor the GEMV kernel runs bf16 on this CPU",
)
# On an AVX2-only CPU torch's own bf16 matmul sums in another order than the GEMV kernel.
needs_onednn = pytest.mark.skipif(
    not onednn_runs_bf16(), reason="torch's oneDNN does not run bf16 on this CPU"
)


@needs_onednn
@pytest.mark.parametrize("num_rows", [1, 3, 16, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_nn_linear_bit_for_bit(num_rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(num_rows, 96, dtype=torch.bfloat16)
    packed = PackedLinear.from_linear(linear, use_gemv=True)
    assert torch.equal(packed(x), linear(x))
    assert torch.equal(packed(x.view(1, num_rows, 96)), linear(x).view(1, num_rows, 200))


def test_packing_replaces_every_linear_in_the_tree() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4)))
    assert pack_linear_layers(model.to(torch.bfloat16), use_gemv=True) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][1], PackedLinear)


def test_without_onednn_bf16_only_the_gemv_kernels_weights_are_packed(monkeypatch) -> None:
    """On an AVX2-only CPU oneDNN has no bf16: a weight the GEMV kernel does not take (odd
    columns) stays an nn.Linear, the rest are packed for the kernel."""
    monkeypatch.setattr(linear_module, "onednn_runs_bf16", lambda: False)
    model = nn.Sequential(nn.Linear(7, 8), nn.Linear(8, 8)).to(torch.bfloat16)
    x = torch.randn(3, 7, dtype=torch.bfloat16)
    expected = model(x)
    assert pack_linear_layers(model, use_gemv=gemv.available()) == int(gemv.available())
    assert type(model[0]) is nn.Linear
    assert isinstance(model[1], PackedLinear) == gemv.available()
    torch.testing.assert_close(model(x), expected, rtol=0.02, atol=0.02)


def test_only_bfloat16_on_cpu_is_packed() -> None:
    assert not packed_linear_supported("cpu", torch.float32)
    assert not packed_linear_supported("meta", torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied LM head
def test_packed_engine_outputs_equal_unpacked(tiny_models, arch) -> None:
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(40, 90))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = {}
    for pack in (True, False):
        model = load_model_alone(tiny_models[arch], dtype="bfloat16", pack_weights=pack)
        packed = any(isinstance(m, PackedLinear) for m in model.modules())
        assert packed == pack
        assert not pack or not any(isinstance(m, nn.Linear) for m in model.modules())
        llm = make_llm(tiny_models[arch], dtype="bfloat16", pack_weights=pack)
        assert llm.stats().c_decode_step == (pack and gemv.available())
        results[pack] = [
            (out.outputs[0].token_ids, out.outputs[0].cumulative_logprob)
            for out in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            )
        ]
    if onednn_runs_bf16():  # the kernel sums as oneDNN does
        assert results[True] == results[False]
        return
    # AVX2: torch's own bf16 matmul sums in another order; tokens equal, logprobs close.
    for (tokens, logprob), (tokens_unpacked, logprob_unpacked) in zip(*results.values()):
        assert tokens == tokens_unpacked
        assert logprob == pytest.approx(logprob_unpacked, rel=1e-3)

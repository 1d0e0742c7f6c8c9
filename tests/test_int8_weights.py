"""`--quantization int8` on Hugging Face checkpoints: each matrix quantized at load to symmetric
int8 per output channel in blocks of 32 (GGUF's Q8_0, as the gguf package quantizes it), run by
the int8 kernel. Against a float64 reference; end to end on tiny random Llama and Qwen3 against
the same checkpoint in bf16 (greedy tokens and perplexity); batch invariance; the C decode step;
validation of the option."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import in_process_model, make_llm, token_prompts
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from test_cpu_decode import check_each_fused_step
from test_qmatmul import assert_within_bound, reference
from test_tensor_parallel import assert_close_greedy

from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.kernels.cpu import qmatmul
from quire.layers.linear import packed_linear_supported
from quire.layers.quantized_linear import QuantizedLinear, QuantizedWeight

needs_kernels = pytest.mark.skipif(
    not (qmatmul.available() and packed_linear_supported("cpu", torch.bfloat16)),
    reason="needs the C kernels and bf16 on CPU",
)


def test_weights_quantize_as_ggufs_q8_0() -> None:
    # more rows than one slice of the quantizer (4,096)
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(4099, 96, generator=gen) * 0.05).bfloat16()
    weight[3, :32] = 0  # an all-zero block: scale 0, codes 0
    weight[4097, 5] = 1.0  # an outlier: its block's scale, 127 its code
    got = QuantizedWeight.from_float(weight)
    want = quantize(weight.float().numpy(), GGMLQuantizationType.Q8_0)
    assert got.qtype == "Q8_0" and got.shape == (4099, 96)
    assert np.array_equal(got.raw, want)


def test_read_only_q8_0_blocks_dequantize_without_a_warning() -> None:
    """A GGUF file's blocks come as a read-only memory map (`--quantization none` dequantizes
    them at load); torch must not warn that it was handed a read-only array."""
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    blocks = QuantizedWeight.from_float(weight)
    raw = blocks.raw.copy()
    raw.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = QuantizedWeight(raw, "Q8_0", blocks.shape).dequantize()
    assert torch.equal(got, blocks.dequantize())
    assert (got - weight).abs().max().item() <= weight.abs().max().item() / 127


@needs_kernels
@pytest.mark.parametrize("out_features, in_features", [(7, 32), (33, 96), (100, 1056)])
def test_int8_linear_matches_a_float64_reference(out_features, in_features) -> None:
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    quantized = QuantizedWeight.from_float(weight)
    linear = QuantizedLinear(quantized, bias)
    for rows in (1, 3, 5, 17):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        out = linear(x, out_dtype=torch.float32)
        assert_within_bound(out, *reference(x, quantized.dequantize().double().numpy(), bias))


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
PROMPTS = token_prompts([5, 40, 23])
# The logits of these models are a few units; int8 weights and activations (each within half a
# step of 1/127 of its block's largest) move each by up to ~0.1.
TIE_GAP = 0.2
LOGPROB_ATOL = 0.2


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    logprobs = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], token_ids[1:], strict=True)]
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def tiny_bf16(build_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("int8")
    return {
        arch: build_model(str(root / arch), arch, dtype=torch.bfloat16)
        for arch in ("llama", "qwen3")
    }


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_int8_stays_close_to_bf16(tiny_bf16, arch) -> None:
    small = dict(dtype="bfloat16", num_kv_blocks=64)
    int8 = LLM(tiny_bf16[arch], quantization="int8", **small)
    layers = [m for m in in_process_model(int8).model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.qtype for m in layers} == {"Q8_0"}
    assert len(layers) == 4 * len(in_process_model(int8).model.layers) + 1  # and the LM head
    assert int8.stats().c_decode_step
    text = PROMPTS[1]["prompt_token_ids"] + PROMPTS[2]["prompt_token_ids"]
    got, got_ppl = [o.outputs[0] for o in int8.generate(PROMPTS, GREEDY)], perplexity(int8, text)
    del int8
    bf16 = LLM(tiny_bf16[arch], quantization="none", **small)
    assert not any(isinstance(m, QuantizedLinear) for m in in_process_model(bf16).model.modules())
    want, want_ppl = [o.outputs[0] for o in bf16.generate(PROMPTS, GREEDY)], perplexity(bf16, text)
    assert_close_greedy(want, got, TIE_GAP, LOGPROB_ATOL)
    assert abs(got_ppl / want_ppl - 1) < 0.01, (got_ppl, want_ppl)


@needs_kernels
def test_c_decode_steps_equal_the_module_path(tiny_bf16, monkeypatch) -> None:
    llm = make_llm(tiny_bf16["qwen3"], quantization="int8", dtype="bfloat16")
    steps = check_each_fused_step(in_process_model(llm), monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6] * 3
    assert steps == [3] * 5


@needs_kernels
def test_a_request_has_its_bits_alone_and_beside_a_prefill(tiny_bf16) -> None:
    llm = LLM(
        tiny_bf16["llama"],
        quantization="int8",
        dtype="bfloat16",
        num_kv_blocks=128,
        enable_prefix_caching=False,
        max_num_batched_tokens=32,  # the long prompt is chunked beside the decodes
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = token_prompts([7, 90, 33])

    def tokens_and_logprobs(batch):
        return [
            (
                o.outputs[0].token_ids,
                [next(iter(d.values())).logprob for d in o.outputs[0].logprobs],
            )
            for o in llm.generate(batch, params, use_tqdm=False)
        ]

    alone = [tokens_and_logprobs([p])[0] for p in prompts]
    assert tokens_and_logprobs(prompts) == alone


def test_int8_on_a_gguf_file_is_refused(default_model) -> None:
    with pytest.raises(ValueError, match="quantization int8 .* GGUF file .* auto .* none"):
        EngineConfig(model=default_model, quantization="int8")


def test_int8_in_float32_is_refused(tiny_models) -> None:
    with pytest.raises(ValueError, match="int8 runs bf16 on CPU, not torch.float32 .* bfloat16"):
        LLM(tiny_models["llama"], quantization="int8", dtype="float32")

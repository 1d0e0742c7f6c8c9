"""GGUF weights kept in their blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) end to end: SmolLM2's
real weights (the default Q4_1 file, and re-quantized to Q8_0, Q4_0 and llama.cpp's Q4_K_M mix)
give a perplexity within 1% of the same file dequantized to float32, and each token's logprob
close to it; the C decode step gives the
module path's bits, a q|k|v of two types included; a request's bits do not depend on the batch,
its chunking or prefix hits; other types are dequantized."""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import pytest
from conftest import greedy, in_process_model, make_adapter, make_llm, token_prompts
from test_cpu_decode import check_each_fused_step

from quire import LLM, SamplingParams
from quire.bench import gguf_files
from quire.bench.models import CACHE_DIR
from quire.bench.perplexity import PROSE
from quire.kernels.cpu import qmatmul
from quire.layers.linear import packed_linear_supported
from quire.layers.quantized_linear import QuantizedLinear
from quire.lora import LoRARequest

pytestmark = pytest.mark.skipif(
    not (qmatmul.available() and packed_linear_supported("cpu", __import__("torch").bfloat16)),
    reason="needs the C kernels and bf16 on CPU",
)

# Files written once per machine, next to the benchmark models.
FILES_DIR = os.path.join(CACHE_DIR, "test-gguf")


def smollm2_file(default_model: str, qtype: str) -> str:
    if qtype == "Q4_1":
        return default_model
    os.makedirs(FILES_DIR, exist_ok=True)
    return gguf_files.requantize(
        default_model, os.path.join(FILES_DIR, f"smollm2-{qtype}.gguf"), qtype
    )


# PROSE and three more paragraphs: ~600 tokens, where the bf16 model's own perplexity moves
# 0.1-0.3% from float32's (on PROSE alone, ~200 tokens, 0.4-0.7%).
SCORED = PROSE + (
    " The oldest building in the town is the church, which was begun in the twelfth century and "
    "finished almost three hundred years later, so that its nave and its tower belong to different "
    "ages. Inside, the walls were once covered with paintings of saints and harvests; most of them "
    "were whitewashed during the Reformation and uncovered again in the nineteen-sixties, when a "
    "restorer noticed a painted hand beneath a crack in the plaster. The work took eleven years. "
    "Now the paintings are lit at night, and the church is one of the few places in the region "
    "where visitors queue on a weekday morning."
    " Beyond the church, a narrow street climbs towards the old town wall. Only two of its gates "
    "survive, and the northern one houses a small museum of local history. Its rooms are crowded "
    "with objects that families gave away when they moved or cleared an attic: a baker's scales, "
    "a school desk with an inkwell, a wedding dress from eighteen ninety, photographs of floods "
    "and frozen winters, and a model of the bridge that stood before the present one. The museum "
    "is run by volunteers, most of them retired teachers, who are happy to explain each object "
    "and will often add a story about the person who owned it."
    " The rivers still shape the life of the town, even if no barges stop at the quay. Every few "
    "years a spring flood covers the meadows to the south, and the lower streets are closed while "
    "the water rises and falls. The flood brings fresh soil to the fields, and the farmers say "
    "that the best asparagus grows where the water stood longest. In summer, children swim at a "
    "beach of pebbles below the bridge, anglers sit on the banks from dawn, and in the evening "
    "the cafes along the promenade put their tables out under the lime trees. When the light "
    "fades, swallows fly low over the water, and the bells of the church ring the hour across "
    "both rivers."
)


def prompt_logprobs(llm: LLM, token_ids: list[int]) -> np.ndarray:
    """The logprob of each token after the first, given the ones before it."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    return np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], token_ids[1:])])


def linear_types(llm: LLM) -> set[str]:
    model = in_process_model(llm).model
    return {m.qtype for m in model.modules() if isinstance(m, QuantizedLinear)}


@pytest.mark.parametrize(
    ("qtype", "types"),
    [
        ("Q4_1", {"Q4_1", "Q8_0"}),  # the default file's embedding (and tied LM head) is Q8_0
        ("Q8_0", {"Q8_0"}),
        ("Q4_0", {"Q4_0"}),
        # the down projections (K = 1,536) in Q4_K and Q6_K; the other matrices' K = 576 is not
        # whole super-blocks of 256, so they fall back to Q8_0, as llama.cpp falls back
        ("Q4_K_M", {"Q4_K", "Q6_K", "Q8_0"}),
    ],
)
def test_perplexity_is_within_one_percent_of_the_dequantized_file(
    default_model, tokenizer_dir, qtype, types
) -> None:
    """Prompt rows take bf16 numerics on AMX hosts (qmatmul.prompt_path) and int8 sums on others:
    both within 1% in perplexity, and within 0.1 of each token's float32 logprob on average
    (measured on an Intel Xeon with AMX: 0.041-0.050 bf16, 0.061-0.070 int8)."""
    path = smollm2_file(default_model, qtype)
    quantized = LLM(path, tokenizer=tokenizer_dir, num_kv_blocks=48, enable_prefix_caching=False)
    token_ids = quantized.get_tokenizer()(SCORED)["input_ids"]
    assert linear_types(quantized) == types
    assert quantized.stats().c_decode_step
    logprobs = prompt_logprobs(quantized, token_ids)
    del quantized
    reference = LLM(
        path,
        tokenizer=tokenizer_dir,
        num_kv_blocks=48,
        quantization="none",
        dtype="float32",
        enable_prefix_caching=False,
    )
    assert linear_types(reference) == set()
    expected = prompt_logprobs(reference, token_ids)
    assert abs(math.exp(expected.mean() - logprobs.mean()) - 1) < 0.01
    assert np.abs(logprobs - expected).mean() < 0.1


TINY_LLAMA = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1088,  # K = 1,088 for the down projection: 34 blocks
    vocab_size=49152,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
)


# The K-quants' rows are whole super-blocks of 256.
TINY_K_LLAMA = dict(TINY_LLAMA, hidden_size=256, intermediate_size=768)


@pytest.fixture(scope="module")
def tiny_files() -> dict[str, str]:
    os.makedirs(FILES_DIR, exist_ok=True)
    files = {}
    for qtype in ["Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K"]:
        shape = TINY_K_LLAMA if "_K" in qtype else TINY_LLAMA
        path = os.path.join(FILES_DIR, f"tiny-llama-{qtype}.gguf")
        files[qtype] = gguf_files.write_random(path, qtype, ("llama", shape))
    return files


@pytest.mark.parametrize(
    ("qtype", "types"),
    [
        ("Q8_0", {"Q8_0"}),
        ("Q4_0", {"Q4_0"}),
        ("Q4_1", {"Q4_1"}),
        # layer 1 of 2 gets Q4_K_M's extra bits: v and the down projection in Q6_K
        ("Q4_K_M", {"Q4_K", "Q4_K+Q6_K", "Q6_K"}),
        ("Q5_K", {"Q5_K"}),
    ],
)
def test_decode_steps_equal_the_module_path_bit_for_bit(
    tiny_files, tokenizer_dir, qtype, types, monkeypatch
) -> None:
    llm = make_llm(tiny_files[qtype], tokenizer=tokenizer_dir)
    assert linear_types(llm) == types
    steps = check_each_fused_step(in_process_model(llm), monkeypatch)
    lengths = [3, 17, 40]
    outputs = llm.generate(token_prompts(lengths), greedy(8), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8] * 3
    assert steps == [3] * 7


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory) -> dict[str, list[LoRARequest]]:
    """Per tiny file shape (TINY_LLAMA's, and TINY_K_LLAMA's for the K-quants), two peft
    adapters made on a random checkpoint of it: every module at rank 8, and q and down alone at
    rank 4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    result = {}
    for name, shape in [("blocks", TINY_LLAMA), ("k-quants", TINY_K_LLAMA)]:
        root = tmp_path_factory.mktemp(f"gguf_lora_{name}")
        LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(root / "base")
        paths = [
            make_adapter(str(root / "base"), str(root / "every"), 1, r=8, lora_alpha=16),
            make_adapter(
                str(root / "base"), str(root / "q-down"), 2, r=4, lora_alpha=32,
                target_modules=["q_proj", "down_proj"],
            ),
        ]  # fmt: skip
        result[name] = [LoRARequest(f"{name}-{i}", i + 1, p) for i, p in enumerate(paths)]
    return result


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K_M"])
def test_decode_steps_with_adapters_equal_the_module_path_bit_for_bit(
    tiny_files, tiny_adapters, tokenizer_dir, qtype, monkeypatch
) -> None:
    """The C step adds a few rows' deltas inside each projection's parallel region
    (qmatmul_lora_bf16; Q4_K_M's q|k|v in parts): a request alone and beside a base row and
    another adapter."""
    llm = make_llm(tiny_files[qtype], tokenizer=tokenizer_dir, enable_lora=True, max_loras=2)
    every, q_down = tiny_adapters["k-quants" if "_K" in qtype else "blocks"]
    steps = check_each_fused_step(in_process_model(llm), monkeypatch)
    prompts = token_prompts([3, 17, 40, 9])
    alone = llm.generate(prompts[:1], greedy(8), use_tqdm=False, lora_request=every)
    loras = [every, None, q_down, every]
    mixed = llm.generate(prompts, greedy(8), use_tqdm=False, lora_request=loras)
    base = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert steps == [1] * 7 + [4] * 14
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == base[1].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in mixed] != [o.outputs[0].token_ids for o in base]


def run(llm: LLM, batch: list[dict]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    return [
        (o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
        for o in llm.generate(batch, params, use_tqdm=False)
    ]


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K_M"])
def test_a_batch_gives_each_request_its_bits_alone(tiny_files, tokenizer_dir, qtype) -> None:
    """Prompt and generated tokens share steps (chunks of 24 tokens, then prefix hits leaving
    one or two tokens): each row is summed in one order whatever the step holds."""
    prompts = token_prompts([97, 33, 65, 17, 5, 48])
    path = tiny_files[qtype]
    alone_llm = LLM(path, tokenizer=tokenizer_dir, num_kv_blocks=128, enable_prefix_caching=False)
    alone = [run(alone_llm, [p])[0] for p in prompts]
    del alone_llm
    llm = LLM(
        path, tokenizer=tokenizer_dir, num_kv_blocks=128, max_num_batched_tokens=24, max_num_seqs=8
    )
    assert run(llm, prompts) == alone
    assert run(llm, prompts[::-1]) == alone[::-1]  # now with prefix-cache hits


def test_other_quantized_types_are_dequantized_with_a_warning(tiny_files, tokenizer_dir, caplog):
    path = os.path.join(FILES_DIR, "tiny-llama-Q5_0.gguf")
    gguf_files.write_random(path, "Q5_0", ("llama", TINY_LLAMA))
    with caplog.at_level(logging.WARNING, logger="quire.model.gguf_loader"):
        llm = LLM(path, tokenizer=tokenizer_dir, num_kv_blocks=16)
    assert "Q5_0 weights are dequantized at load" in caplog.text
    assert linear_types(llm) == set()
    assert llm.stats().c_decode_step  # bf16, GEMV-packed


def test_a_decode_step_reads_kept_blocks_as_stored(tiny_files) -> None:
    """The latency benchmark's weight bytes: Q4_0 blocks at 18 bytes per 32 weights, or bf16
    when dequantized; the untied file's embedding is not read by a decode step."""
    from quire.model.gguf_loader import decode_weight_bytes

    c = TINY_LLAMA
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    layer = c["hidden_size"] * (2 * q + 2 * kv + 3 * c["intermediate_size"])
    weights = c["num_hidden_layers"] * layer + c["vocab_size"] * c["hidden_size"]
    path = tiny_files["Q4_0"]
    assert decode_weight_bytes(path, frozenset({"Q4_0"}), 2) == weights // 32 * 18
    assert decode_weight_bytes(path, frozenset(), 2) == weights * 2

"""GGUF K-quant weights (Q4_K, Q5_K, Q6_K) kept in their super-blocks end to end: SmolLM2's real
weights re-quantized as llama.cpp's Q4_K_M mix give a perplexity within 1% of the same file
dequantized to float32; on a tiny random model (widths multiples of 256) the C decode step gives
the module path's bits, including a q|k|v of two types, and a request's bits do not depend on
the batch, its chunking or prefix hits."""

from __future__ import annotations

import os

import pytest
from conftest import token_prompts
from test_cpu_decode import check_each_fused_step, greedy, model_of
from test_quantized_gguf import FILES_DIR, PROSE, linear_types, perplexity, run

from quire import LLM
from quire.bench import gguf_files
from quire.kernels.cpu import qmatmul
from quire.layers.linear import packed_linear_supported

pytestmark = pytest.mark.skipif(
    not (qmatmul.available() and packed_linear_supported("cpu", __import__("torch").bfloat16)),
    reason="needs the C kernels and bf16 on CPU",
)

TINY_K_LLAMA = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=49152,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
)


@pytest.fixture(scope="module")
def tiny_files() -> dict[str, str]:
    os.makedirs(FILES_DIR, exist_ok=True)
    return {
        qtype: gguf_files.write_random(
            os.path.join(FILES_DIR, f"tiny-k-llama-{qtype}.gguf"), qtype, ("llama", TINY_K_LLAMA)
        )
        for qtype in ["Q4_K_M", "Q5_K"]
    }


def test_perplexity_is_within_one_percent_of_the_dequantized_file(
    default_model, tokenizer_dir
) -> None:
    """SmolLM2's down projections (K = 1,536) in Q4_K and Q6_K; its other matrices (K = 576,
    not whole super-blocks) in Q8_0, as llama.cpp falls back for them."""
    os.makedirs(FILES_DIR, exist_ok=True)
    path = gguf_files.requantize(
        default_model, os.path.join(FILES_DIR, "smollm2-Q4_K_M.gguf"), "Q4_K_M"
    )
    quantized = LLM(path, tokenizer=tokenizer_dir, num_kv_blocks=32)
    token_ids = quantized.get_tokenizer()(PROSE)["input_ids"]
    assert linear_types(quantized) == {"Q8_0", "Q4_K", "Q6_K"}
    assert model_of(quantized).cpu_step is not None
    ppl = perplexity(quantized, token_ids)
    del quantized
    reference = LLM(
        path, tokenizer=tokenizer_dir, num_kv_blocks=32, quantization="none", dtype="float32"
    )
    expected = perplexity(reference, token_ids)
    assert abs(ppl / expected - 1) < 0.01, (ppl, expected)


@pytest.mark.parametrize(
    ("qtype", "types"),
    # layer 1 of 2 gets llama.cpp's extra bits: v and the down projection in Q6_K
    [("Q4_K_M", {"Q4_K", "Q4_K+Q6_K", "Q6_K"}), ("Q5_K", {"Q5_K"})],
)
def test_decode_steps_equal_the_module_path_bit_for_bit(
    tiny_files, tokenizer_dir, qtype, types, monkeypatch
) -> None:
    llm = LLM(tiny_files[qtype], tokenizer=tokenizer_dir, num_kv_blocks=64)
    assert linear_types(llm) == types
    steps = check_each_fused_step(model_of(llm), monkeypatch)
    outputs = llm.generate(token_prompts([3, 17, 40]), greedy(8), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8] * 3
    assert steps == [3] * 7


def test_a_batch_gives_each_request_its_bits_alone(tiny_files, tokenizer_dir) -> None:
    """Prompt and generated tokens share steps (chunks of 24 tokens, then prefix hits leaving
    one or two tokens): each row is summed in one order whatever the step holds."""
    prompts = token_prompts([97, 33, 65, 17, 5, 48])
    path = tiny_files["Q4_K_M"]
    alone_llm = LLM(path, tokenizer=tokenizer_dir, num_kv_blocks=128, enable_prefix_caching=False)
    alone = [run(alone_llm, [p])[0] for p in prompts]
    del alone_llm
    llm = LLM(
        path, tokenizer=tokenizer_dir, num_kv_blocks=128, max_num_batched_tokens=24, max_num_seqs=8
    )
    assert run(llm, prompts) == alone
    assert run(llm, prompts[::-1]) == alone[::-1]  # now with prefix-cache hits

"""Multi-LoRA through the engine: `LLM(enable_lora=True)` and `generate(lora_request=...)` give
each request the greedy tokens of transformers + peft on the same adapter (float32), a batch
mixing the base model and three adapters gives every request its tokens alone (bf16, bit for
bit, chunked and under preemption), the prefix cache keeps adapters and reloads apart, the
scheduler holds at most `max_loras` adapters at once, and bad adapters are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_idle, greedy, make_adapter
from peft import PeftModel
from transformers import AutoModelForCausalLM

from quire import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

PROMPTS = [[5, 17, 300, 42, 7, 99, 3], [11, 12, 13, 14, 15, 200, 201, 3, 9] * 3, [88, 400, 2]]
MAX_TOKENS = 12


def peft_greedy(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "a": dict(r=8, lora_alpha=16),
        "b": dict(r=16, lora_alpha=8, use_rslora=True, rank_pattern={"v_proj": 4}),
        "c": dict(r=4, lora_alpha=32, target_modules=["q_proj", "down_proj"]),
        "d": dict(r=8, lora_alpha=8),
    }
    return {
        name: LoRARequest(name, i, make_adapter(tiny_llama, str(root / name), i, **spec))
        for i, (name, spec) in enumerate(specs.items(), 1)
    }


def tokens(llm: LLM, prompts, loras, **params) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        greedy(MAX_TOKENS, **params),
        use_tqdm=False,
        lora_request=loras,
    )
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def f32_llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=4)


def test_greedy_tokens_with_an_adapter_equal_peft(f32_llm, tiny_llama, adapters):
    loras = [adapters["a"], adapters["b"], adapters["c"]]
    got = tokens(f32_llm, PROMPTS, loras)
    expected = [peft_greedy(tiny_llama, lora.lora_path, p) for p, lora in zip(PROMPTS, loras)]
    assert got == expected
    assert got[0] != peft_greedy(tiny_llama, None, PROMPTS[0])  # the adapter changes the output
    assert_idle(f32_llm)


def test_a_base_request_beside_adapters_gets_the_base_models_tokens(f32_llm, tiny_llama, adapters):
    got = tokens(f32_llm, PROMPTS, [None, adapters["a"], None])
    assert got[0] == peft_greedy(tiny_llama, None, PROMPTS[0])
    assert got[2] == peft_greedy(tiny_llama, None, PROMPTS[2])


@pytest.fixture(scope="module")
def bf16_llm(tiny_llama) -> LLM:
    return LLM(
        tiny_llama,
        dtype="bfloat16",
        num_kv_blocks=128,
        enable_lora=True,
        max_loras=4,
        max_num_batched_tokens=16,  # the long prompt runs in chunks
    )


def logprob_bits(llm: LLM, prompts, loras) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        greedy(MAX_TOKENS, logprobs=0),
        use_tqdm=False,
        lora_request=loras,
    )
    return [
        (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        for c in (o.outputs[0] for o in outputs)
    ]


def test_a_mixed_batch_gives_every_request_its_bits_alone(bf16_llm, adapters):
    prompts = PROMPTS + [PROMPTS[0]]
    loras = [None, adapters["a"], adapters["b"], adapters["c"]]
    alone = [logprob_bits(bf16_llm, [p], [lora])[0] for p, lora in zip(prompts, loras)]
    bf16_llm.engine.reset_prefix_cache()
    assert logprob_bits(bf16_llm, prompts, loras) == alone
    assert_idle(bf16_llm)


def test_preemption_keeps_each_requests_bits(tiny_llama, adapters):
    loras = [adapters["a"], adapters["b"], None]
    roomy = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=128, enable_lora=True)
    expected = logprob_bits(roomy, PROMPTS, loras)
    tight = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=5, block_size=8, enable_lora=True)
    assert logprob_bits(tight, PROMPTS, loras) == expected
    assert tight.stats().num_preemptions > 0
    assert_idle(tight)


def test_the_prefix_cache_keeps_adapters_apart(bf16_llm, adapters):
    prompt = [PROMPTS[1] * 2]
    bf16_llm.engine.reset_prefix_cache()
    before = bf16_llm.stats().prefix_cache_hits
    tokens(bf16_llm, prompt, [adapters["a"]])
    tokens(bf16_llm, prompt, [adapters["b"]])  # the same tokens under another adapter
    tokens(bf16_llm, prompt, [None])
    assert bf16_llm.stats().prefix_cache_hits == before
    tokens(bf16_llm, prompt, [adapters["a"]])  # under the same adapter: hits
    assert bf16_llm.stats().prefix_cache_hits > before


def test_a_reloaded_adapter_shares_no_cached_block(tiny_llama, adapters, tmp_path):
    llm = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=128, enable_lora=True)
    prompt = [PROMPTS[1] * 2]
    first = tokens(llm, prompt, [adapters["a"]])
    llm.engine.remove_lora("a")
    other = LoRARequest("a", 1, adapters["b"].lora_path)  # the name, another adapter's weights
    hits = llm.stats().prefix_cache_hits
    assert tokens(llm, prompt, [other]) == tokens(llm, prompt, [adapters["b"]])
    assert tokens(llm, prompt, [other])[0] != first[0]
    assert llm.stats().prefix_cache_hits > hits  # its own second run hits, the first did not
    assert_idle(llm)


def test_the_scheduler_runs_at_most_max_loras_adapters_at_once(tiny_llama, adapters):
    llm = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=128, enable_lora=True, max_loras=2)
    seen = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def counting():
        output = schedule()
        seen.append({r.lora_request.lora_name for r in scheduler.running if r.lora_request})
        return output

    scheduler.schedule = counting
    loras = [adapters[n] for n in "abcd"] + [None]
    got = tokens(llm, PROMPTS + PROMPTS[:2], loras)
    scheduler.schedule = schedule
    assert max(len(s) for s in seen) == 2
    assert len(set().union(*seen)) == 4  # each adapter ran, none starved
    alone = [tokens(llm, [p], [lora])[0] for p, lora in zip(PROMPTS + PROMPTS[:2], loras)]
    assert got == alone
    assert_idle(llm)


def test_n_gt_1_and_ngram_speculation_run_with_an_adapter(tiny_llama, adapters):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=128, enable_lora=True)
    spec_llm = LLM(
        tiny_llama,
        dtype="bfloat16",
        num_kv_blocks=128,
        enable_lora=True,
        speculative_config=spec,
    )
    prompt = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7]]
    assert tokens(spec_llm, prompt, [adapters["a"]]) == tokens(llm, prompt, [adapters["a"]])
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False, lora_request=adapters["a"]
    )
    assert [len(c.token_ids) for c in out.outputs] == [6, 6]
    assert_idle(llm, spec_llm)


def test_bad_adapters_are_refused_and_change_nothing(tiny_llama, adapters, tmp_path):
    llm = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=32, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank"):  # b has rank 16
        tokens(llm, PROMPTS[:1], [adapters["b"]])
    with pytest.raises(ValueError, match="does not exist|missing|no adapter"):
        tokens(llm, PROMPTS[:1], [LoRARequest("x", 9, str(tmp_path / "missing"))])
    with pytest.raises(ValueError, match="is loaded from"):
        tokens(llm, PROMPTS[:1], [adapters["a"]])
        tokens(llm, PROMPTS[:1], [LoRARequest("a", 1, adapters["d"].lora_path)])
    assert [r.lora_name for r in llm.engine.list_loras()] == ["a"]
    assert_idle(llm)
    plain = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=32)
    with pytest.raises(ValueError, match="enable_lora"):
        tokens(plain, PROMPTS[:1], [adapters["a"]])


def test_lora_modules_load_at_start_and_a_bad_one_fails_the_start(tiny_llama, adapters):
    llm = LLM(
        tiny_llama,
        dtype="bfloat16",
        num_kv_blocks=32,
        enable_lora=True,
        lora_modules=[
            f"a={adapters['a'].lora_path}",
            f'{{"name": "c", "path": "{adapters["c"].lora_path}"}}',
        ],
    )
    assert [(r.lora_name, r.lora_int_id) for r in llm.engine.list_loras()] == [("a", 1), ("c", 2)]
    with pytest.raises(ValueError, match="needs enable_lora"):
        LLM(tiny_llama, lora_modules=[f"a={adapters['a'].lora_path}"])
    with pytest.raises(ValueError, match="name=path"):
        LLM(tiny_llama, enable_lora=True, lora_modules=["just-a-path"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tiny_llama, enable_lora=True, lora_modules=["a=/nonexistent/adapter"])


def test_a_bad_lora_module_fails_the_start_before_the_model_loads(
    tiny_llama, adapters, monkeypatch
):
    from quire.worker import model_forward

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the adapters were checked")

    monkeypatch.setattr(model_forward, "load_model", no_load)
    with pytest.raises(ValueError, match="rank"):  # b has rank 16
        LLM(
            tiny_llama,
            enable_lora=True,
            max_lora_rank=8,
            lora_modules=[f"b={adapters['b'].lora_path}"],
        )


def test_tensor_parallel_2_with_adapters_gives_the_tokens_of_one_rank(
    f32_llm, tiny_llama, adapters
):
    """Each rank holds its shard of A (row-parallel) or B (column-parallel), loaded by the rank
    itself from the request's adapter."""
    loras = [adapters["a"], None, adapters["b"]]
    tp2 = LLM(
        tiny_llama,
        dtype="float32",
        num_kv_blocks=64,
        enable_lora=True,
        tensor_parallel_size=2,
    )
    try:
        assert tokens(tp2, PROMPTS, loras) == tokens(f32_llm, PROMPTS, loras)
        assert_idle(tp2)
    finally:
        tp2.engine.shutdown()

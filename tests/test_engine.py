"""Engine behaviour: outputs do not depend on batching, chunking, caching or preemption."""

from __future__ import annotations

import pytest
from conftest import assert_idle, greedy

from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine.llm_engine import LLMEngine
from quire.sampling_params import RequestOutputKind

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "In 1492, Columbus",
    "Here is a long prompt that spans several KV blocks of sixteen tokens each so that chunked "
    "prefill and prefix caching have something to chew on: alpha beta gamma delta epsilon zeta "
    "eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi chi psi omega.",
    "Hi",
]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    """Each prompt generated alone, with a large budget and no prefix caching."""
    llm = LLM(model=tiny_llama, dtype="float32", enable_prefix_caching=False)
    return [token_ids(llm.generate([p], greedy(24), use_tqdm=False))[0] for p in PROMPTS]


def test_batched_outputs_equal_single_request_outputs(tiny_llama, reference):
    llm = LLM(model=tiny_llama, dtype="float32")
    assert token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False)) == reference
    assert token_ids(llm.generate(PROMPTS[::-1], greedy(24), use_tqdm=False)) == reference[::-1]
    assert_idle(llm)


def test_chunked_prefill_gives_identical_outputs(tiny_llama, reference):
    llm = LLM(
        model=tiny_llama, dtype="float32", max_num_batched_tokens=7, enable_prefix_caching=False
    )
    assert token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False)) == reference
    assert_idle(llm)


def test_prefill_chunks_of_several_requests_share_each_step_of_the_budget(tiny_llama, reference):
    """Prompts of 10, 8 and 61 tokens under a budget of 40 tokens a step. Step 1 computes both
    short prompts, which sample their first tokens, and 22 tokens of the long one; step 2 their
    decodes and 38 more; step 3 their decodes and the long prompt's last token, which samples.
    Every request's tokens are those it gives alone."""
    config = EngineConfig(
        model=tiny_llama, dtype="float32", max_num_batched_tokens=40, num_kv_blocks=64
    )
    engine = LLMEngine(config)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), p, greedy(24))
    num_tokens_after_each_step = [
        {out.request_id: len(out.outputs[0].token_ids) for out in engine.step()} for _ in range(3)
    ]
    assert num_tokens_after_each_step == [
        {"0": 1, "1": 1},
        {"0": 2, "1": 2},
        {"0": 3, "1": 3, "2": 1},
    ]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert [len(finished[str(i)].prompt_token_ids) for i in range(3)] == [10, 8, 61]
    assert [finished[str(i)].outputs[0].token_ids for i in range(3)] == reference[:3]


def test_prefix_cache_hit_gives_identical_outputs_and_reports_cached_tokens(tiny_llama, reference):
    llm = LLM(model=tiny_llama, dtype="float32")
    (cold,) = llm.generate([PROMPTS[2]], greedy(24), use_tqdm=False)
    (warm,) = llm.generate([PROMPTS[2]], greedy(24), use_tqdm=False)
    assert cold.num_cached_tokens == 0
    block = llm.engine.config.block_size
    assert warm.num_cached_tokens == (len(warm.prompt_token_ids) - 1) // block * block > 0
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids == reference[2]
    assert_idle(llm)


def test_shared_prefix_across_different_prompts_is_reused(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32")
    llm.generate([PROMPTS[2]], greedy(4), use_tqdm=False)
    (out,) = llm.generate([PROMPTS[2] + " And then some more."], greedy(4), use_tqdm=False)
    assert out.num_cached_tokens >= 32


def test_preemption_by_recompute_gives_identical_outputs(tiny_llama, reference):
    # 12 blocks of 16 tokens cannot hold all four requests at once: some get preempted.
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=12)
    assert token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False)) == reference
    assert llm.stats().num_preemptions > 0
    assert_idle(llm)


def test_preemption_without_prefix_cache_and_tiny_chunks(tiny_llama, reference):
    llm = LLM(
        model=tiny_llama,
        dtype="float32",
        num_kv_blocks=8,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    assert token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False)) == reference
    assert llm.stats().num_preemptions > 0
    assert_idle(llm)


def test_max_num_seqs_limits_the_running_batch(tiny_llama, reference):
    llm = LLM(model=tiny_llama, dtype="float32", max_num_seqs=2)
    assert token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False)) == reference


def test_n_greater_than_one_shares_prompt_blocks_and_samples_distinct_sequences(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert_idle(llm)
    (again,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_n_greedy_forks_are_identical_and_copy_on_write_keeps_them_correct(tiny_llama, reference):
    llm = LLM(model=tiny_llama, dtype="float32")
    (out,) = llm.generate(
        [PROMPTS[0]],
        SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    assert [c.token_ids for c in out.outputs] == [reference[0], reference[0]]
    assert_idle(llm)


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[3]], [others, params, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_abort_frees_blocks_and_engine_keeps_serving(tiny_llama, reference):
    engine = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32"))
    engine.add_request("a", PROMPTS[2], greedy(100))
    engine.add_request("b", PROMPTS[0], greedy(24))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert set(outputs) == {"b"}
    assert outputs["b"].outputs[0].token_ids == reference[0]
    assert_idle(engine)


def test_abort_of_a_waiting_request(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32"))
    engine.add_request("w", PROMPTS[0], greedy(24))
    engine.abort_request("w")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_stop_strings_and_stop_token_ids_end_generation(tiny_llama, reference):
    llm = LLM(model=tiny_llama, dtype="float32")
    tok = llm.get_tokenizer()
    full_text = tok.decode(reference[0])
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    (out,) = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False
    )
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full_text[: full_text.index(stop)]
    stop_id = reference[0][5]
    (out,) = llm.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )
    c = out.outputs[0]
    assert c.token_ids == reference[0][: reference[0].index(stop_id) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id


def test_max_tokens_gives_length_finish_reason(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32")
    (out,) = llm.generate(["Hello"], greedy(5), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_max_model_len_caps_generation(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=20)
    (out,) = llm.generate(
        [{"prompt_token_ids": list(range(100, 115))}], greedy(100), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"


def test_outputs_come_back_in_prompt_order_with_prompt_fields(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32")
    outs = llm.generate(
        ["b b b b b b b b b", {"prompt_token_ids": [5, 6, 7]}], greedy(3), use_tqdm=False
    )
    assert outs[0].prompt == "b b b b b b b b b"
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [5, 6, 7]
    assert outs[0].request_id != outs[1].request_id


def test_a_final_only_request_gives_one_output_with_the_text_a_stream_ends_with(
    tiny_llama, reference
):
    llm = LLM(model=tiny_llama, dtype="float32")
    engine = llm.engine
    stop_id = reference[0][5]  # ends by a stop token: its text leaves that token out
    kinds = {"streamed": RequestOutputKind.CUMULATIVE, "final": RequestOutputKind.FINAL_ONLY}
    for request_id, kind in kinds.items():
        params = SamplingParams(
            n=2, temperature=0, max_tokens=24, stop_token_ids=[stop_id], output_kind=kind
        )
        engine.add_request(request_id, PROMPTS[0], params)
    outputs = {request_id: [] for request_id in kinds}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    streamed, (final,) = outputs["streamed"], outputs["final"]
    assert len(streamed) == 6 and [o.finished for o in streamed] == [False] * 5 + [True]
    expected = reference[0][:6]
    text = llm.get_tokenizer().decode(expected[:-1])
    for completions in (streamed[-1].outputs, final.outputs):
        assert [c.token_ids for c in completions] == [expected, expected]
        assert [c.text for c in completions] == [text, text]
        assert [c.finish_reason for c in completions] == ["stop", "stop"]
    assert final.finished
    (generated,) = llm.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )
    assert generated.outputs[0].text == text
    assert_idle(llm)

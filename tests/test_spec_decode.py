"""Speculative decoding with n-gram proposals, end to end: a request gets the tokens (and, in
bf16, the logprob bits) it gets without speculation, in every batch shape the scheduler makes,
stop rules cut an accepted run where they apply, and a request decodes to the end of a pool
exactly max_model_len long.

The prompts repeat themselves, so prompt lookup finds matches; tiny random models soon repeat
their own output too, so proposals are accepted as well as rejected.
"""

from __future__ import annotations

import pytest
from conftest import assert_idle

from quire import LLM, SamplingParams
from quire.spec_decode.ngram import NgramProposer

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
# Repetitive prompts of several lengths; the last two share a 32-token prefix (prefix hits).
PROMPTS = [
    [5, 9, 200, 17, 3] * 4,
    [44, 45, 46, 47] * 9,
    [300 + i % 11 for i in range(40)] + [7, 8, 9],
    [300 + i % 11 for i in range(40)] + [1, 2],
]
POOL = dict(num_kv_blocks=128)  # 2048 tokens: a default-sized pool takes seconds to allocate


def token_ids(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_float32_tokens_equal_without_speculation(tiny_models, arch):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, **POOL)  # chunked prefill
    reference = token_ids(LLM(tiny_models[arch], **kwargs), params)
    llm = LLM(tiny_models[arch], speculative_config=NGRAM, **kwargs)
    assert token_ids(llm, params) == reference
    stats = llm.engine.spec_decoding_stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # some rejected too
    assert_idle(llm)


@pytest.fixture(scope="module")
def plain_llm(tiny_llama) -> LLM:
    """tiny_llama in bf16 without speculation (its tokens do not depend on the batch)."""
    return LLM(tiny_llama, dtype="bfloat16", max_num_batched_tokens=32, **POOL)


@pytest.fixture(scope="module")
def bf16_reference(plain_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    outputs = plain_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return params, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


ENGINES = {
    "chunked-prefix": dict(max_num_batched_tokens=32, **POOL),  # prefix hits: a shared prompt
    "preemption": dict(max_num_batched_tokens=64, num_kv_blocks=9, block_size=8),
}


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_bf16_bits_equal_without_speculation(tiny_llama, bf16_reference, engine):
    params, reference = bf16_reference
    llm = LLM(tiny_llama, dtype="bfloat16", speculative_config=NGRAM, **ENGINES[engine])
    for _ in range(2):  # the second pass hits the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs] == reference
    assert llm.engine.spec_decoding_stats.num_accepted_tokens > 0
    if engine == "preemption":
        assert llm.stats().num_preemptions > 0
    else:
        assert llm.stats().prefix_cache_hits > 0
    assert_idle(llm)


@pytest.fixture(scope="module")
def spec_llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="bfloat16", speculative_config=NGRAM, **POOL)


def test_seeded_sampling_tokens_equal_without_speculation(plain_llm, spec_llm):
    params = SamplingParams(temperature=0.5, top_k=3, seed=7, n=2, max_tokens=24, ignore_eos=True)
    reference = token_ids(plain_llm, params)
    before = spec_llm.engine.spec_decoding_stats.num_accepted_tokens
    assert token_ids(spec_llm, params) == reference
    assert spec_llm.engine.spec_decoding_stats.num_accepted_tokens > before
    assert_idle(spec_llm)


@pytest.fixture
def oracle(bf16_reference, monkeypatch):
    """The greedy output of PROMPTS[1] (without speculation), and the proposer made an oracle
    that proposes its next tokens: every step after the prefill accepts all 3 proposals and
    gives 4 tokens (output 1-4, 5-8, ...), so a stop can be placed inside an accepted run
    (the n-gram proposer only proposes tokens already in the text, which a stop id or string
    must not be)."""
    prompt, reference = PROMPTS[1], bf16_reference[1][1][0]

    def lookup(self, req_id: str, token_ids: list[int], k: int) -> list[int]:
        done = len(token_ids) - len(prompt)
        return reference[done : done + k]

    monkeypatch.setattr(NgramProposer, "lookup", lookup)
    # Inside a run: output 2-4, 6-8, ...; the first of those new to the output.
    stop_at = next(i for i in range(2, 24) if i % 4 != 1 and reference[i] not in reference[:i])
    return prompt, reference, stop_at


def test_stop_token_inside_an_accepted_run_drops_the_tokens_after_it(spec_llm, oracle):
    prompt, tokens, stop_at = oracle
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[stop_at]])
    out = spec_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == tokens[: stop_at + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", tokens[stop_at])
    assert_idle(spec_llm)


def test_stop_string_inside_an_accepted_run_drops_the_tokens_after_it(spec_llm, oracle):
    prompt, tokens, stop_at = oracle
    tokenizer = spec_llm.get_tokenizer()
    text_before = tokenizer.decode(tokens[:stop_at])
    stop = tokenizer.decode(tokens[: stop_at + 1])[len(text_before) :]
    assert stop and stop not in text_before  # a stop string that ends at stop_at
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True)
    completion = spec_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    completion = completion.outputs[0]
    assert completion.token_ids == tokens[: stop_at + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.text == text_before
    assert_idle(spec_llm)


def test_max_tokens_inside_a_run_of_proposals_ends_there(spec_llm, oracle):
    prompt, tokens, stop_at = oracle
    params = SamplingParams(temperature=0.0, max_tokens=stop_at + 1, ignore_eos=True)
    out = spec_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == tokens[: stop_at + 1]
    assert out.outputs[0].finish_reason == "length"
    assert_idle(spec_llm)


def test_metrics_export_the_speculation_counters(spec_llm, caplog):
    from quire.engine.metrics import EngineMetrics

    engine = spec_llm.engine
    metrics = EngineMetrics("m", log_requests=False, log_stats_interval_s=0.0)
    metrics.log_stats_if_due(engine, now=1.0)  # starts the interval
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request("metrics", {"prompt_token_ids": PROMPTS[0]}, params)
    while engine.has_unfinished_requests():
        metrics.record_step(engine, engine.step(), now=1.5)
    stats = engine.spec_decoding_stats
    assert stats.num_accepted_tokens > 0
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    assert value("quire:spec_decode_num_drafts_total", labels) == stats.num_drafts
    assert value("quire:spec_decode_num_draft_tokens_total", labels) == stats.num_draft_tokens
    assert value("quire:spec_decode_num_accepted_tokens_total", labels) == stats.num_accepted_tokens
    per_pos = [
        value("quire:spec_decode_num_accepted_tokens_per_pos_total", labels | {"position": str(i)})
        for i in range(3)
    ]
    assert per_pos == stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens
    with caplog.at_level("INFO", logger="quire.engine.metrics"):
        metrics.log_stats_if_due(engine, now=2.0)
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    assert f"spec decode acceptance rate {rate:.1%}" in caplog.text


def test_a_request_decodes_to_the_end_of_a_pool_exactly_max_model_len_long(tiny_llama):
    """4 blocks of 16 tokens: the engine clamps max_model_len to the pool's 64 tokens. The
    lookahead slots kept for proposals stop at max_model_len, so the request fills the pool
    and ends with `length`, never preempted (one step at most per token: a request preempted
    over and over fails here instead of running forever)."""
    llm = LLM(tiny_llama, dtype="float32", speculative_config=NGRAM, num_kv_blocks=4)
    engine = llm.engine
    assert engine.max_model_len == 4 * 16
    prompt = PROMPTS[1]  # 36 tokens
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # to the end
    engine.add_request("end", {"prompt_token_ids": prompt}, params)
    outputs = []
    for _ in range(engine.max_model_len - len(prompt)):
        outputs += engine.step()
        if outputs and outputs[-1].finished:
            break
    completion = outputs[-1].outputs[0]
    assert (outputs[-1].finished, completion.finish_reason) == (True, "length")
    assert len(prompt) + len(completion.token_ids) == 64
    assert engine.spec_decoding_stats.num_draft_tokens > 0
    assert engine.stats().num_preemptions == 0
    assert_idle(llm)

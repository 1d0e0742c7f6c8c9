"""Pipeline parallelism end to end (CPU, gloo): two stages give one stage's greedy tokens in
float32 up to the first near-tie (two stages of two tensor-parallel ranks, one rank's), bf16
logprobs stay close, the default GGUF model keeps its blocks split over two stages; the engine
keeps two steps in flight over disjoint requests with the same tokens; abort, preemption and
n > 1 leave every block free on every stage; n-gram speculation and structured outputs run;
impossible splits and what does not run under pipeline parallelism fail at start, saying what
to change; a killed stage fails the engine within seconds. The scheduler with two steps in
flight gives them disjoint requests, holds a prompt's next chunk until its previous one is back,
never preempts a request in flight and frees an aborted one's blocks."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from conftest import assert_idle, greedy, make_llm, process_exists, token_prompts, worker_pids
from test_scheduler import (
    BS,
    assert_all_blocks_free,
    batch,
    ids,
    make_request,
    prompt,
    sampled,
    sampling_ids,
)
from test_tensor_parallel import (
    BF16_TIE_GAP,
    GREEDY,
    PROMPTS,
    assert_close_greedy,
    assert_preemption_and_abort_free_every_block,
    run,
)

from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine.kv_manager import KVCacheManager
from quire.engine.request import RequestStatus
from quire.engine.scheduler import Scheduler
from quire.entrypoints.cli import main
from quire.executor.base import WorkerDiedError
from quire.messages import SchedulerOutput
from quire.sampling_params import StructuredOutputsParams

# 6 blocks of 16 tokens: the prompts of the preemption test do not all fit at once
SMALL_POOL = dict(num_kv_blocks=6, max_model_len=96)


def two_stages(model: str, **kwargs) -> LLM:
    return LLM(model, dtype="float32", pipeline_parallel_size=2, **kwargs)


@pytest.fixture(scope="module")
def pp_llama(tiny_llama):
    """Two-stage tiny Llama, shared by the tests below; the last one kills a stage."""
    llm = two_stages(tiny_llama, **SMALL_POOL)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def one_llama(tiny_llama):
    return LLM(tiny_llama, dtype="float32", **SMALL_POOL)


def test_two_stages_give_one_stages_greedy_tokens_llama(one_llama, pp_llama):
    assert_close_greedy(run(one_llama), run(pp_llama))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_two_stages_give_one_stages_greedy_tokens(tiny_models, arch):
    """qwen2's LM head is tied to the embedding (both stages hold the table); qwen3's three
    layers split 2 + 1."""
    one = make_llm(tiny_models[arch], dtype="float32")
    two = two_stages(tiny_models[arch], num_kv_blocks=64)
    try:
        assert_close_greedy(run(one), run(two))
        assert_idle(two)
    finally:
        two.engine.shutdown()


def test_two_stages_of_two_ranks_give_one_ranks_greedy_tokens(one_llama, tiny_llama):
    four = two_stages(tiny_llama, tensor_parallel_size=2, **SMALL_POOL)
    try:
        assert [s.rank for s in four.engine.worker_states()] == [0, 1, 2, 3]
        assert_close_greedy(run(one_llama), run(four))
        assert_idle(four)
    finally:
        four.engine.shutdown()


def test_each_stage_holds_its_layers_weights(one_llama, pp_llama):
    """Each stage a layer of two, the first the embedding, the last the norm and LM head; only
    the rotary tables (cos and sin: 96 positions x head_dim 32, float32) are on both."""
    (whole,) = one_llama.stats().weight_bytes
    first, last = pp_llama.stats().weight_bytes
    assert first + last == whole + 96 * 32 * 2 * 4
    assert 0.45 < first / whole < 0.55


def test_stages_keep_two_steps_in_flight_with_one_stages_tokens(one_llama, pp_llama):
    prompts = token_prompts([5, 9, 13, 17, 21, 25])
    want = one_llama.generate(prompts, greedy(10, logprobs=2), use_tqdm=False)
    got = pp_llama.generate(prompts, greedy(10, logprobs=2), use_tqdm=False)
    assert_close_greedy([o.outputs[0] for o in want], [o.outputs[0] for o in got])
    assert pp_llama.stats().most_steps_in_flight == 2
    assert one_llama.stats().most_steps_in_flight == 1
    assert_idle(pp_llama)


def test_bf16_two_stages_keep_one_stages_logprobs_close(tiny_llama):
    small = dict(dtype="bfloat16", num_kv_blocks=64)
    one = LLM(tiny_llama, **small)
    two = LLM(tiny_llama, pipeline_parallel_size=2, **small)
    try:
        assert_close_greedy(run(one), run(two), BF16_TIE_GAP, 2e-2)
    finally:
        two.engine.shutdown()


def test_default_model_keeps_its_blocks_on_two_stages(default_model, tokenizer_dir):
    """SmolLM2's 30 Q4_1 layers split 15 + 15, their blocks kept: each stage holds about half
    the weight bytes and runs its decode steps in the C step where one stage does, and the
    tokens and logprobs are one stage's, bit for bit (the same kernels in the same order)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    small = dict(num_kv_blocks=16, max_model_len=256, tokenizer=tokenizer_dir)
    outputs, weights, c_steps = [], [], []
    for pp in (1, 2):
        llm = LLM(default_model, pipeline_parallel_size=pp, **small)
        try:
            outputs.append(llm.generate(PROMPTS[:2], params, use_tqdm=False))
            weights.append(llm.stats().weight_bytes)
            c_steps.append([w.c_decode_step for w in llm.engine.core.worker_states()])
        finally:
            llm.engine.shutdown()
    (one,), two = weights
    assert all(0.35 < stage / one < 0.65 for stage in two), (one, two)
    assert c_steps[1] == 2 * c_steps[0], c_steps  # each stage as the one stage
    want, got = ([o.outputs[0] for o in out] for out in outputs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


def test_preemption_abort_and_forks_free_every_block_on_every_stage(pp_llama):
    assert_preemption_and_abort_free_every_block(pp_llama, steps_before_abort=2)  # both in flight
    forks = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    (output,) = pp_llama.generate(PROMPTS[:1], forks, use_tqdm=False)
    assert [len(c.token_ids) for c in output.outputs] == [6, 6, 6]
    assert_idle(pp_llama)


def test_structured_outputs_run_on_two_stages(one_llama, pp_llama):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{3}-\d{2}"),
    )
    want = [o.outputs[0].text for o in one_llama.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].text for o in pp_llama.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert all(len(text) == 6 and text[3] == "-" for text in got)
    assert_idle(pp_llama)


def test_ngram_speculation_runs_on_two_stages(tiny_llama, one_llama):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    prompts = [{"prompt_token_ids": [7, 8, 9, 10] * 6}, {"prompt_token_ids": [50, 60] * 10}]
    want = [o.outputs[0] for o in one_llama.generate(prompts, GREEDY, use_tqdm=False)]
    llm = two_stages(tiny_llama, speculative_config=ngram, **SMALL_POOL)
    try:
        got = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert_close_greedy(want, got)
        assert llm.stats().spec_decode_num_drafts > 0
        assert_idle(llm)
    finally:
        llm.engine.shutdown()


def test_adaptive_ngram_speculation_measures_steps_in_flight(tiny_llama, one_llama):
    """With two micro-batches in flight, each step's proposals and readiness are its own
    requests': "auto" measures its step times (its cost table fills) and verifies proposals."""
    auto = {"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_min": 1}
    prompts = [{"prompt_token_ids": [7 + i, 8, 9, 10] * 5} for i in range(6)]
    params = greedy(24, logprobs=2)
    want = [o.outputs[0] for o in one_llama.generate(prompts, params, use_tqdm=False)]
    llm = two_stages(tiny_llama, speculative_config=auto, num_kv_blocks=64, max_model_len=96)
    try:
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_close_greedy(want, got)
        assert llm.stats().most_steps_in_flight == 2
        cost = llm.engine.core.speculator.adaptive.cost
        assert cost.predict(np.arange(1, 33)).max() > 0  # decode steps were measured
        assert llm.stats().spec_decode_num_drafts > 0
        assert_idle(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            dict(pipeline_parallel_size=3),
            "pipeline_parallel_size 3 exceeds llama's 2 layers .*: use pipeline_parallel_size 1..2",
        ),
        (
            dict(pipeline_parallel_size=2, pp_layer_partition="2,1"),
            "pp_layer_partition 2,1 must give each of the 2 stages at least one layer and sum "
            "to llama's 2 layers, e.g. 1,1",
        ),
        (
            dict(pipeline_parallel_size=2, pp_layer_partition="2"),
            "pp_layer_partition 2 must give each of the 2 stages .* e.g. 1,1",
        ),
        (
            dict(pipeline_parallel_size=2, pp_layer_partition="1;1"),
            "pp_layer_partition must be layer counts separated by commas",
        ),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be >= 1, got 0"),
        (dict(max_steps_in_flight=0), "max_steps_in_flight must be >= 1, got 0"),
    ],
)
def test_impossible_splits_fail_at_start_naming_what_works(tiny_llama, args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_llama, **args)


def test_a_layer_partition_and_one_step_in_flight(tiny_models):
    """qwen3's three layers 1 + 2 (the even split gives 2 + 1), and the stages run a step at a
    time when asked: the same tokens."""
    one = make_llm(tiny_models["qwen3"], dtype="float32")
    two = two_stages(
        tiny_models["qwen3"], num_kv_blocks=64, pp_layer_partition="1,2", max_steps_in_flight=1
    )
    try:
        first, last = two.stats().weight_bytes
        assert first < last
        assert_close_greedy(run(one), run(two))
        assert two.stats().most_steps_in_flight == 1
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}),
            "does not run with speculative_config method 'draft_model'",
        ),
        (dict(disaggregation_mode="prefill"), "does not run with disaggregation"),
        (dict(enable_lora=True), "does not run with enable_lora"),
    ],
)
def test_what_does_not_run_on_stages_is_refused_at_start(tiny_llama, args, message):
    if "speculative_config" in args:
        args["speculative_config"]["model"] = tiny_llama
    with pytest.raises(ValueError, match=message + ".*or use pipeline_parallel_size 1"):
        EngineConfig(model=tiny_llama, pipeline_parallel_size=2, **args)


def test_quire_generate_refuses_more_stages_than_layers(capsys):
    assert main(["generate", "-pp", "31", "What is the capital of Japan?"]) == 2
    assert capsys.readouterr().err == (
        "error: pipeline_parallel_size 31 exceeds SmolLM2-135M-Instruct.Q4_1.gguf's 30 layers "
        "(a stage holds at least one): use pipeline_parallel_size 1..30.\n"
    )


def test_a_killed_stage_fails_the_engine_within_seconds(pp_llama):
    """(Last of the module's tests on `pp_llama`: it ends its ranks.)"""
    pids = worker_pids(pp_llama)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 process died"):
        pp_llama.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 5
    assert not any(map(process_exists, pids))  # the first stage ended too


# ---- the scheduler with two steps in flight (no model) -------------------------------------


def in_flight_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, True)
    return Scheduler(kv, 8, max_num_batched_tokens, 64, max_steps_in_flight=2)


def finish(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Takes a step back: every request that samples gets token 7."""
    scheduler.update(output, sampled(sampling_ids(scheduler, output)))


def test_two_steps_in_flight_take_disjoint_halves_of_the_requests():
    scheduler = in_flight_scheduler()
    for i, name in enumerate("abcd"):
        scheduler.add_request(make_request(name, prompt(100 * (i + 1), 4)))
    first, second, third = (scheduler.schedule() for _ in range(3))
    assert [batch(first), batch(second), batch(third)] == [
        [("a", 4), ("b", 4)],
        [("c", 4), ("d", 4)],
        [],
    ]
    finish(scheduler, first)
    assert batch(scheduler.schedule()) == [("a", 1), ("b", 1)]


def test_a_prompts_next_chunk_waits_for_its_previous_one():
    scheduler = in_flight_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", prompt(100, 20)))
    first = scheduler.schedule()
    assert batch(first) == [("a", 8)] and scheduler.schedule().is_empty
    finish(scheduler, first)
    assert batch(scheduler.schedule()) == [("a", 8)]


def test_a_request_in_flight_is_never_preempted():
    """Two blocks: "a" (running first) needs a second one for its first decode while the newer
    "b" has its prompt in flight; "a" gives its own block back instead of taking b's."""
    scheduler = in_flight_scheduler(num_blocks=2)
    scheduler.add_request(make_request("a", prompt(100, 4)))
    scheduler.add_request(make_request("b", prompt(200, 4)))
    first, second = scheduler.schedule(), scheduler.schedule()
    finish(scheduler, first)
    third = scheduler.schedule()
    assert third.is_empty and third.preempted_req_ids == ["a"]
    finish(scheduler, second)
    assert ids(scheduler.running) == ["b"] and ids(scheduler.waiting) == ["a"]


def test_a_request_aborted_in_flight_frees_its_blocks_when_its_step_returns():
    scheduler = in_flight_scheduler()
    scheduler.add_request(make_request("a", prompt(100, 6)))
    output = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    scheduler.update(output, sampled(["a"]))
    assert_all_blocks_free(scheduler)
    assert scheduler.schedule().finished_req_ids == ["a"]

"""Async scheduling (vLLM's --async-scheduling): a request's next step is scheduled while its
step runs, on the token the worker sampled for it, and the stop rules apply one step late.

On the default GGUF model (bf16, the C decode step) the engine gives the same tokens, logprobs
and finish reasons with it on and off: greedy and seeded sampling, penalties (the worker's own
token history), stop strings, stop ids, max_tokens, n > 1, logprobs, structured outputs beside
plain requests; on a tiny Llama in float32, preemption in a small pool and an abort while two
steps are in flight; no block or worker state is left behind. The scheduler schedules a request ahead only when its step in
flight samples a plain token with room for another, and drops the token of a step scheduled
past a stop. With a forward that takes a fixed time and releases the GIL, a step takes about
the longer of host and device work, not their sum. What it does not run with is refused at
start."""

from __future__ import annotations

import time

import pytest
from conftest import assert_idle, token_prompts
from test_scheduler import BS, assert_all_blocks_free, make_request, make_scheduler, prompt

from quire import LLM, SamplingParams
from quire.config import EngineConfig, resolve_config
from quire.messages import ModelRunnerOutput
from quire.sampling_params import StructuredOutputsParams

SMALL_POOL = dict(num_kv_blocks=12, max_model_len=160)  # 16-token blocks: three 40-token prompts


@pytest.fixture(scope="module")
def engines(default_model):
    """The default model with async scheduling off and on, the same small pool."""
    sync, ahead = (LLM(default_model, async_scheduling=on, **SMALL_POOL) for on in (False, True))
    yield sync, ahead
    for llm in (sync, ahead):
        llm.engine.shutdown()


def outputs(llm: LLM, prompts, params) -> list:
    """What a user reads of each completion: tokens, text, finish, stop reason, logprobs."""
    result = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        for c in output.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [{t: round(p.logprob, 6) for t, p in pos.items()} for pos in c.logprobs]
            result.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, logprobs))
    return result


def test_it_is_off_unless_asked(default_model):
    assert not resolve_config(EngineConfig(model=default_model)).scheduler.async_scheduling
    config = resolve_config(EngineConfig(model=default_model, async_scheduling=True))
    assert config.scheduler.async_scheduling and config.scheduler.max_steps_in_flight == 2


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "specul"),
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size > 1"),
        (dict(max_steps_in_flight=3), "max_steps_in_flight other than 2"),
    ],
)
def test_what_it_does_not_run_with_is_refused_at_start(default_model, extra, refused):
    with pytest.raises(ValueError, match=f"async_scheduling does not run with {refused}"):
        EngineConfig(model=default_model, async_scheduling=True, **extra)


def test_the_same_outputs_with_and_without_it(engines):
    sync, ahead = engines
    prompts = [
        "The capital of France is",
        "List three colors:",
        "Write a haiku about the sea.",
        "Count from one to ten:",
        "What is the tallest mountain?",
        "Name a fruit.",
        "Say hello in French.",
    ]
    probe = sync.generate(prompts[3], SamplingParams(temperature=0.0, max_tokens=12))
    stop_id = probe[0].outputs[0].token_ids[6]  # met mid-way: the stop rules act one step late
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=18),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[","]),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id]),
        SamplingParams(
            temperature=0.8, seed=5, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5
        ),
        SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=9, min_tokens=4),
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(regex=r"(Bonjour|Salut)[a-z ]{0,12}!"),
        ),
    ]
    before = ahead.stats().num_scheduled_ahead
    expected = outputs(sync, prompts, params)
    assert expected[3][0][-1] == stop_id and expected[3][2] == "stop"
    assert outputs(ahead, prompts, params) == expected
    stats = ahead.stats()
    assert stats.most_steps_in_flight == 2
    assert stats.num_scheduled_ahead - before > 40  # most decodes ran ahead
    assert_idle(sync, ahead)


@pytest.fixture(scope="module")
def tiny_engines(tiny_llama):
    """A tiny Llama in float32 with async scheduling off and on, the same small pool."""
    sync, ahead = (
        LLM(tiny_llama, dtype="float32", async_scheduling=on, **SMALL_POOL) for on in (False, True)
    )
    yield sync, ahead
    for llm in (sync, ahead):
        llm.engine.shutdown()


def test_a_last_request_ended_by_a_stop_token_leaves_no_step_in_flight(tiny_engines):
    sync, ahead = tiny_engines
    prompts = token_prompts([20])
    stop_id = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))[0]
    stop_id = stop_id.outputs[0].token_ids[3]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id])
    assert outputs(ahead, prompts, params) == outputs(sync, prompts, params)
    assert_idle(ahead)  # the step scheduled past the stop came back and was dropped


def test_preemption_and_abort_in_a_small_pool(tiny_engines):
    sync, ahead = tiny_engines
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 * i + 10, 100 * i + 90))} for i in range(3)]
    preemptions = ahead.stats().num_preemptions
    assert outputs(ahead, prompts, params) == outputs(sync, prompts, params)
    assert ahead.stats().num_preemptions > preemptions  # the pool fits two of the three
    assert_idle(ahead)
    # an abort while two steps are in flight
    engine = ahead.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", p, params)
    for _ in range(4):
        engine.step()
    engine.abort_request(["abort-1"])
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    reference = outputs(sync, prompts, params)
    assert finished == {"abort-0": reference[0][0], "abort-2": reference[2][0]}
    assert_idle(ahead)


def test_a_step_takes_the_longer_of_host_and_device_work_not_their_sum(default_model):
    """The forward made a fixed 80 ms longer, sleeping (it releases the GIL, as a device at
    work), scheduling 80 ms longer on the engine's thread: with async scheduling a step costs
    about one of them plus the real work, without it both."""
    delay = 0.08

    def slowed(llm: LLM) -> float:
        core = llm.engine.core
        worker, scheduler = core.executor.worker, core.scheduler
        execute, schedule = worker.execute_model, scheduler.schedule

        def slow_execute(output):
            time.sleep(delay)
            return execute(output)

        def slow_schedule():
            time.sleep(delay)
            return schedule()

        worker.execute_model, scheduler.schedule = slow_execute, slow_schedule
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(token_prompts([8]), params, use_tqdm=False)
        return (time.perf_counter() - start) / 12

    per_step = {}
    for on in (False, True):
        llm = LLM(default_model, async_scheduling=on, num_kv_blocks=16)
        per_step[on] = slowed(llm)
        llm.engine.shutdown()
    assert per_step[False] > 1.8 * delay  # host, then device
    assert per_step[True] < 0.75 * per_step[False], per_step  # host beside device


# ---- the scheduler alone ---------------------------------------------------------------------


def async_scheduler(**kwargs):
    scheduler = make_scheduler(**kwargs)
    scheduler.async_scheduling = True
    return scheduler


def test_a_request_runs_its_next_step_on_the_token_in_flight():
    scheduler = async_scheduler()
    scheduler.add_request(make_request("a", prompt(1, 6), max_tokens=5))
    first = scheduler.schedule()  # the prompt, sampling the first token
    second = scheduler.schedule()  # before the first came back
    assert second.num_scheduled_tokens == {"a": 1}
    (cached,) = second.scheduled_cached_reqs
    assert cached.takes_sampled_token and cached.new_token_ids == []
    assert cached.num_computed_tokens == 6  # the prompt, computed by the step in flight
    assert scheduler.in_flight == {"a": 2}
    assert scheduler.schedule().is_empty  # never more than one step ahead
    scheduler.update(first, ModelRunnerOutput({"a": [7]}))
    third = scheduler.schedule()  # its second step still in flight
    (cached,) = third.scheduled_cached_reqs
    assert cached.takes_sampled_token and cached.new_token_ids == []  # 7 is the worker's own
    assert cached.num_computed_tokens == 7
    scheduler.update(second, ModelRunnerOutput({"a": [8]}))
    scheduler.update(third, ModelRunnerOutput({"a": [9]}))
    assert scheduler.requests["a"].output_token_ids == [7, 8, 9]
    fourth = scheduler.schedule()  # nothing in flight: a step as without async scheduling
    (cached,) = fourth.scheduled_cached_reqs
    assert not cached.takes_sampled_token and cached.new_token_ids == [9]
    fifth = scheduler.schedule()  # the fourth's token is the 4th of 5: room for one more
    assert fifth.num_scheduled_tokens == {"a": 1}
    scheduler.update(fourth, ModelRunnerOutput({"a": [10]}))
    assert scheduler.schedule().is_empty  # the fifth's token is the last: nothing after it
    scheduler.update(fifth, ModelRunnerOutput({"a": [11]}))
    assert "a" not in scheduler.requests and scheduler.in_flight == {}
    assert_all_blocks_free(scheduler)


def test_the_token_of_a_step_past_a_stop_is_dropped_and_its_blocks_freed():
    scheduler = async_scheduler()
    scheduler.add_request(make_request("a", prompt(1, 2 * BS), max_tokens=20))
    first = scheduler.schedule()
    second = scheduler.schedule()  # its slot opens a new block
    assert len(scheduler.kv_manager.get_block_ids("a")) == 3
    updated = scheduler.update(first, ModelRunnerOutput({"a": [0]}))  # EOS
    assert [(r.request_id, tokens) for r, tokens in updated] == [("a", [0])]
    assert scheduler.update(second, ModelRunnerOutput({"a": [5]})) == []
    assert scheduler.pending_drops == ["a"]
    assert scheduler.in_flight == {}
    assert_all_blocks_free(scheduler)


def test_a_step_that_forks_or_a_prompt_chunk_is_not_run_ahead():
    scheduler = async_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("long", prompt(1, 12)))  # two chunks
    scheduler.add_request(make_request("n", prompt(50, 3), n=2))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"long": 8}
    assert scheduler.schedule().num_scheduled_tokens == {"n#0": 3}  # "long" waits for its chunk
    scheduler.update(first, ModelRunnerOutput({}))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"long": 4}  # "n#0" forked: its children must see it
    assert not any(c.takes_sampled_token for c in second.scheduled_cached_reqs)

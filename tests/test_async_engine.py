"""AsyncLLM: requests stream cumulative outputs from one background step loop, concurrent requests
share its steps, and a stream that is left early aborts its request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import threading

import pytest
from conftest import assert_idle, greedy
from server_utils import wait_until
from transformers import PreTrainedTokenizerBase

from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine import async_engine
from quire.engine.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from quire.engine.metrics import EngineMetrics
from quire.executor.uniproc import UniprocExecutor

NUM_KV_BLOCKS = 512
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello, my name is"]


def engine_config(model: str) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def assert_idle_with_all_blocks_free(llm: AsyncLLM) -> None:
    """The idle invariant, and the running-requests gauge back at 0."""
    assert_idle(llm)
    assert wait_until(lambda: sample(llm, "quire:num_requests_running") == 0)


def sample(llm: AsyncLLM, name: str, labels: dict[str, str] | None = None) -> float:
    labels = {"model_name": llm.engine.config.model, **(labels or {})}
    return llm.metrics.registry.get_sample_value(name, labels) or 0.0


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str | None = None):
    return [output async for output in llm.generate(prompt, params, request_id)]


@pytest.fixture(scope="module")
def async_llm(tiny_llama):
    llm = AsyncLLM.from_engine_config(engine_config(tiny_llama))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline_token_ids(tiny_llama) -> list[list[int]]:
    llm = LLM.from_engine_config(engine_config(tiny_llama))
    outputs = llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_generate_streams_cumulative_outputs_until_the_last_is_finished(async_llm):
    outputs = run(collect(async_llm, PROMPTS[0], greedy(8)))
    assert len(outputs) > 1
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    for before, after in zip(outputs, outputs[1:]):
        assert after.outputs[0].text.startswith(before.outputs[0].text)
        assert after.outputs[0].token_ids[: len(before.outputs[0].token_ids)] == (
            before.outputs[0].token_ids
        )
    assert len(outputs[-1].outputs[0].token_ids) == 8
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert_idle_with_all_blocks_free(async_llm)


def test_concurrent_requests_give_the_offline_engine_outputs(async_llm, offline_token_ids):
    async def all_prompts():
        return await asyncio.gather(*(collect(async_llm, p, greedy(8)) for p in PROMPTS))

    results = run(all_prompts())
    assert [r[-1].outputs[0].token_ids for r in results] == offline_token_ids


def test_concurrent_requests_share_engine_steps(async_llm):
    num_requests, max_tokens = 16, 8
    steps_before = async_llm.engine.num_steps

    async def many():
        prompts = [f"Request {i} says" for i in range(num_requests)]
        return await asyncio.gather(*(collect(async_llm, p, greedy(max_tokens)) for p in prompts))

    results = run(many())
    steps = async_llm.engine.num_steps - steps_before
    assert all(len(r[-1].outputs[0].token_ids) == max_tokens for r in results)
    # Alone, each request would take max_tokens steps: 128 in all.
    assert steps <= num_requests * max_tokens // 4
    assert_idle_with_all_blocks_free(async_llm)


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_blocks(async_llm):
    aborted_before = sample(async_llm, "quire:request_success_total", {"finished_reason": "abort"})

    async def read_two_outputs():
        seen = 0
        async for _ in async_llm.generate(PROMPTS[1], greedy(500)):
            seen += 1
            if seen == 2:
                break

    run(read_two_outputs())
    assert_idle_with_all_blocks_free(async_llm)
    aborted = sample(async_llm, "quire:request_success_total", {"finished_reason": "abort"})
    assert aborted == aborted_before + 1


def test_cancelling_the_consuming_task_aborts_its_request(async_llm):
    async def cancel_midway():
        started = asyncio.Event()

        async def consume():
            async for _ in async_llm.generate(PROMPTS[2], greedy(500)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_midway())
    assert_idle_with_all_blocks_free(async_llm)


def test_a_slow_consumer_gets_the_newest_output_without_losing_text(async_llm):
    async def read_after_the_request_finished():
        stream = await async_llm.add_request("slow-reader", PROMPTS[3], greedy(12))
        assert wait_until(lambda: not async_llm.engine.has_unfinished_requests())
        await asyncio.sleep(0.1)  # the outputs' delivery to this loop
        return [output async for output in stream]

    outputs = run(read_after_the_request_finished())
    reference = run(collect(async_llm, PROMPTS[3], greedy(12)))[-1]
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].text == reference.outputs[0].text


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "The prompt is empty"),
        ([0, 49152], "Prompt token ids must be in [0, 49152)"),
        ("word " * 2000, "max_model_len is 1024"),
    ],
)
def test_bad_input_raises_value_error_and_the_engine_keeps_serving(async_llm, prompt, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        run(async_llm.add_request("bad", prompt, greedy(4)))
    outputs = run(collect(async_llm, PROMPTS[0], greedy(4), request_id="bad"))
    assert len(outputs[-1].outputs[0].token_ids) == 4
    assert_idle_with_all_blocks_free(async_llm)


def test_a_failing_step_fails_the_live_requests_and_the_loop_keeps_serving(async_llm, monkeypatch):
    assert_idle_with_all_blocks_free(async_llm)  # the loop thread is waiting: safe to patch
    execute = UniprocExecutor.submit
    calls = []

    def fail_once(executor, scheduler_output):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated kernel failure")
        return execute(executor, scheduler_output)

    monkeypatch.setattr(UniprocExecutor, "submit", fail_once)
    with pytest.raises(RequestFailedError, match="simulated kernel failure"):
        run(collect(async_llm, PROMPTS[0], greedy(4)))
    assert_idle_with_all_blocks_free(async_llm)
    outputs = run(collect(async_llm, PROMPTS[0], greedy(4)))
    assert len(outputs[-1].outputs[0].token_ids) == 4
    assert async_llm.is_running


def test_metrics_count_tokens_latencies_and_finish_reasons(async_llm):
    before = {
        "prompt": sample(async_llm, "quire:prompt_tokens_total"),
        "generation": sample(async_llm, "quire:generation_tokens_total"),
        "length": sample(async_llm, "quire:request_success_total", {"finished_reason": "length"}),
        "ttft": sample(async_llm, "quire:time_to_first_token_seconds_count"),
        "queue": sample(async_llm, "quire:request_queue_time_seconds_count"),
        "e2e": sample(async_llm, "quire:e2e_request_latency_seconds_count"),
    }
    outputs = run(collect(async_llm, PROMPTS[0], greedy(6)))
    num_prompt_tokens = len(outputs[-1].prompt_token_ids)
    assert sample(async_llm, "quire:prompt_tokens_total") == before["prompt"] + num_prompt_tokens
    assert sample(async_llm, "quire:generation_tokens_total") == before["generation"] + 6
    assert (
        sample(async_llm, "quire:request_success_total", {"finished_reason": "length"})
        == before["length"] + 1
    )
    assert sample(async_llm, "quire:time_to_first_token_seconds_count") == before["ttft"] + 1
    assert sample(async_llm, "quire:request_queue_time_seconds_count") == before["queue"] + 1
    assert sample(async_llm, "quire:e2e_request_latency_seconds_count") == before["e2e"] + 1
    assert sample(async_llm, "quire:kv_cache_usage_perc") == 0.0


def test_shutdown_ends_live_streams_and_refuses_new_requests(tiny_llama):
    llm = AsyncLLM.from_engine_config(engine_config(tiny_llama))

    async def shut_down_midway():
        stream = await llm.add_request("live", PROMPTS[0], greedy(1000))
        await stream.__anext__()
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", PROMPTS[0], greedy(4))

    run(shut_down_midway())
    assert not llm.is_running


def test_each_request_and_the_periodic_stats_are_logged(tiny_llama, caplog):
    metrics = EngineMetrics("logged", log_stats_interval_s=0.001)
    llm = AsyncLLM.from_engine_config(engine_config(tiny_llama), metrics)
    try:
        with caplog.at_level(logging.INFO, logger="quire.engine.metrics"):
            run(collect(llm, PROMPTS[0], greedy(64), request_id="req-1"))
    finally:
        llm.shutdown()
    messages = [record.getMessage() for record in caplog.records]
    finished = [m for m in messages if m.startswith("Finished request req-1 (length): ")]
    assert len(finished) == 1 and "64 output tokens" in finished[0] and "TTFT" in finished[0]
    stats = [m for m in messages if m.startswith("Engine: 1 running, 0 waiting; KV cache")]
    assert stats and all("tokens/s" in m for m in stats)


def test_the_engine_is_built_on_the_engine_thread(tiny_llama, monkeypatch):
    built_on: list[str] = []

    class RecordingEngine(async_engine.LLMEngine):
        def __init__(self, config: EngineConfig) -> None:
            built_on.append(threading.current_thread().name)
            super().__init__(config)

    monkeypatch.setattr(async_engine, "LLMEngine", RecordingEngine)
    llm = AsyncLLM.from_engine_config(engine_config(tiny_llama))
    try:
        assert built_on == ["quire-engine"]
        assert llm.is_running
        assert len(run(collect(llm, PROMPTS[0], greedy(4)))[-1].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def _num_tokenizers() -> int:
    gc.unfreeze()  # an engine's start freezes its heap, which gc.get_objects() leaves out
    gc.collect()
    return sum(issubclass(type(o), PreTrainedTokenizerBase) for o in gc.get_objects())


def test_the_server_shares_the_engines_tokenizer(tiny_llama):
    """One tokenizer for the engine thread and the server's threads, which only read it: a copy
    for the server took as long to build as loading it, at every start."""
    before = _num_tokenizers()
    llm = AsyncLLM.from_engine_config(engine_config(tiny_llama))
    try:
        assert _num_tokenizers() - before == 1
        assert len(run(collect(llm, PROMPTS[0], greedy(4)))[-1].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_an_engine_that_fails_to_build_raises_in_the_caller(tmp_path):
    with pytest.raises(Exception) as failure:
        AsyncLLM.from_engine_config(EngineConfig(model=str(tmp_path / "missing")))
    assert str(tmp_path / "missing") in str(failure.value)


def test_an_engine_built_by_the_caller_is_served(tiny_llama, offline_token_ids):
    llm = AsyncLLM(LLM.from_engine_config(engine_config(tiny_llama)).engine)
    try:
        outputs = run(collect(llm, PROMPTS[0], greedy(8)))
    finally:
        llm.shutdown()
    assert outputs[-1].outputs[0].token_ids == offline_token_ids[0]

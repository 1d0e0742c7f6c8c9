"""The engine core in a process of its own: the same outputs as the core in process, aborts and
stop strings end sequences there too (every block free), a dead core is an error within
seconds, and the async front end serves through it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from conftest import make_llm

from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine.async_engine import AsyncLLM
from quire.engine.core_client import EngineCoreDiedError

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]


def completions(llm: LLM, params: SamplingParams) -> list[list[tuple]]:
    """Tokens, text and finish reason exactly; the float32 cumulative logprob to 1e-3 (two
    processes may pick other float32 matmul kernels, which round differently)."""
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        [
            (
                c.token_ids,
                c.text,
                c.finish_reason,
                c.cumulative_logprob and round(c.cumulative_logprob, 3),
            )
            for c in o.outputs
        ]
        for o in outputs
    ]


@pytest.fixture(scope="module")
def llms(tiny_llama):
    kwargs = dict(model=tiny_llama, dtype="float32", num_kv_blocks=64)
    in_process = LLM(**kwargs)
    separate = LLM(**kwargs, engine_core_process=True)
    yield in_process, separate
    separate.engine.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["e"], ignore_eos=True),
    ],
    ids=["greedy-logprobs", "seeded-n2", "stop-string"],
)
def test_a_core_process_gives_the_in_process_cores_outputs(llms, params):
    in_process, separate = llms
    assert completions(separate, params) == completions(in_process, params)


def test_an_abort_frees_the_blocks_in_the_core_process(llms):
    _, separate = llms
    engine = separate.engine
    engine.add_request("long", "Wait", SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.abort_request("long")
    assert not engine.has_unfinished_requests()
    # The core reports its state with each step: run one more request to read it.
    engine.add_request("short", "Hi", SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.core_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_a_killed_core_process_is_an_error_within_seconds(tiny_llama):
    llm = make_llm(tiny_llama, dtype="float32", engine_core_process=True)
    os.kill(llm.engine.core._process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineCoreDiedError, match="died"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 5
    llm.engine.shutdown()


def test_the_async_front_end_streams_through_a_core_process(tiny_llama):
    config = EngineConfig(model=tiny_llama, dtype="float32", num_kv_blocks=64)
    config.engine_core_process = True
    async_llm = AsyncLLM.from_engine_config(config)

    async def generate() -> list[int]:
        final = None
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        async for output in async_llm.generate(PROMPTS[0], params):
            final = output
        return final.outputs[0].token_ids

    try:
        tokens = asyncio.run(asyncio.wait_for(generate(), 60))
        assert len(tokens) == 6
    finally:
        async_llm.shutdown()

"""The multiprocess executor: the worker in a process of its own gives the in-process worker's
tokens; a worker that dies fails the step with a clear error, fast; shutdown ends it."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import SMALL_POOL, assert_idle, make_llm, process_exists, worker_pids

from quire import LLM, SamplingParams
from quire.executor.multiproc import WorkerDiedError

PROMPTS = [{"prompt_token_ids": [5, 9, 200, 17, 3]}, {"prompt_token_ids": list(range(50, 90))}]


def tokens(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def mp_llm(tiny_llama):
    llm = make_llm(tiny_llama, dtype="float32", distributed_executor_backend="mp")
    yield llm
    llm.engine.shutdown()


def test_a_worker_process_gives_the_in_process_workers_tokens(tiny_llama, mp_llm):
    params = SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=12, ignore_eos=True)
    uni = make_llm(tiny_llama, dtype="float32")
    assert tokens(mp_llm, params) == tokens(uni, params)
    assert_idle(mp_llm)


def test_the_worker_runs_in_a_process_of_its_own(mp_llm):
    (state,) = mp_llm.engine.worker_states()
    assert (state.rank, state.num_kv_blocks) == (0, SMALL_POOL)
    assert state.pid != os.getpid() and process_exists(state.pid)


def test_a_killed_worker_fails_the_step_within_seconds(tiny_llama):
    llm = make_llm(tiny_llama, dtype="float32", distributed_executor_backend="mp")
    (pid,) = worker_pids(llm)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 0 process died"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 5
    llm.engine.shutdown()


def test_a_worker_dead_before_the_step_is_sent_fails_it_as_a_death(tiny_llama):
    """Its end of the pipe already closed, sending the step fails (a broken pipe): that is
    reported as the rank's death, like one noticed while waiting."""
    llm = make_llm(tiny_llama, dtype="float32", distributed_executor_backend="mp")
    (pid,) = worker_pids(llm)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)  # dead, its sockets closed, before the engine sends anything
    with pytest.raises(WorkerDiedError, match="worker rank 0 process died"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    llm.engine.shutdown()


def test_shutdown_ends_the_worker_process(tiny_llama):
    llm = make_llm(tiny_llama, dtype="float32", distributed_executor_backend="mp")
    (pid,) = worker_pids(llm)
    assert process_exists(pid)
    llm.engine.shutdown()
    assert not process_exists(pid)

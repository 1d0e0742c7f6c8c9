"""The engine's state as tests and tools see it: `LLM.stats()` counts a known run exactly, and
`LLM.check_invariants()` passes on an idle engine and says what is wrong on a busy one."""

from __future__ import annotations

import pytest
from conftest import SMALL_POOL, greedy, make_llm

from quire.executor.uniproc import UniprocExecutor
from quire.kernels.cpu import gemv, qmatmul

PROMPT = {"prompt_token_ids": [(7 * j) % 500 + 10 for j in range(40)]}  # 2.5 blocks of 16


@pytest.fixture
def llm(tiny_llama):
    return make_llm(tiny_llama, dtype="bfloat16")


def test_a_new_engine_is_idle_with_every_block_free(llm):
    llm.check_invariants()
    stats = llm.stats()
    assert (stats.num_kv_blocks, stats.num_free_kv_blocks) == (SMALL_POOL, SMALL_POOL)
    assert (stats.num_running, stats.num_waiting, stats.num_steps) == (0, 0, 0)


def test_stats_count_the_steps_and_prefix_cache_of_two_runs_exactly(llm):
    """40 prompt tokens, 4 new ones: one prefill step and three decode steps a run; the second
    run finds the prompt's two full blocks (32 tokens) in the prefix cache."""
    for _ in range(2):
        llm.generate([PROMPT], greedy(4), use_tqdm=False)
    stats = llm.stats()
    assert stats.num_steps == 8
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)
    assert stats.num_preemptions == 0
    assert stats.num_free_kv_blocks == SMALL_POOL
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (0, 0)
    llm.check_invariants()


def test_stats_name_the_fast_paths_the_worker_runs(llm):
    stats = llm.stats()
    assert stats.c_decode_step == gemv.available()  # bf16 weights packed for the C GEMV
    assert not stats.cuda_graphs
    assert (stats.gemv_path, stats.qmatmul_path) == (gemv.path(), qmatmul.path())


def test_a_float32_engine_runs_no_c_decode_step(tiny_llama):
    assert not make_llm(tiny_llama, dtype="float32").stats().c_decode_step


def test_a_waiting_request_fails_the_check_and_is_counted(llm):
    llm.engine.add_request("w", PROMPT, greedy(4))
    assert (llm.stats().num_waiting, llm.stats().num_running) == (1, 0)
    with pytest.raises(AssertionError) as error:
        llm.check_invariants()
    assert str(error.value) == (
        "The engine is not idle: 1 request(s) unfinished (w); 1 request(s) waiting (w)."
    )


def test_a_request_held_unfinished_fails_the_check_with_its_blocks(llm):
    """After its prefill step a request holds the 3 blocks of its 41 slots; once aborted, every
    block is free again. The worker drops it at the next step, which the check allows."""
    llm.engine.add_request("r", PROMPT, greedy(4))
    llm.engine.step()
    stats = llm.stats()
    assert (stats.num_running, stats.num_free_kv_blocks) == (1, SMALL_POOL - 3)
    with pytest.raises(AssertionError) as error:
        llm.check_invariants()
    assert str(error.value) == (
        "The engine is not idle: 1 request(s) unfinished (r); 1 request(s) running (r); "
        f"3 of {SMALL_POOL} KV blocks not free (held by r); rank 0 holds request(s) ['r'] in its "
        "batch."
    )
    llm.engine.abort_request("r")
    assert [s.request_ids for s in llm.engine.worker_states()] == [("r",)]
    llm.check_invariants()
    llm.generate([PROMPT], greedy(1), use_tqdm=False)
    assert [s.request_ids for s in llm.engine.worker_states()] == [("0",)]
    llm.check_invariants()


def test_speculative_decoding_counters_are_exact_with_the_target_as_its_own_draft(tiny_llama):
    """k = 3, 1 + 5 (k + 1) new tokens: after the first token, five steps each verify three
    proposals, and a draft equal to the target has all of them accepted."""
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    llm = make_llm(tiny_llama, dtype="bfloat16", speculative_config=spec)
    llm.generate([PROMPT], greedy(21), use_tqdm=False)
    stats = llm.stats()
    assert (
        stats.spec_decode_num_drafts,
        stats.spec_decode_num_draft_tokens,
        stats.spec_decode_num_accepted_tokens,
    ) == (5, 15, 15)
    assert stats.num_steps == 6
    llm.check_invariants()


def test_an_engine_core_process_refuses_to_be_inspected(tiny_llama):
    llm = make_llm(tiny_llama, dtype="float32", engine_core_process=True)
    try:
        with pytest.raises(RuntimeError, match="engine_core_process=False"):
            llm.check_invariants()
        with pytest.raises(RuntimeError, match="engine_core_process=False"):
            llm.stats()
    finally:
        llm.engine.shutdown()


def test_a_failed_step_leaves_no_request_on_the_worker(llm, monkeypatch):
    """The step that fails carries the drop of the request finished before it: the next step
    sends that drop again, so the worker ends up holding the last request only."""
    llm.generate([PROMPT], greedy(2), use_tqdm=False)  # request "0", dropped by the next step
    execute = UniprocExecutor.submit

    def fail_once(executor, scheduler_output):
        monkeypatch.setattr(UniprocExecutor, "submit", execute)
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(UniprocExecutor, "submit", fail_once)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        llm.generate([PROMPT], greedy(2), use_tqdm=False)  # request "1"
    llm.check_invariants()
    llm.generate([PROMPT], greedy(2), use_tqdm=False)  # request "2"
    assert [s.request_ids for s in llm.engine.worker_states()] == [("2",)]
    llm.check_invariants()

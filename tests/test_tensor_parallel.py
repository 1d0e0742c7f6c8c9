"""Tensor parallelism end to end (CPU, gloo): greedy tokens with two ranks (four where KV heads
are replicated, three for the default model) equal one rank's in float32 up to the first
near-tie, with close logprobs (vLLM's check_logprobs_close rule); unsupported splits fail at
start, before anything loads, naming the sizes that work; abort and preemption free every block;
a killed rank fails the engine fast; shutdown ends every rank."""

from __future__ import annotations

import math
import os
import signal
import time

import httpx
import pytest
from conftest import assert_idle, make_llm, process_exists, worker_pids
from test_quantized_gguf import PROSE

from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine.async_engine import AsyncLLM
from quire.engine.metrics import EngineMetrics
from quire.entrypoints.api_server import build_app
from quire.entrypoints.cli import main
from quire.executor.multiproc import WorkerDiedError, rank_cores

PROMPTS = [
    {"prompt_token_ids": [5, 9, 200, 17, 3]},
    {"prompt_token_ids": list(range(50, 90))},
    {"prompt_token_ids": [1000 + 7 * i for i in range(23)]},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
TIE_GAP = 1e-4  # top-2 logit gap under which two rank counts may pick different tokens
LOGPROB_ATOL = 1e-4

# arch -> config overrides: GQA with head_dim != hidden / heads, a vocabulary and an MLP that do
# not divide by two ranks (llama); qkv bias with one KV head (qwen2); q/k norm with one KV head,
# replicated on both ranks (qwen3).
CASES = {
    "llama": dict(vocab_size=49153, intermediate_size=129),
    "qwen2": dict(),
    "qwen3": dict(num_key_value_heads=1),
}


def run(llm: LLM, params: SamplingParams = GREEDY):
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def assert_close_greedy(want, got, tie_gap: float = TIE_GAP, atol: float = LOGPROB_ATOL) -> None:
    """Tokens equal up to the first position whose top-2 logprob gap (the logit gap) in the
    reference is below `tie_gap`; the chosen tokens' logprobs within `atol` until there."""
    for ref, out in zip(want, got):
        for i, (ref_token, token) in enumerate(zip(ref.token_ids, out.token_ids)):
            top2 = sorted((lp.logprob for lp in ref.logprobs[i].values()), reverse=True)[:2]
            if top2[0] - top2[1] < tie_gap:
                break
            assert token == ref_token, f"position {i}: {out.token_ids} != {ref.token_ids}"
            assert abs(out.logprobs[i][token].logprob - ref.logprobs[i][token].logprob) < atol
        else:
            assert len(out.token_ids) == len(ref.token_ids)


@pytest.fixture(scope="module")
def models(build_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_models")
    return {arch: build_model(str(root / arch), arch, **o) for arch, o in CASES.items()}


def two_ranks(model: str, **kwargs) -> LLM:
    return LLM(model, dtype="float32", tensor_parallel_size=2, **kwargs)


# 6 blocks of 16 tokens: the prompts below do not all fit at once, so requests are preempted
SMALL_POOL = dict(num_kv_blocks=6, max_model_len=96)


@pytest.fixture(scope="module")
def tp_llama(models):
    """Two-rank tiny Llama, shared by the tests below; the last one kills a rank."""
    llm = two_ranks(models["llama"], **SMALL_POOL)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def tp_qwen(models):
    """Two-rank Qwen2 and Qwen3; the server test ends Qwen2's, the shutdown test Qwen3's."""
    engines = {arch: two_ranks(models[arch], num_kv_blocks=64) for arch in ("qwen2", "qwen3")}
    yield engines
    for llm in engines.values():
        llm.engine.shutdown()


def test_two_ranks_give_one_ranks_greedy_tokens_llama(models, tp_llama):
    one = LLM(models["llama"], dtype="float32", **SMALL_POOL)
    assert_close_greedy(run(one), run(tp_llama))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_two_ranks_give_one_ranks_greedy_tokens(models, tp_qwen, arch):
    one = make_llm(models[arch], dtype="float32")
    assert_close_greedy(run(one), run(tp_qwen[arch]))


def test_four_ranks_replicate_kv_heads_and_give_one_ranks_greedy_tokens(models):
    """llama's 4 query heads and 2 KV heads on 4 ranks: each rank holds one query head and the
    KV head it reads (ranks 0 and 1 KV head 0, ranks 2 and 3 KV head 1). Few tokens: four
    processes share this host's cores."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    small = dict(dtype="float32", num_kv_blocks=8, max_model_len=128)
    one = LLM(models["llama"], **small)
    four = LLM(models["llama"], tensor_parallel_size=4, **small)
    try:
        assert_close_greedy(run(one, params), run(four, params))
    finally:
        four.engine.shutdown()


def test_shutdown_ends_every_rank(tp_qwen):
    pids = worker_pids(tp_qwen["qwen3"])
    assert len(pids) == 2 and all(map(process_exists, pids))
    tp_qwen["qwen3"].engine.shutdown()
    assert not any(map(process_exists, pids))


def test_the_server_answers_with_two_ranks(tp_qwen):
    from test_api_server import ServerThread

    engine = tp_qwen["qwen2"].engine
    pids = worker_pids(tp_qwen["qwen2"])
    async_engine = AsyncLLM(engine, EngineMetrics("tiny"))
    server = ServerThread(build_app(async_engine, "tiny"))
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 5
    finally:
        server.stop()
        async_engine.shutdown()
    assert not any(map(process_exists, pids))


def test_default_model_refuses_two_ranks_naming_the_sizes_that_work(default_model, tokenizer_dir):
    with pytest.raises(ValueError, match="9 query heads and 3 KV heads; sizes that work: 1, 3, 9"):
        LLM(default_model, tensor_parallel_size=2, tokenizer=tokenizer_dir)


def test_quire_generate_refuses_two_ranks_of_the_default_model_within_a_second(capsys):
    # the head counts come from the GGUF header: no weights, no tokenizer, no worker is loaded
    start = time.perf_counter()
    assert main(["generate", "-tp", "2", "What is the capital of Japan?"]) == 2
    assert time.perf_counter() - start < 1.0
    assert capsys.readouterr().err == (
        "error: tensor_parallel_size 2 cannot split SmolLM2-135M-Instruct.Q4_1.gguf's 9 query "
        "heads and 3 KV heads; sizes that work: 1, 3, 9.\n"
    )


def test_default_model_runs_on_three_ranks(default_model, tokenizer_dir):
    # the saved tokenizer: no second parse of the GGUF file's 49k token strings per engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    small = dict(dtype="float32", num_kv_blocks=16, max_model_len=256, tokenizer=tokenizer_dir)
    one = LLM(default_model, **small)
    three = LLM(default_model, tensor_parallel_size=3, **small)
    try:
        prompts = PROMPTS[:1]
        want = [o.outputs[0] for o in one.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0] for o in three.generate(prompts, params, use_tqdm=False)]
        assert_close_greedy(want, got)
    finally:
        three.engine.shutdown()


# bf16 logits of SmolLM2 are ~16-32: a step of 0.125 there. Splitting a sum over three ranks
# rounds each part and their sum; with int8 activations such a change can move a code by one
# step of its block, and after 30 layers a logprob by up to ~0.3 (0.15 dequantized).
BF16_TIE_GAP = 0.5
BF16_LOGPROB_ATOL = 0.5
TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


def test_default_model_keeps_its_blocks_on_three_ranks(default_model, tokenizer_dir):
    """Q4_1 blocks cut per rank (o_proj: 192 input features a rank, down_proj 512: whole
    blocks), the C step on each rank: one rank's greedy tokens up to bf16 near-ties, and a
    text's token logprobs as close as two bf16 sum orders get (prompt rows quantized to int8
    amplify a last bit, so the perplexity moves by a few percent; measured in BENCHMARKS.md,
    "AVX2 prefill attention")."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    small = dict(num_kv_blocks=16, max_model_len=256, tokenizer=tokenizer_dir)
    results = []
    for tp in (1, 3):
        llm = LLM(default_model, tensor_parallel_size=tp, **small)
        try:
            greedy, ppl = llm.generate([TEXT, PROSE], [params, scored], use_tqdm=False)
            logprobs = [
                d[t].logprob for d, t in zip(ppl.prompt_logprobs[1:], ppl.prompt_token_ids[1:])
            ]
            results.append((greedy.outputs[0], logprobs))
        finally:
            llm.engine.shutdown()
    (one, one_lp), (three, three_lp) = results
    assert one.token_ids[:2] == three.token_ids[:2]  # " Rome."
    assert_close_greedy([one], [three], BF16_TIE_GAP, BF16_LOGPROB_ATOL)
    apart = sum(abs(a - b) for a, b in zip(one_lp, three_lp, strict=True)) / len(one_lp)
    assert apart < 0.15, apart
    one_ppl, three_ppl = (math.exp(-sum(lp) / len(lp)) for lp in (one_lp, three_lp))
    assert abs(three_ppl / one_ppl - 1) < 0.04, (three_ppl, one_ppl)


def test_heads_not_divisible_fail_at_start(models):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 .* sizes that work: 1, 2, 4"):
        LLM(models["llama"], dtype="float32", tensor_parallel_size=3)


def test_tensor_parallel_runs_a_process_per_rank(tp_llama):
    states = tp_llama.engine.worker_states()
    assert [s.rank for s in states] == [0, 1]
    assert len({os.getpid(), *(s.pid for s in states)}) == 3
    assert [s.num_kv_blocks for s in states] == [tp_llama.stats().num_kv_blocks] * 2
    assert EngineConfig(tensor_parallel_size=3).distributed_executor_backend == "mp"


def test_ranks_get_disjoint_cores():
    cores = sorted(os.sched_getaffinity(0))
    shares = [rank_cores(r, 2) for r in range(2)]
    if len(cores) < 2:
        assert shares == [None, None]
    else:
        assert set(shares[0]).isdisjoint(shares[1])
        assert len(shares[0]) == len(shares[1]) == len(cores) // 2


def assert_preemption_and_abort_free_every_block(llm: LLM, steps_before_abort: int = 1) -> None:
    """Three 40-token prompts that do not all fit `llm`'s small pool run to 30 tokens each, with
    preemptions, and leave every block free; so do the same prompts aborted after
    `steps_before_abort` steps."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 * i + 10, 100 * i + 50))} for i in range(3)]
    preemptions = llm.stats().num_preemptions
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [30, 30, 30]
    assert llm.stats().num_preemptions > preemptions
    assert_idle(llm)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, params)
    for _ in range(steps_before_abort):
        engine.step()
    engine.abort_request([f"abort-{i}" for i in range(3)])
    assert_idle(llm)


def test_preemption_and_abort_free_every_block(tp_llama):
    assert_preemption_and_abort_free_every_block(tp_llama)


def test_a_killed_rank_fails_the_engine_within_seconds(tp_llama):
    pids = worker_pids(tp_llama)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 process died"):
        tp_llama.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 5
    assert not any(map(process_exists, pids))  # rank 0 ended too


def test_an_engine_core_process_with_ranks_is_refused_at_start():
    with pytest.raises(ValueError, match="engine_core_process cannot start worker processes"):
        EngineConfig(tensor_parallel_size=2, engine_core_process=True)

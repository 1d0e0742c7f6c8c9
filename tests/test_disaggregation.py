"""Prefill/decode disaggregation in the engine: a prefill engine computes the prompt and leases
its blocks, a decode engine pulls them over the KV transport and generates the rest; the tokens
are those of one collocated engine, and every block is free afterwards."""

from __future__ import annotations

import itertools

import pytest
from conftest import assert_idle

from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine.llm_engine import LLMEngine

BLOCK = 16
CHUNK = 24  # max_num_batched_tokens: a prompt longer than this prefills in chunks
_ids = itertools.count()


def prompt(length: int, salt: int = 0) -> dict:
    return {"prompt_token_ids": [(37 * j + 101 * salt) % 40000 + 10 for j in range(length)]}


PROMPTS = {
    "shorter than a block": prompt(5, 1),
    "exactly two blocks": prompt(2 * BLOCK, 2),
    "longer than a chunk": prompt(CHUNK + 2 * BLOCK + 3, 3),
}


def engine(model: str, **kwargs) -> LLMEngine:
    settings = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK)
    return LLMEngine(EngineConfig(model=model, **{**settings, "num_kv_blocks": 48, **kwargs}))


@pytest.fixture(scope="module")
def prefill(tiny_llama):
    eng = engine(tiny_llama, disaggregation_mode="prefill", kv_lease_timeout=2.0)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def decode(tiny_llama):
    eng = engine(tiny_llama, disaggregation_mode="decode", kv_transfer_timeout=2.0)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def collocated(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK)


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kwargs})


def run_until_idle(*engines: LLMEngine, outputs: dict | None = None) -> dict:
    """Steps every engine until none has work; the last output of each request by id."""
    outputs = {} if outputs is None else outputs
    while any(e.has_unfinished_requests() or e.has_kv_transfers() for e in engines):
        for e in engines:
            for out in e.step():
                outputs[out.request_id] = out
    return outputs


def disaggregated(prefill: LLMEngine, decode: LLMEngine, prompt: dict, sampling: SamplingParams):
    """The request through the prefill engine (first token, blocks leased), then the decode
    engine (blocks pulled): the decode engine's final output."""
    transfer_id = f"t{next(_ids)}"
    prefill_params = sampling.clone()
    prefill_params.max_tokens = 1
    prefill_params.kv_transfer_params = {"do_remote_decode": True, "transfer_id": transfer_id}
    prefill.add_request(f"p-{transfer_id}", prompt, prefill_params)
    while prefill.has_unfinished_requests():  # its lease stays: nothing pulled it yet
        prefill.step()
    decode_params = sampling.clone()
    decode_params.kv_transfer_params = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_host": prefill.config.kv_host,
        "remote_port": prefill.quire_config.kv_transfer.port,
    }
    request_id = f"d-{transfer_id}"
    decode.add_request(request_id, prompt, decode_params)
    return run_until_idle(prefill, decode)[request_id]


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_tokens_equal_collocated(prefill, decode, collocated, name):
    expected = collocated.generate([PROMPTS[name]], params(), use_tqdm=False)[0]
    got = disaggregated(prefill, decode, PROMPTS[name], params())
    assert got.finished
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert_idle(prefill, decode)


def test_seeded_sampling_equals_collocated(prefill, decode, collocated):
    sampling = params(temperature=1.0, top_k=20, seed=1234)
    expected = collocated.generate([PROMPTS["longer than a chunk"]], sampling, use_tqdm=False)[0]
    got = disaggregated(prefill, decode, PROMPTS["longer than a chunk"], sampling)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert_idle(prefill, decode)


def test_n_sequences_with_logprobs_equal_collocated(prefill, decode, collocated):
    """Each of the n sequences' first tokens (and their logprobs) comes from the prefill
    instance; the decode instance forks the n sequences over the received blocks."""
    sampling = params(temperature=0.8, seed=99, n=3, logprobs=2)
    expected = collocated.generate([PROMPTS["exactly two blocks"]], sampling, use_tqdm=False)[0]
    got = disaggregated(prefill, decode, PROMPTS["exactly two blocks"], sampling)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in expected.outputs]
    for mine, theirs in zip(got.outputs, expected.outputs):
        assert len(mine.logprobs) == len(theirs.logprobs) == 12
        assert mine.logprobs[0].keys() == theirs.logprobs[0].keys()
        assert mine.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-4)
    assert_idle(prefill, decode)


def test_prefix_cached_on_decode_side_is_not_transferred(prefill, decode, collocated):
    shared = prompt(3 * BLOCK, 7)["prompt_token_ids"]
    first = {"prompt_token_ids": shared + [11, 12, 13]}
    second = {"prompt_token_ids": shared + [21, 22, 23, 24]}
    disaggregated(prefill, decode, first, params())
    blocks_before = decode.core_stats().kv_transfer.num_blocks
    got = disaggregated(prefill, decode, second, params())
    moved = decode.core_stats().kv_transfer.num_blocks - blocks_before
    assert moved == 1  # the three shared blocks were cached on the decode side: only the last
    assert got.num_cached_tokens == 3 * BLOCK
    expected = collocated.generate([second], params(), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert_idle(prefill, decode)


def test_bytes_moved_are_blocks_times_block_bytes(prefill, decode):
    stats = decode.core_stats().kv_transfer
    before_bytes, before_blocks = stats.num_bytes, stats.num_blocks
    disaggregated(prefill, decode, prompt(2 * BLOCK + 1, 9), params(max_tokens=2))
    stats = decode.core_stats().kv_transfer
    model = decode.model_config
    block_bytes = 2 * model.num_hidden_layers * BLOCK * model.num_key_value_heads
    block_bytes *= model.head_dim * 4  # float32
    assert stats.num_blocks - before_blocks == 3
    assert stats.num_bytes - before_bytes == 3 * block_bytes


def remote(transfer_id: str, port: int, host: str = "127.0.0.1", **kwargs) -> SamplingParams:
    sampling = params(**kwargs)
    sampling.kv_transfer_params = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_host": host,
        "remote_port": port,
    }
    return sampling


def silent_port() -> int:
    """A port where nothing listens: a pull there is never answered."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_abort_while_waiting_for_kv_frees_its_blocks(decode):
    decode.add_request("waits", prompt(40, 11), remote("nowhere", silent_port()))
    decode.step()
    with pytest.raises(AssertionError, match=r"1 request\(s\) waiting for K/V \(waits\)"):
        decode.check_invariants()
    stats = decode.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks - 3
    decode.abort_request("waits")
    run_until_idle(decode)
    assert_idle(decode)


def test_transfer_that_times_out_fails_with_a_clear_error(decode):
    port = silent_port()
    decode.add_request("times-out", prompt(20, 12), remote("lost", port))
    out = run_until_idle(decode)["times-out"]
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert out.outputs[0].stop_reason.startswith("KV transfer failed")
    assert f"127.0.0.1:{port} did not answer within 2 s" in out.outputs[0].stop_reason
    assert decode.core_stats().kv_transfer.num_failed >= 1
    assert_idle(decode)


def test_unpulled_lease_runs_out_and_a_late_pull_fails(prefill, decode):
    sampling = params(max_tokens=1)
    sampling.kv_transfer_params = {"do_remote_decode": True, "transfer_id": "late"}
    prefill.add_request("never-pulled", prompt(20, 13), sampling)
    run_until_idle(prefill)  # until its lease (2 s) runs out
    assert_idle(prefill)
    assert prefill.core_stats().kv_transfer.num_leases_expired >= 1
    decode.add_request(
        "late", prompt(20, 13), remote("late", prefill.quire_config.kv_transfer.port)
    )
    out = run_until_idle(decode)["late"]
    assert "no KV leased under transfer id 'late'" in out.outputs[0].stop_reason
    assert_idle(decode)


def test_incompatible_instances_are_refused(tiny_llama, prefill):
    other = engine(tiny_llama, disaggregation_mode="decode", block_size=2 * BLOCK)
    expired = prefill.core_stats().kv_transfer.num_leases_expired
    try:
        sampling = params(max_tokens=1)
        sampling.kv_transfer_params = {"do_remote_decode": True, "transfer_id": "mismatch"}
        prefill.add_request("mismatch-p", prompt(20, 14), sampling)
        while prefill.has_unfinished_requests():
            prefill.step()
        other.add_request(
            "mismatch", prompt(20, 14), remote("mismatch", prefill.quire_config.kv_transfer.port)
        )
        out = run_until_idle(other, prefill)["mismatch"]
        reason = out.outputs[0].stop_reason
        assert reason == (
            "KV transfer failed: incompatible prefill and decode instances: block_size 16 on "
            "the prefill instance, 32 on the decode instance"
        )
        assert prefill.core_stats().kv_transfer.num_leases_expired == expired  # ended at once
        assert_idle(other, prefill)
    finally:
        other.shutdown()


def test_default_model_greedy_tokens_equal_collocated(default_model):
    """SmolLM2 in its own dtype (bf16 where the CPU runs it): the prompt's KV computed by one
    engine and decoded by another gives the bits of one engine computing it all (the decode
    engine itself, given the request without kv_transfer_params)."""
    kwargs = dict(dtype="auto", num_kv_blocks=16)
    prefill = engine(default_model, disaggregation_mode="prefill", **kwargs)
    decode = engine(default_model, disaggregation_mode="decode", **kwargs)
    try:
        sampling = params(max_tokens=8)
        got = disaggregated(prefill, decode, PROMPTS["longer than a chunk"], sampling)
        decode.reset_prefix_cache()  # computes it all, not from the received KV
        decode.add_request("collocated", PROMPTS["longer than a chunk"], sampling)
        expected = run_until_idle(decode)["collocated"]
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert_idle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_request_preempted_on_the_decode_side_is_recomputed_there(
    tiny_llama, prefill, collocated
):
    """Two requests that do not both fit in 8 blocks: one is preempted after its KV arrived,
    and recomputed on the decode instance from its own prefix cache."""
    small = engine(tiny_llama, disaggregation_mode="decode", num_kv_blocks=8)
    try:
        prompts = [prompt(40, 21), prompt(40, 22)]
        sampling = params(max_tokens=40)
        for i, p in enumerate(prompts):
            prefill_params = sampling.clone()
            prefill_params.max_tokens = 1
            prefill_params.kv_transfer_params = {"do_remote_decode": True, "transfer_id": f"pre{i}"}
            prefill.add_request(f"pre-p{i}", p, prefill_params)
        while prefill.has_unfinished_requests():
            prefill.step()
        for i, p in enumerate(prompts):
            small.add_request(
                f"pre{i}",
                p,
                remote(f"pre{i}", prefill.quire_config.kv_transfer.port, max_tokens=40),
            )
        got = run_until_idle(small, prefill)
        assert small.stats().num_preemptions >= 1
        expected = collocated.generate(prompts, sampling, use_tqdm=False)
        assert [got[f"pre{i}"].outputs[0].token_ids for i in range(2)] == [
            e.outputs[0].token_ids for e in expected
        ]
        assert_idle(small, prefill)
    finally:
        small.shutdown()


def test_an_int8_kv_cache_moves_with_its_scales(build_model, tmp_path_factory):
    """Quantized rows carry their scales, so a pulled int8 cache decodes as a collocated one."""
    import torch

    model = build_model(
        str(tmp_path_factory.mktemp("int8-kv")),
        "llama",
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        dtype=torch.bfloat16,
    )
    kv = dict(dtype="bfloat16", kv_cache_dtype="int8")
    prefill_engine = engine(model, disaggregation_mode="prefill", **kv)
    decode_engine = engine(model, disaggregation_mode="decode", **kv)
    try:
        request = PROMPTS["longer than a chunk"]
        out = disaggregated(prefill_engine, decode_engine, request, params())
        collocated = LLM(
            model=model, block_size=BLOCK, max_num_batched_tokens=CHUNK, num_kv_blocks=48, **kv
        )
        expected = collocated.generate([request], params(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert_idle(prefill_engine, decode_engine)
    finally:
        prefill_engine.shutdown()
        decode_engine.shutdown()

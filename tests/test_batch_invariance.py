"""bfloat16 outputs do not depend on the batch: a request's tokens and logprobs are the same bits
whether it runs alone or beside others, whatever chunk sizes the token budget gives its prompt,
and whether a prefix-cache hit leaves one prompt token or many to compute; with a bf16, int8 or
fp8 KV cache alike (a quantized token's row is set once, from that token alone).

The model takes the CPU kernel paths (head_dim 64) and has a projection with K > 1,024 (the MLP's
down projection), where oneDNN's summation order changes with the number of rows; a prompt whose
uncached tail is one token must still go through the prefill kernel, not the decode kernel."""

from __future__ import annotations

import pytest
from conftest import token_prompts

from quire import LLM, SamplingParams

# Lengths around the block size (16) and the chunk budget below: prefix-cache hits leave 1 or 2
# tokens to compute, and chunking leaves last chunks of one token.
LENGTHS = [97, 33, 65, 17, 210, 5, 130, 48]
KV_MEMORY = 64 << 20  # ~60k tokens of this model's bf16 cache: far more than a run holds


def run(llm: LLM, batch: list[dict], max_tokens: int = 6) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    out = []
    for o in llm.generate(batch, params, use_tqdm=False):
        seq = o.outputs[0]
        out.append((seq.token_ids, [next(iter(d.values())).logprob for d in seq.logprobs]))
    return out


@pytest.fixture(scope="module")
def model_dir(build_model, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("invariance"))
    return build_model(
        path,
        "llama",
        hidden_size=128,
        intermediate_size=1088,  # down projection: K = 1,088 > 1,024
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )


@pytest.fixture(scope="module", params=["auto", "int8", "fp8"])
def kv_cache_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def alone(model_dir, kv_cache_dtype) -> list[tuple[list[int], list[float]]]:
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=KV_MEMORY,
    )
    return [run(llm, [p])[0] for p in token_prompts(LENGTHS)]


@pytest.mark.parametrize(
    "budget, max_seqs", [(2048, 256), (64, 3), (24, 8)], ids=["one-step", "chunks-64", "chunks-24"]
)
def test_a_batch_gives_each_request_its_bits_alone(
    model_dir, kv_cache_dtype, alone, budget, max_seqs
) -> None:
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=KV_MEMORY,
    )
    assert run(llm, token_prompts(LENGTHS)) == alone
    # Again: now every prompt's full blocks are cached, and only its tail is computed.
    assert run(llm, token_prompts(LENGTHS)) == alone
    assert run(llm, token_prompts(LENGTHS)[::-1]) == alone[::-1]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_preemption_by_recompute_keeps_each_request_its_bits(model_dir, quantization, monkeypatch):
    """A pool too small for the batch preempts requests that have generated tokens already. A
    resumed request replays them in a chunk that the runner runs as one decode per token, so its
    later tokens and logprobs are its bits alone (recomputed as part of a prompt chunk, they went
    through the prefill kernel and drifted). With int8 weights the replayed rows also keep the
    generated tokens' int8 sums where prompt rows take AMX tiles (qmatmul.prompt_path)."""
    from quire.engine.scheduler import Scheduler

    prompts = token_prompts(LENGTHS)
    kwargs = dict(dtype="bfloat16", quantization=quantization)
    llm = LLM(model_dir, enable_prefix_caching=False, **kwargs)
    alone = [run(llm, [p], max_tokens=40)[0] for p in prompts]

    preempted_outputs, replayed = [], []
    preempt, schedule = Scheduler._preempt, Scheduler.schedule

    def record_preemption(self, request):
        preempted_outputs.append(request.num_output_tokens)
        preempt(self, request)

    def record_replays(self):
        output = schedule(self)
        replayed.extend(
            n
            for i, n in output.num_scheduled_tokens.items()
            if self.requests[i].num_computed_tokens >= self.requests[i].num_prompt_tokens
        )
        return output

    monkeypatch.setattr(Scheduler, "_preempt", record_preemption)
    monkeypatch.setattr(Scheduler, "schedule", record_replays)
    llm = LLM(model_dir, num_kv_blocks=24, max_num_batched_tokens=64, **kwargs)
    assert run(llm, prompts, max_tokens=40) == alone
    assert sum(n > 0 for n in preempted_outputs) >= 2, preempted_outputs
    assert max(replayed) > 1  # a replay of several generated tokens in one step


def test_without_the_prefill_kernel_prompts_run_as_decodes_and_keep_their_bits(
    model_dir, monkeypatch
):
    """On a CPU where the prefill kernel cannot run (AVX2 only), each bf16 prompt token runs as a
    decode over its context, so chunking, batching and prefix-cache hits still leave a request
    its bits alone."""
    from quire.attention import torch_backend

    monkeypatch.setattr(torch_backend.cpu_kernels, "supports_prefill_attention", lambda *a: False)
    prefills = []
    decoded_prefill = torch_backend.decoded_prefill
    monkeypatch.setattr(
        torch_backend,
        "decoded_prefill",
        lambda query, *args: prefills.append(len(query)) or decoded_prefill(query, *args),
    )
    prompts = token_prompts(LENGTHS)
    llm = LLM(model_dir, dtype="bfloat16", enable_prefix_caching=False)
    alone = [run(llm, [p])[0] for p in prompts]
    assert prefills  # the path under test ran
    llm = LLM(model_dir, dtype="bfloat16", max_num_batched_tokens=24, max_num_seqs=8)
    assert run(llm, prompts) == alone
    assert run(llm, prompts[::-1]) == alone[::-1]  # every full block is a prefix-cache hit now


def test_a_prompt_holding_an_earlier_output_computes_it_as_prompt(model_dir):
    """A chat's next turn: the prompt holds the tokens an earlier request generated. Their cached
    KV came from the decode kernels, so the new prompt recomputes them and keeps its bits alone
    (it hits the blocks that earlier request computed as prompt)."""
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory=KV_MEMORY)
    first = token_prompts([40])[0]
    generated = run(llm, [first], max_tokens=40)[0][0]
    next_turn = {"prompt_token_ids": first["prompt_token_ids"] + generated + [11, 12, 13]}
    with_cache = run(llm, [next_turn])[0]
    fresh = LLM(model_dir, dtype="bfloat16", kv_cache_memory=KV_MEMORY, enable_prefix_caching=False)
    assert with_cache == run(fresh, [next_turn])[0]
    assert llm.stats().prefix_cache_hits == 32  # the first prompt's two full blocks

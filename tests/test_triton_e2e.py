"""The whole engine on the Triton backend gives the torch backend's greedy tokens (float32).

Without CUDA the kernels run in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before
anything imports quire.kernels). The batch mixes prompt lengths, chunks the long prompts
(max_num_batched_tokens=32, so decodes and prefill chunks share steps) and, in a second call,
reuses a cached prefix.
"""

from __future__ import annotations

import pytest
import torch

from quire import LLM, SamplingParams

pytest.importorskip("triton")

NUM_NEW_TOKENS = 6
BLOCK_SIZE = 16


def random_prompt(generator: torch.Generator, length: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=generator).tolist()


_generator = torch.Generator().manual_seed(0)
SHARED = random_prompt(_generator, 40)  # two full blocks, then a partial one
FIRST_CALL = [random_prompt(_generator, n) for n in (3, 17, 70, 33)] + [SHARED]
SECOND_CALL = [SHARED + [5, 6, 7], random_prompt(_generator, 9)]


def engine(model: str, backend: str, speculative_config: dict | None = None) -> LLM:
    """float32, on CUDA where there is one, chunks of at most 32 tokens."""
    return LLM(
        model=model,
        dtype="float32",
        attention_backend=backend,
        device="cuda" if torch.cuda.is_available() else "cpu",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=32,
        num_kv_blocks=64,
        speculative_config=speculative_config,
    )


def run(model: str, backend: str) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of both calls' prompts, and the second call's cached prompt tokens."""
    llm = engine(model, backend)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    first = llm.generate(FIRST_CALL, params, use_tqdm=False)
    second = llm.generate(SECOND_CALL, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in first + second]
    return tokens, [o.num_cached_tokens for o in second]


@pytest.fixture(scope="module")
def results(tiny_llama) -> dict[str, tuple[list[list[int]], list[int]]]:
    return {backend: run(tiny_llama, backend) for backend in ("torch", "triton")}


def test_triton_backend_gives_the_torch_backend_greedy_tokens(results):
    torch_tokens, _ = results["torch"]
    triton_tokens, _ = results["triton"]
    assert all(len(t) == NUM_NEW_TOKENS for t in torch_tokens)
    assert triton_tokens == torch_tokens


def test_triton_backend_serves_a_prompt_from_the_prefix_cache(results):
    _, cached = results["triton"]
    assert cached == [2 * BLOCK_SIZE, 0]  # SHARED's two full blocks; the other prompt is new


def test_triton_backend_verifies_k_plus_one_tokens_a_request(tiny_llama):
    """Speculative decoding on the Triton backend, the target as its own draft model: every
    proposal is accepted, so every decode step's attention runs over k + 1 query tokens a
    request (verified in one forward), and greedy output stays the torch backend's without
    speculation, in a batch with a prompt chunked alongside."""
    prompts = [random_prompt(torch.Generator().manual_seed(s), n) for s, n in ((1, 5), (2, 45))]
    params = SamplingParams(temperature=0.0, max_tokens=7, min_tokens=7)
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    outputs = {}
    for backend, config in (("torch", None), ("triton", spec)):
        llm = engine(tiny_llama, backend, config)
        outputs[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    stats = llm.engine.spec_decoding_stats
    assert outputs["triton"] == outputs["torch"]
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens

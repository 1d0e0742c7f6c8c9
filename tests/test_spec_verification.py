"""The worker verifies speculative tokens: the tokens a request gets with proposals (right,
wrong, or partly right) are the tokens it gets without them.

No proposer exists yet: a stand-in gives each running decode the next tokens of a reference run
(some of them corrupted) before every step, through `Request.spec_token_ids`, as a proposer will.
Each verified position is a decode of its own over the context up to it, and samples with its
position's noise, so bf16 outputs are the same bits, seeded sampling the same tokens.
"""

from __future__ import annotations

import pytest
from conftest import assert_idle, make_llm

from quire import LLM, SamplingParams
from quire.engine.scheduler import Scheduler

PROMPTS = [[5, 9, 200, 17, 3], [44] * 21, list(range(300, 340))]


def propose_from(reference: dict[tuple[int, ...], list[int]], k: int, corrupt_every: int):
    """A Scheduler.schedule wrapper that proposes, for each running decode, the next k tokens of
    its reference output, every `corrupt_every`-th proposal replaced by a wrong token."""
    schedule = Scheduler.schedule
    stats = {"proposed": 0}

    def with_proposals(self):
        for request in self.running:
            if request.num_prompt_tokens <= request.num_computed_tokens == request.num_tokens - 1:
                expected = reference[tuple(request.prompt_token_ids)][request.index]
                done = request.num_output_tokens
                proposal = list(expected[done : done + k])
                for i in range(len(proposal)):
                    if (done + i) % corrupt_every == corrupt_every - 1:
                        proposal[i] = (proposal[i] + 1) % 1000
                request.spec_token_ids = proposal
                stats["proposed"] += len(proposal)
        return schedule(self)

    return with_proposals, stats


def run(llm: LLM, params: SamplingParams):
    """Each prompt's completions: (token ids, logprobs) by completion index."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return {
        tuple(o.prompt_token_ids): [
            (c.token_ids, c.logprobs) for c in sorted(o.outputs, key=lambda c: c.index)
        ]
        for o in outputs
    }


PARAMS = {
    "greedy-logprobs": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    "seeded-top-p": SamplingParams(
        temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True
    ),
    "seeded-n2-penalty": SamplingParams(
        temperature=0.8, seed=5, n=2, max_tokens=20, presence_penalty=1.0, ignore_eos=True
    ),
}


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return make_llm(tiny_llama, dtype="bfloat16")


@pytest.fixture(scope="module")
def references(llm) -> dict:
    return {name: run(llm, params) for name, params in PARAMS.items()}


@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.parametrize("corrupt_every", [1000, 3, 1])  # all right, some wrong, all wrong
def test_verified_proposals_give_the_tokens_of_a_run_without_them(
    llm, references, monkeypatch, name, corrupt_every
):
    params, reference = PARAMS[name], references[name]
    proposals = {prompt: [tokens for tokens, _ in seqs] for prompt, seqs in reference.items()}
    schedule, stats = propose_from(proposals, k=3, corrupt_every=corrupt_every)
    monkeypatch.setattr(Scheduler, "schedule", schedule)
    steps_before = llm.engine.num_steps
    assert run(llm, params) == reference  # tokens, and logprobs where asked for
    assert stats["proposed"] > 0
    if corrupt_every == 1000:  # every proposal accepted: up to 1 + k tokens a step
        assert llm.engine.num_steps - steps_before < params.max_tokens
    assert_idle(llm)

"""logit_bias (OpenAI's): a bias in [-100, 100] added to chosen tokens' logits before the
penalties and sampling. Checked against a reference (the processed distribution's log
probabilities move by exactly the bias for biased tokens and not at all for the others, up to
the one renormalizing constant), then end to end: offline, under speculation, in a batch, and
on both server endpoints."""

from __future__ import annotations

import pytest
import torch

from quire import LLM, SamplingParams
from quire.sample.sampler import Sampler, SamplingBatch, sampling_probs

# The same n-gram speculation as tests/test_spec_decode.py.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
PROMPTS = [[5, 9, 200, 17, 3] * 4, [44, 45, 46, 47] * 9, [300 + i % 11 for i in range(40)]]
MAX_TOKENS = 12
FORCED = 1234


def batch_of(params: list[SamplingParams]) -> SamplingBatch:
    num_rows = len(params)
    return SamplingBatch.from_params(
        params, [[]] * num_rows, [[]] * num_rows, [None] * num_rows, [[]] * num_rows, "cpu"
    )


def test_biased_tokens_move_by_exactly_their_bias_and_the_others_only_by_the_normalizer():
    torch.manual_seed(0)
    logits = torch.randn(2, 64, dtype=torch.float64).float()
    bias = {3: 2.5, 10: -7.0, 40: 0.25}
    plain = sampling_probs(logits, batch_of([SamplingParams(temperature=1.0)] * 2)).log()
    biased_params = [SamplingParams(temperature=1.0, logit_bias=bias), SamplingParams()]
    biased = sampling_probs(logits, batch_of(biased_params)).log()
    shift = biased[0] - plain[0]  # [V]: bias + c for biased tokens, c for the others
    normalizer = shift[0]
    expected = torch.full((64,), float(normalizer))
    for token_id, value in bias.items():
        expected[token_id] += value
    torch.testing.assert_close(shift, expected, atol=1e-5, rtol=0)
    # The reference: softmax of the biased logits.
    reference = logits[0].clone()
    reference[list(bias)] += torch.tensor(list(bias.values()))
    torch.testing.assert_close(biased[0], reference.log_softmax(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(biased[1], plain[1])  # an unbiased row beside it is untouched


def test_a_bias_picks_the_greedy_token_and_leaves_the_returned_logprobs_raw():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=0.0, logprobs=1, logit_bias={2: -100, 0: 1.5})
    out = Sampler()(logits, batch_of([params]))
    assert out.sampled_token_ids.tolist() == [3]  # 2 - 100 < 2 = token 3 > 1.5 = token 0
    torch.testing.assert_close(out.sampled_logprobs, logits.log_softmax(-1)[:, 3])


@pytest.mark.parametrize(
    ("logit_bias", "message"),
    [
        ({5: 100.5}, "logit_bias values must be numbers in [-100, 100], got 100.5 for token 5."),
        ({5: float("nan")}, "logit_bias values must be numbers in [-100, 100], got nan"),
        ({-1: 1.0}, "logit_bias keys must be token ids (integers >= 0), got -1."),
        ({"5": 1.0}, "logit_bias keys must be token ids (integers >= 0), got '5'."),
        ([5], "logit_bias must map token ids to biases, got list."),
    ],
)
def test_sampling_params_refuse_a_bias_out_of_range(logit_bias, message):
    with pytest.raises(ValueError) as raised:
        SamplingParams(logit_bias=logit_bias)
    assert str(raised.value).startswith(message)


@pytest.fixture(scope="module")
def plain_llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=128, max_num_batched_tokens=32)


def generate(llm: LLM, params: SamplingParams | list[SamplingParams], prompts=PROMPTS):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_a_bias_of_100_forces_its_token_offline(plain_llm):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    forced = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={FORCED: 100}
    )
    assert generate(plain_llm, forced) == [[FORCED] * MAX_TOKENS] * len(PROMPTS)
    assert FORCED not in generate(plain_llm, params)[0]


def test_a_bias_of_minus_100_gives_the_runner_up(plain_llm):
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    (output,) = plain_llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    top = output.outputs[0].logprobs[0]
    first, second = sorted(top, key=lambda token_id: top[token_id].rank)[:2]
    banned = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={first: -100})
    assert generate(plain_llm, banned, PROMPTS[:1]) == [[second]]


def test_a_biased_request_gets_its_tokens_alone_and_in_a_batch(plain_llm):
    bias = {FORCED: 3.0, 7: -2.0}
    biased = SamplingParams(
        temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=bias
    )
    others = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = generate(plain_llm, biased, PROMPTS[:1])[0]
    in_batch = generate(plain_llm, [biased, others, others], PROMPTS)[0]
    assert in_batch == alone


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_biased_tokens_are_the_same_under_speculation(tiny_llama, plain_llm, temperature):
    params = SamplingParams(
        temperature=temperature,
        top_k=3,  # a random tiny model repeats itself (proposals) only from a few tokens
        seed=5,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        logit_bias={FORCED: 2.0, 45: -3.0, 17: 1.0},
    )
    reference = generate(plain_llm, params)
    spec_llm = LLM(
        tiny_llama,
        dtype="bfloat16",
        num_kv_blocks=128,
        max_num_batched_tokens=32,
        speculative_config=NGRAM,
    )
    assert generate(spec_llm, params) == reference
    assert spec_llm.engine.spec_decoding_stats.num_draft_tokens > 0

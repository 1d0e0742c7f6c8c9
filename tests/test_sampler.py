"""The sampler: greedy and random rows, seeds, filters, penalties and logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quire.sample.sampler import (
    Sampler,
    SamplingBatch,
    apply_banned_tokens,
    apply_penalties,
    apply_top_p,
    compute_topk_logprobs,
    noise_seed,
    token_counts,
)
from quire.sampling_params import SamplingParams

# A small vocabulary with known probabilities, for the statistical tests.
PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
LOGITS = PROBS.log()
NUM_DRAWS = 20_000
# The 99.99% quantile of chi-square with 7 degrees of freedom, the most these tests have.
CHI_SQUARE_BOUND = 29.9


def make_batch(
    params: list[SamplingParams],
    *,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    noise_seeds: list[int | None] | None = None,
    banned: list[list[int]] | None = None,
) -> SamplingBatch:
    num_rows = len(params)
    return SamplingBatch.from_params(
        params,
        output_token_ids=outputs or [[] for _ in range(num_rows)],
        prompt_token_ids=prompts or [[] for _ in range(num_rows)],
        noise_seeds=noise_seeds or [None] * num_rows,
        banned_token_ids=banned or [[] for _ in range(num_rows)],
        device="cpu",
    )


def sample_counts(
    params: SamplingParams, logits: torch.Tensor = LOGITS, banned: list[int] | None = None
) -> torch.Tensor:  # [V] int64: how often each token came out of NUM_DRAWS draws
    torch.manual_seed(0)
    batch = make_batch([params] * NUM_DRAWS, banned=[banned or [] for _ in range(NUM_DRAWS)])
    tokens = Sampler()(logits.expand(NUM_DRAWS, -1).contiguous(), batch).sampled_token_ids
    return torch.bincount(tokens, minlength=logits.shape[-1])


def assert_follows(counts: torch.Tensor, weights: torch.Tensor) -> None:
    """Tokens of weight 0 never came out; the others at frequencies proportional to weights."""
    allowed = weights > 0
    assert counts[~allowed].sum().item() == 0
    expected = weights[allowed] / weights[allowed].sum() * counts.sum()
    chi_square = ((counts[allowed] - expected) ** 2 / expected).sum().item()
    assert chi_square < CHI_SQUARE_BOUND


def draw_sequence(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], steps: int = 20
) -> list[list[int]]:  # [steps][S]
    """Tokens of `steps` consecutive positions; a seeded row's noise keyed by its position."""
    sampler = Sampler()
    draws = []
    for position in range(steps):
        keys = [None if seed is None else noise_seed(seed, 0, position) for seed in seeds]
        draws.append(
            sampler(logits, make_batch(params, noise_seeds=keys)).sampled_token_ids.tolist()
        )
    return draws


# Greedy and random rows


def test_greedy_picks_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 2.0, 1.0]])
    batch = make_batch([SamplingParams(temperature=0.0)] * 2)
    assert Sampler()(logits, batch).sampled_token_ids.tolist() == [1, 0]


def test_greedy_and_random_rows_mix_in_one_batch() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(3, 16)
    logits[:, 5] = 0.5
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
    ]
    draws = torch.stack(
        [Sampler()(logits, make_batch(params)).sampled_token_ids for _ in range(50)]
    )
    assert draws[:, 0].tolist() == [5] * 50
    assert draws[:, 2].tolist() == [5] * 50
    assert len(set(draws[:, 1].tolist())) > 5


def test_from_params_switches_off_the_filters_of_greedy_rows() -> None:
    batch = make_batch([SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)])
    assert batch.all_greedy
    assert batch.temperature.tolist() == [0.0]
    assert batch.top_k.tolist() == [0]
    assert batch.top_p.tolist() == [1.0]
    assert batch.min_p.tolist() == [0.0]
    assert (batch.max_top_k, batch.any_top_p, batch.any_min_p) == (0, False, False)


# Seeds


def test_seeded_row_repeats_its_tokens_across_calls() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=7)]
    first = draw_sequence(logits, params, [7])
    second = draw_sequence(logits, params, [7])
    assert first == second
    assert len({step[0] for step in first}) > 1


def test_seeded_row_ignores_batch_composition_and_row_position() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    others = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    ours = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    alone = draw_sequence(logits, [ours], [7])

    batch_params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=5, seed=3),
        SamplingParams(temperature=0.0),
        ours,
    ]
    last_row = draw_sequence(
        torch.cat([others, logits]),
        batch_params,
        [None, 3, None, 7],
    )
    first_row = draw_sequence(
        torch.cat([logits, others]),
        batch_params[3:] + batch_params[:3],
        [7, None, 3, None],
    )
    assert [step[3] for step in last_row] == [step[0] for step in alone]
    assert [step[0] for step in first_row] == [step[0] for step in alone]


# Distribution and filters


def test_random_sampling_follows_the_softmax_of_logits_over_temperature() -> None:
    counts = sample_counts(SamplingParams(temperature=0.5))
    assert_follows(counts, PROBS**2)


def test_top_k_keeps_only_the_k_most_likely_tokens() -> None:
    counts = sample_counts(SamplingParams(top_k=3))
    assert_follows(counts, torch.cat([PROBS[:3], torch.zeros(5)]))


def test_top_p_keeps_the_smallest_set_of_tokens_reaching_top_p() -> None:
    # 0.30 + 0.20 = 0.50 < 0.6, so the third token (0.15) is needed to reach it.
    counts = sample_counts(SamplingParams(top_p=0.6))
    assert_follows(counts, torch.cat([PROBS[:3], torch.zeros(5)]))


def test_top_p_always_keeps_the_most_likely_token() -> None:
    counts = sample_counts(SamplingParams(top_p=0.01))
    assert counts.tolist() == [NUM_DRAWS, 0, 0, 0, 0, 0, 0, 0]


def test_top_p_of_one_keeps_tokens_past_a_cumulative_sum_rounded_to_one() -> None:
    # In float32 the top token's probability rounds to 1, yet the second must stay sampleable.
    logits = torch.tensor([[0.0, -30.0], [0.0, -30.0]])
    assert apply_top_p(logits, torch.tensor([1.0, 0.5])).tolist() == [
        [0.0, -30.0],
        [0.0, -math.inf],
    ]


def test_top_p_applies_to_the_distribution_left_by_top_k() -> None:
    # Top-4 renormalized: 0.390, 0.260, 0.195, 0.156; the first three already reach 0.8.
    counts = sample_counts(SamplingParams(top_k=4, top_p=0.8))
    assert_follows(counts, torch.cat([PROBS[:3], torch.zeros(5)]))


def test_min_p_drops_tokens_less_likely_than_min_p_times_the_top_token() -> None:
    # 0.45 * 0.30 = 0.135: the fourth token (0.12) and all below go.
    counts = sample_counts(SamplingParams(min_p=0.45))
    assert_follows(counts, torch.cat([PROBS[:3], torch.zeros(5)]))


def test_banned_tokens_are_never_sampled() -> None:
    counts = sample_counts(SamplingParams(), banned=[0, 3])
    weights = PROBS.clone()
    weights[[0, 3]] = 0.0
    assert_follows(counts, weights)


def test_banned_token_is_not_picked_by_greedy_rows() -> None:
    logits = torch.tensor([[5.0, 1.0, 2.0]])
    batch = make_batch([SamplingParams(temperature=0.0)], banned=[[0]])
    assert Sampler()(logits, batch).sampled_token_ids.tolist() == [2]


# Logit processing


def test_token_counts_counts_every_occurrence_per_row() -> None:
    counts = token_counts([[1, 1, 3], [], [0]], vocab_size=4, device=torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_banned_tokens_get_minus_infinity() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    inf = math.inf
    assert apply_banned_tokens(logits, [[0, 2], []]).tolist() == [
        [-inf, 2.0, -inf],
        [1.0, 2.0, 3.0],
    ]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    batch = make_batch([SamplingParams(repetition_penalty=2.0)], prompts=[[0]], outputs=[[1]])
    assert apply_penalties(logits, batch).tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]


def test_frequency_penalty_subtracts_once_per_generated_occurrence() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    batch = make_batch([SamplingParams(frequency_penalty=0.5)], outputs=[[2, 2, 3]])
    assert apply_penalties(logits, batch).tolist() == [[1.0, 1.0, 0.0, 0.5]]


def test_presence_penalty_subtracts_once_per_generated_token() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    batch = make_batch([SamplingParams(presence_penalty=0.5)], outputs=[[2, 2, 3]])
    assert apply_penalties(logits, batch).tolist() == [[1.0, 1.0, 0.5, 0.5]]


def test_presence_and_frequency_penalties_ignore_the_prompt() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    batch = make_batch([params], prompts=[[0]], outputs=[[1]])
    assert apply_penalties(logits, batch).tolist() == [[1.0, 0.25, 1.0]]


def test_repetition_penalty_applies_before_frequency_and_presence() -> None:
    # (2 / 2) - 0.5 * 2 - 0.25 = -0.25; the other order would give (2 - 1.25) / 2 = 0.375.
    logits = torch.tensor([[2.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = make_batch([params], outputs=[[0, 0]])
    assert apply_penalties(logits, batch).tolist() == [[-0.25, 0.0]]


def test_penalties_apply_to_their_own_row_only() -> None:
    logits = torch.tensor([[2.0, 2.0], [2.0, 2.0]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), SamplingParams()]
    batch = make_batch(params, outputs=[[0], [0]])
    assert apply_penalties(logits, batch).tolist() == [[0.0, 2.0], [2.0, 2.0]]


def test_sampler_leaves_the_logits_unmodified() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.7, top_k=2, repetition_penalty=1.5, logprobs=1)
    Sampler()(logits, make_batch([params], outputs=[[0]], banned=[[1]]))
    assert logits.tolist() == [[2.0, -1.0, 0.5]]


# Logprobs


@pytest.mark.parametrize("logprobs", [0, 2])
def test_sampled_logprob_is_under_the_raw_logits(logprobs: int) -> None:
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
        SamplingParams(temperature=0.3, top_k=5, repetition_penalty=1.3),
        SamplingParams(temperature=1.5, top_p=0.5, presence_penalty=-1.0),
        SamplingParams(temperature=1.0, min_p=0.1, logprobs=logprobs),
    ]
    batch = make_batch(params, outputs=[[1, 2], [3], [4, 4], [5]], prompts=[[6]] * 4)
    out = Sampler()(logits, batch)
    expected = logits.log_softmax(-1).gather(-1, out.sampled_token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.sampled_logprobs, expected, atol=1e-6, rtol=0)


def test_logprobs_list_the_sampled_token_then_the_top_k() -> None:
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(logprobs=4), SamplingParams(logprobs=1), SamplingParams()]
    torch.manual_seed(1)  # every row samples a token other than its most likely one
    out = Sampler()(logits, make_batch(params))
    raw = logits.log_softmax(-1)
    top = raw.topk(4, dim=-1)
    assert (out.sampled_token_ids != top.indices[:, 0]).all()
    assert out.logprob_token_ids.shape == (3, 5)
    assert out.logprob_token_ids[:, 0].tolist() == out.sampled_token_ids.tolist()
    assert out.logprob_token_ids[:, 1:].tolist() == top.indices.tolist()
    torch.testing.assert_close(out.logprobs[:, 1:], top.values, atol=1e-6, rtol=0)
    sampled_raw = raw.gather(-1, out.sampled_token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs[:, 0], sampled_raw, atol=1e-6, rtol=0)


def test_rank_counts_the_strictly_more_likely_tokens_plus_one() -> None:
    # Token 0 is banned, so greedy takes token 1: the second most likely under the raw logits.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 3.0, 2.0]])
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 2
    out = Sampler()(logits, make_batch(params, banned=[[0], []]))
    assert out.sampled_token_ids.tolist() == [1, 2]
    assert out.sampled_ranks.tolist() == [2, 1]
    assert out.logprob_token_ids.tolist() == [[1, 0], [2, 2]]


def test_no_row_asking_for_logprobs_leaves_them_out() -> None:
    out = Sampler()(torch.zeros(2, 4), make_batch([SamplingParams()] * 2))
    assert (out.logprob_token_ids, out.logprobs, out.sampled_ranks) == (None, None, None)
    assert out.sampled_logprobs is None


def test_zero_logprobs_gives_just_the_sampled_tokens_logprob() -> None:
    params = [SamplingParams(logprobs=0)] * 2
    out = Sampler()(torch.zeros(2, 4), make_batch(params))
    torch.testing.assert_close(out.sampled_logprobs, torch.full((2,), -math.log(4)))


def test_zero_logprobs_returns_only_the_sampled_token() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0.0, logprobs=0)]))
    assert out.logprob_token_ids.tolist() == [[2]]
    torch.testing.assert_close(out.logprobs, logits.log_softmax(-1)[:, 2:])


def test_compute_topk_logprobs_on_prompt_positions() -> None:
    # Three prompt positions, each scored on the next prompt token.
    logprobs = torch.tensor(
        [[0.5, 0.3, 0.15, 0.05], [0.1, 0.05, 0.25, 0.6], [0.4, 0.3, 0.2, 0.1]]
    ).log()
    next_tokens = torch.tensor([2, 3, 1])
    ids, lps, ranks = compute_topk_logprobs(logprobs, next_tokens, k=2)
    assert ids.tolist() == [[2, 0, 1], [3, 3, 2], [1, 0, 1]]
    assert lps.tolist() == logprobs.gather(-1, ids).tolist()
    assert ranks.tolist() == [3, 1, 2]


# Properties


@st.composite
def sampling_rows(draw: st.DrawFn) -> tuple[torch.Tensor, SamplingBatch]:
    vocab_size = draw(st.integers(2, 12))
    num_rows = draw(st.integers(1, 4))
    token = st.integers(0, vocab_size - 1)
    logits, params, outputs, prompts, banned, keys = [], [], [], [], [], []
    for _ in range(num_rows):
        logits.append(draw(st.lists(st.floats(-10, 10), min_size=vocab_size, max_size=vocab_size)))
        seed = draw(st.none() | st.integers(0, 2**31))
        params.append(
            SamplingParams(
                temperature=draw(st.just(0.0) | st.floats(0.05, 2.0)),
                top_k=draw(st.integers(0, vocab_size + 2)),
                top_p=draw(st.floats(0.01, 1.0)),
                min_p=draw(st.floats(0.0, 1.0)),
                presence_penalty=draw(st.floats(-2.0, 2.0)),
                frequency_penalty=draw(st.floats(-2.0, 2.0)),
                repetition_penalty=draw(st.floats(0.5, 2.0)),
                seed=seed,
                logprobs=draw(st.none() | st.integers(0, vocab_size)),
            )
        )
        outputs.append(draw(st.lists(token, max_size=6)))
        prompts.append(draw(st.lists(token, max_size=6)))
        banned.append(draw(st.lists(token, max_size=vocab_size - 1, unique=True)))
        keys.append(None if seed is None else noise_seed(seed, 0, 0))
    batch = make_batch(params, outputs=outputs, prompts=prompts, noise_seeds=keys, banned=banned)
    return torch.tensor(logits), batch


@settings(max_examples=100, deadline=None)
@given(sampling_rows())
def test_sampled_token_is_allowed_and_has_a_finite_logprob(
    rows: tuple[torch.Tensor, SamplingBatch],
) -> None:
    logits, batch = rows
    out = Sampler()(logits, batch)
    processed = apply_penalties(apply_banned_tokens(logits, batch.banned_token_ids), batch)
    for row, token in enumerate(out.sampled_token_ids.tolist()):
        assert token not in batch.banned_token_ids[row]
        k = min(int(batch.top_k[row]), logits.shape[-1])
        if k > 0:
            assert processed[row, token] >= processed[row].topk(k).values[-1]
        if batch.temperature[row] == 0:
            assert token == processed[row].argmax().item()
    if out.sampled_logprobs is not None:
        assert torch.isfinite(out.sampled_logprobs).all()


def test_a_tiny_repetition_penalty_favours_the_seen_token_without_overflowing() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0]])
    batch = make_batch([SamplingParams(repetition_penalty=5e-324)], prompts=[[2]])
    penalized = apply_penalties(logits, batch)
    assert penalized.tolist() == [[2.0, -2.0, torch.finfo(torch.float32).max, 3.0]]
    torch.manual_seed(0)
    assert Sampler()(logits, batch).sampled_token_ids.tolist() == [2]

"""The rejection sampler alone: the tokens it emits from a draft's proposals follow the target's
distribution, whatever the draft's, under temperature, top-k and top-p.

Each test draws many independent (proposal, verification) rounds at once on a 12-token vocabulary
and compares the emitted tokens' counts with the target distribution by Pearson's chi-square
statistic. The critical values are the chi-square quantiles at p = 0.001 (Wilson-Hilferty's
approximation, within 0.5% here); the seeds are fixed, so each test is deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from quire.sample.rejection_sampler import rejection_sample
from quire.sample.sampler import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    SamplingBatch,
    noise_seed,
    sampling_probs,
)
from quire.sampling_params import SamplingParams

VOCAB = 12
NUM_DRAWS = 40_000


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile with `df` degrees of freedom at the normal quantile z (0.999)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(observed: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom; cells expected below 5 are pooled."""
    observed, expected = observed.double().flatten(), expected_probs.double().flatten()
    expected = expected * observed.sum()
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was emitted"
    observed, expected = observed[keep], expected[keep]
    return float(((observed - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def random_distributions(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return (2.0 * torch.randn(*shape, VOCAB, generator=generator)).softmax(-1)


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's processed distribution of each row of logits [..., V] under `params`."""
    flat = logits.reshape(-1, VOCAB)
    n = flat.shape[0]
    rows = [[]] * n
    batch = SamplingBatch.from_params([params] * n, rows, rows, [None] * n, rows, "cpu")
    return sampling_probs(flat, batch).view(logits.shape)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One sample per row of probs [N, V]."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def two_position_rounds(target_of, draft_of, seed: int):
    """NUM_DRAWS rounds of two proposals each, with a target and a draft that both depend on the
    previous token: `target_of(prev)` / `draft_of(prev)` give [N, V] distributions (prev None
    for the first position). Returns the first two tokens of each round's emitted sequence
    (a round emitting one token gets its second from the target, as the next step would)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    q1 = draft_of(None)
    x1 = draw(q1, generator)
    q2 = draft_of(x1)
    x2 = draw(q2, generator)
    p1, p2 = target_of(None), target_of(x1)
    bonus = draw(target_of(x2), generator)
    out, num = rejection_sample(
        torch.stack([x1, x2], dim=1),
        torch.full((NUM_DRAWS,), 2),
        torch.stack([q1, q2], dim=1),
        torch.stack([p1, p2], dim=1),
        bonus,
        torch.rand(NUM_DRAWS, 2, generator=generator),
        [None] * (2 * NUM_DRAWS),
    )
    first = out[:, 0]
    second = torch.where(num >= 2, out[:, 1], draw(target_of(first), generator))
    return first, second


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=probs.numel())
    statistic, df = chi_square(counts, probs)
    assert statistic < chi_square_critical(df), (statistic, df)


PARAMS = {
    "temperature-1": SamplingParams(temperature=1.0),
    "temperature-0.7-top-k-5": SamplingParams(temperature=0.7, top_k=5),
    "temperature-1.3-top-p-0.8": SamplingParams(temperature=1.3, top_p=0.8),
}


@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_tokens_follow_the_target_distribution(name, seed):
    params = PARAMS[name]
    tables = torch.Generator().manual_seed(100 + seed)
    # Logits of the first position, and of the second given the first token.
    target_logits = 2.0 * torch.randn(VOCAB + 1, VOCAB, generator=tables)
    target = process(target_logits, params)  # [V + 1, V]: row V is the first position's
    draft = random_distributions(tables, VOCAB + 1)  # a draft unrelated to the target

    def of(table):
        return lambda prev: table[VOCAB].expand(NUM_DRAWS, VOCAB) if prev is None else table[prev]

    first, second = two_position_rounds(of(target), of(draft), seed)
    assert_follows(first, target[VOCAB])
    pair_probs = target[VOCAB][:, None] * target[:VOCAB]  # P(t1) P(t2 | t1)
    assert_follows(first * VOCAB + second, pair_probs)
    # The test has power: the draft's own distribution is far from what was emitted.
    counts = torch.bincount(first, minlength=VOCAB)
    statistic, df = chi_square(counts, draft[VOCAB])
    assert statistic > 10 * chi_square_critical(df)


def test_a_draft_equal_to_the_target_is_always_accepted_and_gets_the_bonus_token():
    generator = torch.Generator().manual_seed(3)
    probs = random_distributions(generator, 64, 3)  # [B, K, V]
    proposals = draw(probs.view(-1, VOCAB), generator).view(64, 3)
    bonus = draw(random_distributions(generator, 64), generator)
    out, num = rejection_sample(
        proposals,
        torch.full((64,), 3),
        probs,
        probs,
        bonus,
        torch.rand(64, 3, generator=generator),
        [None] * (64 * 3),
    )
    assert num.tolist() == [4] * 64
    assert out[:, :3].equal(proposals)
    assert out[:, 3].equal(bonus)


def test_point_masses_accept_on_equality_and_emit_the_target_argmax():
    draft_tokens = torch.tensor([[3, 5], [3, 5], [4, 5]])
    target_argmax = torch.tensor([[3, 5], [3, 6], [7, 5]])
    one_hot = torch.nn.functional.one_hot
    out, num = rejection_sample(
        draft_tokens,
        torch.tensor([2, 2, 2]),
        one_hot(draft_tokens, VOCAB).float(),
        one_hot(target_argmax, VOCAB).float(),
        torch.tensor([9, 9, 9]),
        torch.rand(3, 2),
        [None] * 6,
    )
    assert num.tolist() == [3, 2, 1]
    assert out.tolist() == [[3, 5, 9], [3, 6, -1], [7, -1, -1]]


def test_counts_shorter_than_the_padding_stop_at_their_own_k():
    probs = torch.full((2, 3, VOCAB), 1.0 / VOCAB)
    out, num = rejection_sample(
        torch.tensor([[1, 2, 0], [1, 0, 0]]),
        torch.tensor([2, 1]),
        probs,
        probs,
        torch.tensor([10, 11]),
        torch.zeros(2, 3),
        [None] * 6,
    )
    assert num.tolist() == [3, 2]
    assert out.tolist() == [[1, 2, 10, -1], [1, 11, -1, -1]]


def test_seeded_noise_gives_the_same_tokens_in_any_batch():
    generator = torch.Generator().manual_seed(5)
    target = random_distributions(generator, 8, 2)
    draft = random_distributions(generator, 8, 2)
    proposals = draw(draft.view(-1, VOCAB), generator).view(8, 2)
    bonus = torch.arange(8)

    def run(rows: list[int]):
        from quire.sample.sampler import uniform_noise

        keys = [noise_seed(7, 0, 100 * r + j, STREAM_ACCEPT) for r in rows for j in range(2)]
        residual = [noise_seed(7, 0, 100 * r + j, STREAM_RESIDUAL) for r in rows for j in range(2)]
        index = torch.tensor(rows)
        out, num = rejection_sample(
            proposals[index],
            torch.full((len(rows),), 2),
            draft[index],
            target[index],
            bonus[index],
            uniform_noise(keys, "cpu").view(len(rows), 2),
            residual,
        )
        return {r: out[i, : num[i]].tolist() for i, r in enumerate(rows)}

    alone = {r: run([r])[r] for r in range(8)}
    assert run(list(range(8))) == alone
    assert run([6, 1, 3]) == {r: alone[r] for r in (6, 1, 3)}
    assert len({len(tokens) for tokens in alone.values()}) > 1  # some rejections among them

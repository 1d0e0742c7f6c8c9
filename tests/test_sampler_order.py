"""The sampler's order: temperature first, then top-p, then min-p, each on what the step before
left. At temperature 1 the order does not show; here each case is one where filtering the raw
distribution would keep a different set of tokens, worked out by hand below.

PROBS = [0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02]
- Temperature 0.5 squares them: [.09, .04, .0225, .0144, .01, .0049, .0016, .0004] / 0.1838
  = [.490, .218, .122, .078, ...]. Top-p 0.7 keeps tokens 0 and 1 (the mass before token 2 is
  .708 >= 0.7); on the raw distribution it would keep 0..3 (mass before token 3 is .65 < 0.7).
- Temperature 2 takes square roots: [.548, .447, .387, .346, .316, .265, .200, .141] / 2.651
  = [.207, .169, .146, .131, ...]. Top-p 0.5 keeps 0, 1 and 2 (mass before token 3 is .521);
  on the raw distribution only 0 and 1 (mass before token 2 is .50).
- At temperature 2, min-p 0.5 keeps tokens whose root is >= 0.5 * .548 = .274, that is p >= .075:
  tokens 0..4; on the raw distribution p >= .15: tokens 0..2.
Kept tokens are then drawn in proportion to their tempered weight, p ** (1 / temperature).
"""

from __future__ import annotations

import pytest
import torch

from quire.sample.sampler import Sampler, SamplingBatch
from quire.sampling_params import SamplingParams

PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
NUM_DRAWS = 20_000
CHI_SQUARE_BOUND = 29.9  # the 99.99% quantile of chi-square with 7 degrees of freedom


def sample_counts(params: SamplingParams) -> torch.Tensor:  # [V]: draws of each token
    torch.manual_seed(0)
    batch = SamplingBatch.from_params(
        [params] * NUM_DRAWS,
        output_token_ids=[[] for _ in range(NUM_DRAWS)],
        prompt_token_ids=[[] for _ in range(NUM_DRAWS)],
        noise_seeds=[None] * NUM_DRAWS,
        banned_token_ids=[[] for _ in range(NUM_DRAWS)],
        device="cpu",
    )
    logits = PROBS.log().expand(NUM_DRAWS, -1).contiguous()
    tokens = Sampler()(logits, batch).sampled_token_ids
    return torch.bincount(tokens, minlength=len(PROBS))


def assert_follows(counts: torch.Tensor, kept: list[int], temperature: float) -> None:
    """Only the `kept` tokens came out, in proportion to p ** (1 / temperature)."""
    dropped = [t for t in range(len(PROBS)) if t not in kept]
    assert counts[dropped].sum().item() == 0, counts.tolist()
    weights = PROBS[kept] ** (1.0 / temperature)
    expected = weights / weights.sum() * NUM_DRAWS
    chi_square = ((counts[kept] - expected) ** 2 / expected).sum().item()
    assert chi_square < CHI_SQUARE_BOUND, counts.tolist()


@pytest.mark.parametrize(
    "temperature, top_p, kept",
    [(0.5, 0.7, [0, 1]), (2.0, 0.5, [0, 1, 2])],
    ids=["cold-keeps-fewer", "hot-keeps-more"],
)
def test_top_p_cuts_the_distribution_after_temperature(temperature, top_p, kept):
    counts = sample_counts(SamplingParams(temperature=temperature, top_p=top_p))
    assert_follows(counts, kept, temperature)


def test_min_p_cuts_the_distribution_after_temperature():
    counts = sample_counts(SamplingParams(temperature=2.0, min_p=0.5))
    assert_follows(counts, [0, 1, 2, 3, 4], 2.0)

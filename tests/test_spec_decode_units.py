"""The n-gram proposer against hand-computed proposals, the adaptive choice of k against
injected measurements, and the validation of speculative_config."""

from __future__ import annotations

import numpy as np
import pytest

from quire.config import AUTO_MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from quire.spec_decode.adaptive import AdaptiveSpeculation
from quire.spec_decode.ngram import NgramProposer, find_ngram_proposal


def propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return find_ngram_proposal(np.array(tokens), min_n, max_n, k).tolist()


# ---- n-gram proposer ---------------------------------------------------------------------
def test_ngram_proposes_the_tokens_after_the_earliest_longest_match():
    # Suffix [1, 2, 3] occurs at 0-2 and 4-6: the earliest wins, then [4, 1, 2] follow it.
    assert propose([1, 2, 3, 4, 1, 2, 3, 5, 9, 1, 2, 3], 2, 3, 3) == [4, 1, 2]


def test_ngram_prefers_a_longer_match_to_an_earlier_one():
    # [2, 3] first occurs at 1-2 (then 7); [1, 2, 3] only at 5-7 (then 8).
    assert propose([0, 2, 3, 7, 9, 1, 2, 3, 8, 1, 2, 3], 2, 3, 2) == [8, 1]


def test_ngram_match_is_capped_at_prompt_lookup_max():
    # With max 2, [2, 3] occurs first at 1-2 even though [1, 2, 3] also occurs later.
    assert propose([0, 2, 3, 7, 9, 1, 2, 3, 8, 1, 2, 3], 1, 2, 2) == [7, 9]


def test_ngram_proposes_nothing_below_prompt_lookup_min():
    # The suffix [5, 3] occurs nowhere else; only [3] does, shorter than min 2.
    assert propose([3, 4, 6, 5, 3], 2, 4, 3) == []
    assert propose([3, 4, 6, 5, 3], 1, 4, 3) == [4, 6, 5]


def test_ngram_proposal_is_cut_at_the_end_of_the_tokens():
    # A match may overlap the suffix: [7, 7] at 0-1 is followed by one token before the end.
    assert propose([7, 7, 7], 2, 2, 4) == [7]
    assert propose([1, 2, 1, 2], 2, 2, 5) == [1, 2]


def test_ngram_proposer_follows_a_growing_request():
    proposer = NgramProposer(1, 3, k=2)
    tokens = [1, 2, 3, 9]
    assert proposer.lookup("a", tokens, 2) == []
    tokens += [1, 2]  # appended since: the buffer takes only the new tokens
    assert proposer.lookup("a", tokens, 2) == [3, 9]
    tokens += list(range(100, 400)) + [3]  # past the buffer's first capacity
    assert proposer.lookup("a", tokens, 2) == [9, 1]
    proposer.drop({"a"})
    assert proposer.req_ids == set()


# ---- adaptive k --------------------------------------------------------------------------
def measured(accepted_lengths: list[int], max_k: int = 4) -> AdaptiveSpeculation:
    """An AdaptiveSpeculation whose request 'r' measured these accepted lengths (each a
    proposal of max_k tokens made at once and resolved by the tokens that followed)."""
    adaptive = AdaptiveSpeculation(max_k)
    tokens = [0]
    for length in accepted_lengths:
        proposal = list(range(1, max_k + 1))
        adaptive.start_measurement("r", len(tokens), proposal)
        tokens += proposal[:length] + ([99] if length < max_k else [])
        adaptive.observe("r", tokens)
    return adaptive


def test_acceptance_by_position_is_measured_from_later_tokens():
    adaptive = measured([4, 4, 4, 4, 4, 4, 4, 4, 0, 2])
    acceptance = adaptive.acceptance("r")
    # Positions 3-4: accepted in 8 of the decayed 10, positions 1-2 in 9 of them.
    assert acceptance[0] == acceptance[1] > acceptance[2] == acceptance[3] > 0.5
    assert measured([0] * 10).acceptance("r").tolist() == [0.0] * 4


def test_an_open_measurement_waits_for_the_tokens_that_decide_it():
    adaptive = AdaptiveSpeculation(4)
    adaptive.start_measurement("r", 1, [5, 6, 7, 8])
    adaptive.observe("r", [0, 5, 6])  # matches so far, two positions still to come
    assert not adaptive.wants_measurement("r", k=1)
    adaptive.observe("r", [0, 5, 6, 0])  # rejected at position 3
    assert adaptive.wants_measurement("r", k=1)
    assert adaptive.acceptance("r").tolist() == [1.0, 1.0, 0.0, 0.0]


def test_adaptive_picks_k_0_when_verifying_costs_more_than_it_gains():
    adaptive = measured([4, 0] * 10)  # half the proposals accepted in full, half not at all
    for _ in range(3):  # compute-bound: a step's time grows with its tokens
        adaptive.record_step(32, 0.032)
        adaptive.record_step(64, 0.064)
    assert adaptive.choose(["r"] * 32) == [0] * 32


def test_adaptive_picks_the_full_proposal_when_verifying_is_cheap():
    adaptive = measured([4] * 20)
    for _ in range(3):  # memory-bound: 1 ms of weights, 0.1 ms a token
        adaptive.record_step(1, 0.0011)
        adaptive.record_step(2, 0.0012)
    assert adaptive.choose(["r"]) == [3]  # at most twice the largest N measured
    for _ in range(3):
        adaptive.record_step(5, 0.0015)
    assert adaptive.choose(["r"]) == [4]


def test_adaptive_picks_k_0_before_any_step_is_measured():
    assert measured([4] * 20).choose(["r", "r"]) == [0, 0]


def test_adaptive_picks_k_0_without_the_cost_model_when_nothing_is_accepted(monkeypatch):
    adaptive = measured([0] * 20)
    for _ in range(3):  # verifying would be free: only acceptance keeps k at 0
        adaptive.record_step(1, 0.001)
        adaptive.record_step(5, 0.001)
    monkeypatch.setattr(adaptive.cost, "predict", None)  # not consulted
    assert adaptive.choose(["r", "r"]) == [0, 0]
    # One accepted position in the last measurements brings the cost model back: free
    # verification of a position accepted now and then is worth it.
    adaptive = measured([0] * 19 + [1])
    for _ in range(3):
        adaptive.record_step(1, 0.001)
        adaptive.record_step(2, 0.001)
    assert adaptive.choose(["r"]) == [1]


def test_adaptive_verifies_more_of_the_request_that_is_accepted_more():
    adaptive = measured([4] * 20)
    for _ in range(20):  # request 's': only the first position is ever accepted
        adaptive.start_measurement("s", 1, [1, 2, 3, 4])
        adaptive.observe("s", [0, 1, 99])
    for _ in range(3):  # each token beyond the second costs 0.5 ms against ~1 ms
        adaptive.record_step(2, 0.002)
        adaptive.record_step(4, 0.003)
        adaptive.record_step(8, 0.005)
    k_r, k_s = adaptive.choose(["r", "s"])
    assert k_r == 4 and k_s == 1


# ---- config ------------------------------------------------------------------------------
def test_speculative_config_defaults_follow_vllm():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_max": 3}
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    assert config.adaptive and config.num_speculative_tokens == AUTO_MAX_SPECULATIVE_TOKENS


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "eagle", "model": "x"}, "not yet supported"),
        ({"method": "draft_model", "model": "/no/such/model"}, "needs 'model'"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
        ({"method": "ngram", "model": "."}, "applies to method 'draft_model' only"),
        ({"method": "lookahead"}, "needs 'method'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "integer >= 1 or 'auto'"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "integer >= 1 or 'auto'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "'prompt_"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "must be <= prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "Unknown speculative_config"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_config_is_a_clear_value_error(spec, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(spec)


def test_adaptive_takes_a_plain_step_every_32_choices_to_remeasure_the_baseline():
    adaptive = measured([4] * 20)
    for _ in range(3):
        adaptive.record_step(1, 0.0011)
        adaptive.record_step(5, 0.0015)
    choices = [adaptive.choose(["r"]) for _ in range(64)]
    assert [i for i, k in enumerate(choices) if k == [0]] == [31, 63]


# ---- adaptive k with a draft model: acceptance from verifications ---------------------------
def test_a_draft_verification_counts_only_the_positions_it_reached():
    adaptive = AdaptiveSpeculation(4, drafted=True)
    adaptive.record_verified("r", accepted_len=2, num_verified=2)  # positions 3-4 not reached
    assert adaptive.acceptance("r").tolist() == [1.0, 1.0, 1.0, 1.0]
    other = AdaptiveSpeculation(4, drafted=True)
    other.record_verified("r", accepted_len=1, num_verified=3)  # rejected at position 2
    assert other.acceptance("r").tolist() == [1.0, 0.0, 0.0, 0.0]


def test_adaptive_drafts_the_full_length_when_accepted_and_verifying_is_cheap():
    adaptive = AdaptiveSpeculation(4, drafted=True)
    adaptive.record_verified("r", accepted_len=1, num_verified=1)
    for _ in range(2):  # a draft 5% of the target's cost a token
        adaptive.record_step(1, 0.0010)
        adaptive.record_step(4, 0.00115)
    lengths = [adaptive.draft_lengths(["r"])[0] for _ in range(34)]
    # Choices 32 and 33 (and the first) are plain: they re-measure the plain step.
    assert lengths == [0] + [4] * 30 + [0, 0, 4]


def useless_draft(t_verify: float = 0.001) -> AdaptiveSpeculation:
    """A draft whose first verified proposal was rejected, for request 'r', with the plain
    step measured at 1 ms and a verification of 4 proposals at `t_verify`."""
    adaptive = AdaptiveSpeculation(4, drafted=True)
    adaptive.record_verified("r", accepted_len=0, num_verified=3)
    for _ in range(2):
        adaptive.record_step(1, 0.001)
        adaptive.record_step(5, t_verify)
    return adaptive


def test_adaptive_probes_a_useless_draft_at_intervals_that_double_up_to_512_steps():
    adaptive = useless_draft()  # verifying would be free: only acceptance keeps k at 0
    lengths = [adaptive.draft_lengths(["r"])[0] for _ in range(1600)]
    # 32 steps at k = 0, then 64, 128, 256, 512, 512.
    assert [i for i, k in enumerate(lengths) if k] == [31, 95, 223, 479, 991, 1503]
    assert max(lengths) == 1


def test_a_new_request_starts_at_the_longest_probe_interval_reached():
    adaptive = useless_draft()
    for _ in range(96):  # 'r' probes at steps 31 and 95: its next interval is 128
        adaptive.draft_lengths(["r"])
    adaptive.drop({"r"})
    lengths = [adaptive.draft_lengths(["s"])[0] for _ in range(129)]
    assert [i for i, k in enumerate(lengths) if k] == [127]


def test_a_choice_to_speculate_puts_the_probe_interval_back_to_32_steps():
    adaptive = useless_draft(t_verify=0.0015)  # pays at a first-position acceptance over 1/8
    for _ in range(96):  # probes at steps 31 and 95: the next interval is 128
        adaptive.draft_lengths(["r"])
    for _ in range(12):  # 'r' now accepts everything
        adaptive.record_verified("r", accepted_len=4, num_verified=4)
    assert adaptive.draft_lengths(["r"]) == [0]  # choice 97: a plain refresh
    assert adaptive.draft_lengths(["r"]) == [4]
    for _ in range(40):  # and then nothing
        adaptive.record_verified("r", accepted_len=0, num_verified=4)
    lengths = [adaptive.draft_lengths(["r"])[0] for _ in range(64)]
    assert [i for i, k in enumerate(lengths) if k] == [31]


def test_adaptive_makes_no_probe_when_no_acceptance_could_pay_for_the_draft():
    """Verifying 4 proposals and drafting the next costs 6x a plain step (a draft as costly as
    the target): even 5 tokens a step would be slower, so measuring acceptance is no use."""
    adaptive = useless_draft(t_verify=0.006)
    lengths = [adaptive.draft_lengths(["r"])[0] for _ in range(600)]
    assert max(lengths) == 0

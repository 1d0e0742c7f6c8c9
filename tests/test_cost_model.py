"""The router's cost model: its TTFT/ITL predictions from a profile, its choice between the
collocated and the disaggregated path, the output-length predictor, the profile file's
validation and what it reads from relayed streams."""

from __future__ import annotations

import json
import math

import pytest

from quire.router.app import Router, run_router
from quire.router.cost_model import (
    CostModel,
    CostModelRouting,
    CostProfile,
    CostProfileError,
    Flight,
    Load,
    OutputLengthPredictor,
    StreamTally,
    load_profile,
)
from quire.router.policies import Instance

PROFILE = CostProfile(
    prefill_base_s=0.01,
    alpha_s_per_token=0.001,
    chunk_tokens=100_000,  # one step prefills any prompt here
    decode_base_s=0.02,
    decode_per_seq_s=0.002,
    decode_per_context_token_s=1e-6,
    compute_bound_batch=4,
    gamma_s_per_prefill_token=0.001,
    transfer_base_s=0.005,
    transfer_bytes_per_s=1e8,
    kv_bytes_per_token=1e4,  # 1e-4 s of transfer per token
)
MODEL = CostModel(PROFILE)


def test_step_time_is_flat_in_batch_until_the_compute_bound_batch():
    assert MODEL.step_time(4, 0) == pytest.approx(0.02)
    assert MODEL.step_time(6, 0) == pytest.approx(0.02 + 0.002 * 2)
    assert MODEL.step_time(2, 500) == pytest.approx(0.02 + 1e-6 * 2 * 500)


def test_collocated_prediction_on_an_idle_instance():
    got = MODEL.collocated(Load(), prompt_tokens=100, output_tokens=10)
    assert got.ttft_s == pytest.approx(0.01 + 0.001 * 100)
    assert got.itl_s == pytest.approx(0.02 + 1e-6 * 105)  # context 100 + 10 / 2
    assert got.imposed_s == 0.0


def test_collocated_prediction_counts_queue_running_decodes_and_their_stall():
    load = Load(queued_prefill_tokens=50, num_decoding=8, mean_context=200)
    got = MODEL.collocated(load, prompt_tokens=100, output_tokens=11)
    running_work = 0.002 * (8 - 4) + 1e-6 * 8 * 200  # D(8, 200) - beta0
    assert got.ttft_s == pytest.approx(0.01 + 0.001 * 150 + running_work)
    joined = (8 * 200 + 100 + 5.5) / 9
    step_9 = 0.02 + 0.002 * 5 + 1e-6 * 9 * joined
    assert got.itl_s == pytest.approx(step_9)
    added = step_9 - (0.02 + running_work)
    assert got.imposed_s == pytest.approx(8 * (0.001 * 100 + 10 * added))


def test_collocated_prediction_chunks_a_long_queue():
    chunked = CostModel(CostProfile(**{**PROFILE.__dict__, "chunk_tokens": 64}))
    load = Load(num_decoding=2, mean_context=100)
    got = chunked.collocated(load, prompt_tokens=200, output_tokens=1)
    assert got.ttft_s == pytest.approx(0.01 + 0.2 + math.ceil(200 / 64) * (1e-6 * 2 * 100))


def test_interference_of_arriving_prompts_stretches_the_itl():
    got = MODEL.collocated(Load(prefill_token_rate=300), prompt_tokens=10, output_tokens=2)
    assert got.itl_s == pytest.approx((0.02 + 1e-6 * 11) / (1 - 0.3))


def test_disaggregated_prediction_adds_the_transfer_and_spares_the_stall():
    decode = Load(num_decoding=2, mean_context=100)
    got = MODEL.disaggregated(Load(queued_prefill_tokens=30), decode, 100, output_tokens=3)
    assert got.ttft_s == pytest.approx(0.01 + 0.001 * 130 + 0.005 + 0.01 + 1e-6 * 2 * 100)
    joined = (2 * 100 + 101.5) / 3
    assert got.itl_s == pytest.approx(0.02 + 1e-6 * 3 * joined)
    added = 1e-6 * (3 * joined - 2 * 100)
    assert got.imposed_s == pytest.approx(2 * 2 * added)


def test_a_prefill_instance_that_also_decodes_stalls_its_decodes_too():
    """kv_both: the prefill instance's own decodes slow its prefill and are stalled by it."""
    prefill = Load(num_decoding=2, mean_context=100)
    got = MODEL.disaggregated(prefill, Load(), 100, output_tokens=1)
    assert got.ttft_s == pytest.approx(0.01 + 0.1 + 1e-6 * 2 * 100 + 0.005 + 0.01)
    assert got.imposed_s == pytest.approx(2 * 0.001 * 100)


# ---- the choice ------------------------------------------------------------------------------
C, P, D = (
    Instance("http://c", "collocated"),
    Instance("http://p", "prefill"),
    Instance("http://d", "decode"),
)


def decoding(routing: CostModelRouting, instance: Instance, count: int, context: int) -> None:
    """`count` requests decoding on `instance`, each of context `context`."""
    for _ in range(count):
        body = {"prompt": [1] * context}
        routing.flights[instance.url][id(body)] = Flight(body, "decode", context, 0.0)


def choose(routing: CostModelRouting, prompt_tokens: int, max_tokens: int = 8) -> str:
    body = {"prompt": [7] * prompt_tokens, "max_tokens": max_tokens}
    first = routing.choose_first([C, P], [D], body, "")
    if first.role == "prefill":
        assert routing.choose_decode([D], body) is D
    return first.url


def test_idle_instances_keep_a_request_collocated():
    """No one to stall: the transfer would only add to TTFT."""
    assert choose(CostModelRouting(MODEL), 1000) == "http://c"


def test_a_long_prompt_beside_many_decodes_goes_disaggregated():
    routing = CostModelRouting(MODEL)
    decoding(routing, C, count=8, context=200)
    assert choose(routing, 1000) == "http://p"


@pytest.mark.parametrize("prompt_tokens, expected", [(1, "c"), (5, "c"), (6, "p"), (500, "p")])
def test_the_crossover_is_where_the_spared_stall_exceeds_the_transfer(prompt_tokens, expected):
    """One sequence decodes on the collocated and on the decode instance alike: all but the
    prefill's stall of it (gamma L) and the transfer (5 ms + 0.1 ms L) cancels, so disaggregation
    pays from L > 0.005 / (0.001 - 0.0001) = 5.6 tokens."""
    routing = CostModelRouting(MODEL)
    decoding(routing, C, count=1, context=40)
    decoding(routing, D, count=1, context=40)
    assert choose(routing, prompt_tokens) == f"http://{expected}"


def test_a_choice_stays_in_the_ledger_until_answered():
    routing = CostModelRouting(MODEL)
    decoding(routing, C, count=8, context=200)
    body = {"prompt": [7] * 1000, "max_tokens": 8}
    assert routing.choose_first([C, P], [D], body, "") is P
    assert routing.load(P.url, now=-1.0).queued_prefill_tokens == 1000
    routing.done(P, body, None, None)
    assert id(body) not in routing.flights[P.url]
    assert routing.load(D.url, now=1e9).num_decoding == 1
    routing.done(D, body, None, {"prompt_tokens": 1000, "completion_tokens": 3})
    assert id(body) not in routing.flights[D.url]
    assert routing.choices == {"disaggregated": 1}
    assert routing.outputs.predict(1000, max_tokens=None) == 3


def test_text_prompts_are_counted_with_the_characters_per_token_seen():
    routing = CostModelRouting(MODEL)
    body = {"prompt": "x" * 400, "max_tokens": 4}
    assert routing.prompt_length(body, body["prompt"]) == 100  # 4 characters a token at first
    routing.choose_first([C], [], body, body["prompt"])
    routing.done(C, body, None, {"prompt_tokens": 50, "completion_tokens": 4})
    assert routing.prompt_length(body, body["prompt"]) == 50


# ---- output lengths --------------------------------------------------------------------------
def test_output_length_without_observations_is_max_tokens_or_the_default():
    predictor = OutputLengthPredictor()
    assert predictor.predict(100, max_tokens=50) == 50
    assert predictor.predict(100, max_tokens=None) == 128


def test_output_length_falls_back_to_the_global_mean_for_an_unseen_bucket():
    predictor = OutputLengthPredictor(min_samples=2)
    predictor.observe(10, 20)  # bucket of 8..15
    predictor.observe(100, 40)  # bucket of 64..127
    assert predictor.predict(1000, max_tokens=None) == 30
    assert predictor.predict(1000, max_tokens=25) == 25  # capped


def test_output_length_is_the_mean_of_the_prompt_lengths_bucket():
    predictor = OutputLengthPredictor(min_samples=2)
    for prompt, output in ((70, 10), (120, 30), (10, 500), (12, 700)):
        predictor.observe(prompt, output)
    assert predictor.predict(100, max_tokens=None) == 20  # 64..127: (10 + 30) / 2
    assert predictor.predict(8, max_tokens=None) == 600


def test_output_length_keeps_a_window_of_recent_requests():
    predictor = OutputLengthPredictor(window=2, min_samples=1)
    for output in (100, 4, 6):
        predictor.observe(50, output)
    assert predictor.predict(50, max_tokens=None) == 5


# ---- the profile file ------------------------------------------------------------------------
def test_profile_round_trips_through_json(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE.to_dict() | {"measured": {"anything": 1}}))
    assert load_profile(path) == PROFILE


def test_a_missing_profile_says_how_to_write_one(tmp_path):
    with pytest.raises(CostProfileError, match="does not exist: measure the instances with"):
        load_profile(tmp_path / "nope.json")


def test_a_profile_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(CostProfileError, match="Cannot read the cost profile"):
        load_profile(path)


def test_a_file_of_another_format_is_refused():
    with pytest.raises(CostProfileError, match="is not a quire-pd-profile/1 file"):
        CostProfile.from_dict({"prefill": {}})


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("decode", "base_s", None),
        ("prefill", "alpha_s_per_token", 0.0),
        ("transfer", "bytes_per_s", -5.0),
        ("prefill", "chunk_tokens", 1.5),
        ("interference", "gamma_s_per_prefill_token", float("nan")),
        ("decode", "compute_bound_batch", "4"),
    ],
)
def test_a_bad_field_is_named(section, key, value):
    data = PROFILE.to_dict()
    data[section][key] = value
    with pytest.raises(CostProfileError, match=f"{section}.{key} must be a finite number"):
        CostProfile.from_dict(data)


def test_router_start_fails_on_a_bad_profile_before_contacting_instances(tmp_path):
    unreachable = ["http://127.0.0.1:9"]
    with pytest.raises(CostProfileError, match="does not exist"):
        run_router(
            unreachable, unreachable, [], "cost_model", "127.0.0.1", 0, str(tmp_path / "x.json")
        )
    with pytest.raises(ValueError, match="cost_model needs measured parameters"):
        Router([], "cost_model")
    with pytest.raises(ValueError, match="--cost-profile is for --policy cost_model"):
        run_router(unreachable, unreachable, [], "least_loaded", "127.0.0.1", 0, "p.json")


# ---- streams ---------------------------------------------------------------------------------
def test_stream_tally_counts_text_events_across_chunk_boundaries_and_reads_usage():
    events = [
        {"choices": [{"text": "a"}], "usage": None},
        {"choices": [{"text": ""}], "usage": None},
        {"choices": [{"text": "b"}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
    ]
    stream = b"".join(f"data: {json.dumps(e, separators=(',', ':'))}\n\n".encode() for e in events)
    stream += b"data: [DONE]\n\n"
    tally = StreamTally()
    for start in range(0, len(stream), 7):
        tally.feed(stream[start : start + 7])
    assert tally.text_events == 2
    assert tally.usage == {"prompt_tokens": 5, "completion_tokens": 2}
    assert tally.first_at is not None and tally.end_at >= tally.first_at


def test_stream_tally_strips_the_usage_report_the_router_asked_for():
    """The router asks an instance for the usage report of every stream it relays (events
    coalesce tokens when a reader falls behind, so only the report counts them); a client that
    did not ask gets the stream without it, byte for byte otherwise."""
    events = [
        {"choices": [{"text": "a"}], "usage": None},
        {"choices": [{"text": "bc"}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}},
    ]
    encoded = [f"data: {json.dumps(e, separators=(',', ':'))}\n\n".encode() for e in events]
    stream = b"".join(encoded) + b"data: [DONE]\n\n"
    tally = StreamTally(strip_usage=True)
    relayed = b"".join(tally.feed(stream[i : i + 5]) for i in range(0, len(stream), 5))
    assert relayed == encoded[0] + encoded[1] + b"data: [DONE]\n\n"
    assert tally.usage == {"prompt_tokens": 5, "completion_tokens": 3}
    assert tally.text_events == 2

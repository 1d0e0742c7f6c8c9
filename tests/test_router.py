"""`quire router` in front of a prefill and a decode server: the same answers as one collocated
server (greedy and seeded, streamed or not, completions and chat), clear errors when an instance
is gone or the configuration is wrong, and the policies' choices."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest
from conftest import assert_idle
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from server_utils import ServerThread, serve_engine, wait_until

from quire.bench import pd_profile
from quire.config import EngineConfig
from quire.router.app import Router, RouterConfigError, build_router_app, check_instances
from quire.router.cost_model import load_profile
from quire.router.policies import CacheAware, Instance, LeastLoaded, RoundRobin

MODEL = "tiny"
BLOCK = 16
CHUNK = 24


def serving(model: str, **kwargs):
    settings = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK)
    return serve_engine(EngineConfig(model=model, **{**settings, "num_kv_blocks": 64, **kwargs}))


@pytest.fixture(scope="module")
def instances(tiny_llama):
    with (
        serving(tiny_llama, disaggregation_mode="prefill", kv_lease_timeout=5.0) as prefill,
        serving(tiny_llama, disaggregation_mode="decode", kv_transfer_timeout=2.0) as decode,
        serving(tiny_llama) as collocated,
    ):
        yield prefill, decode, collocated


@pytest.fixture(scope="module")
def router(instances):
    (prefill, _), (decode, _), _ = instances
    server = ServerThread(
        build_router_app(Router(check_instances([prefill.url], [decode.url], []), "round_robin"))
    )
    yield server
    server.stop()


def completion(url: str, prompt, **kwargs) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, **kwargs}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(url: str, path: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text)


def token_prompt(length: int, salt: int) -> list[int]:
    return [(53 * j + 997 * salt) % 40000 + 10 for j in range(length)]


@pytest.mark.parametrize("length", [5, 2 * BLOCK, CHUNK + 2 * BLOCK + 1])
def test_greedy_completion_equals_collocated(instances, router, length):
    (_, prefill), (_, decode), (collocated, _) = instances
    prompt = token_prompt(length, length)
    expected = completion(collocated.url, prompt, ignore_eos=True)["choices"][0]["text"]
    assert completion(router.url, prompt, ignore_eos=True)["choices"][0]["text"] == expected
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    assert streamed_text(router.url, "/v1/completions", {**body, "ignore_eos": True}) == expected
    assert_idle(prefill, decode)


def test_a_stream_carries_the_usage_report_only_when_the_client_asks(instances, router):
    # The router asks every instance for the report (it counts the tokens it learns from):
    # a client that did not ask never sees it (streamed_text reads choices[0] of every event).
    body = {"model": MODEL, "prompt": token_prompt(7, 3), "max_tokens": 6, "ignore_eos": True}
    assert streamed_text(router.url, "/v1/completions", body)
    asked = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", router.url + "/v1/completions", json=asked, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    report = json.loads(events[-1])
    assert report["choices"] == [] and report["usage"]["completion_tokens"] == 6


def test_streamed_chat_and_seeded_sampling_equal_collocated(instances, router):
    (_, prefill), (_, decode), (collocated, _) = instances
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about prefill and decode."}],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 77,
    }
    path = "/v1/chat/completions"
    assert streamed_text(router.url, path, body) == streamed_text(collocated.url, path, body)
    assert_idle(prefill, decode)


def test_decode_instance_counts_the_bytes_it_pulled(instances, router):
    (_, _), (decode_server, _), _ = instances
    completion(router.url, token_prompt(BLOCK + 1, 5), max_tokens=2)
    text = httpx.get(decode_server.url + "/metrics").text
    assert "quire:kv_transfer_bytes_total" in text
    assert "quire_router_requests_total" in httpx.get(router.url + "/metrics").text


def test_n_completions_with_logprobs_equal_collocated(instances, router):
    (_, prefill), (_, decode), (collocated, _) = instances
    prompt = token_prompt(9, 6)
    sampling = dict(n=2, logprobs=1, temperature=0.7, seed=5, ignore_eos=True)
    got = completion(router.url, prompt, **sampling)["choices"]
    expected = completion(collocated.url, prompt, **sampling)["choices"]
    assert [c["text"] for c in got] == [c["text"] for c in expected]
    assert [c["logprobs"]["tokens"] for c in got] == [c["logprobs"]["tokens"] for c in expected]
    assert_idle(prefill, decode)


def test_requests_the_disaggregated_path_does_not_carry_go_to_the_decode_instance(
    instances, router
):
    (_, _), (_, decode), (collocated, _) = instances
    prompts = [token_prompt(9, 6), token_prompt(12, 7)]  # two prompts in one request
    got = completion(router.url, prompts, ignore_eos=True)
    expected = completion(collocated.url, prompts, ignore_eos=True)
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in expected["choices"]]
    assert_idle(decode)


def router_over(instances: list[Instance]) -> ServerThread:
    router = Router(instances, "round_robin", poll_interval_s=60.0)
    return ServerThread(build_router_app(router))


def test_a_dead_prefill_instance_leaves_the_decode_instance_to_compute(instances):
    (_, _), (decode_server, decode), (collocated, _) = instances
    gone = "http://127.0.0.1:9"  # nothing listens on the discard port
    dead = Instance(gone, "prefill", kv_host="127.0.0.1", kv_port=9)
    server = router_over([dead, Instance(decode_server.url, "decode")])
    try:
        prompt = token_prompt(20, 8)
        got = completion(server.url, prompt, ignore_eos=True)
        load = httpx.get(server.url + "/load").json()
    finally:
        server.stop()
    assert (
        got["choices"][0]["text"]
        == completion(collocated.url, prompt, ignore_eos=True)["choices"][0]["text"]
    )
    assert load["instances"][0]["healthy"] is False
    assert_idle(decode)


def test_a_prefill_kv_endpoint_that_never_answers_is_a_clear_error(instances):
    """The prefill instance computed the prompt, but its KV never comes (as when it dies
    mid-transfer): the decode instance gives up after kv_transfer_timeout with the reason, and
    both free every block (the prefill instance when its lease runs out)."""
    (prefill_server, prefill), (decode_server, decode), _ = instances
    silent = Instance(prefill_server.url, "prefill", kv_host="127.0.0.1", kv_port=9)
    server = router_over([silent, Instance(decode_server.url, "decode")])
    try:
        body = {"model": MODEL, "prompt": token_prompt(20, 9), "max_tokens": 4}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    finally:
        server.stop()
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert "KV transfer failed: the prefill instance's KV endpoint 127.0.0.1:9 did not answer" in (
        message
    )
    assert_idle(decode)
    assert wait_until(lambda: not prefill.engine.has_kv_transfers(), timeout=10)
    assert_idle(prefill)


def dying_decode_app() -> FastAPI:
    """A decode instance that sends one event of its stream, then dies (the connection drops)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def events():
            yield b'data: {"choices": [{"index": 0, "text": " one"}]}\n\n'
            raise RuntimeError("killed")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_decode_instance_dying_mid_stream_ends_the_stream_with_an_error(instances):
    (prefill_server, prefill), _, _ = instances
    dying = ServerThread(dying_decode_app())
    server = router_over(
        [
            Instance(
                prefill_server.url,
                "prefill",
                kv_host="127.0.0.1",
                kv_port=prefill.engine.config.kv_port,
            ),
            Instance(dying.url, "decode"),
        ]
    )
    try:
        body = {"model": MODEL, "prompt": token_prompt(20, 10), "max_tokens": 8, "stream": True}
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, timeout=30
        ) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        server.stop()
        dying.stop()
    assert json.loads(events[0][6:])["choices"][0]["text"] == " one"
    error = json.loads(events[-1][6:])["error"]
    assert error["code"] == 502 and error["message"].startswith("The instance stopped mid-stream")
    # nobody pulls the prefill instance's lease: it runs out (5 s) and frees the blocks
    assert wait_until(lambda: not prefill.engine.has_kv_transfers(), timeout=10)
    assert_idle(prefill)


def test_bad_router_configuration_fails_at_start(instances):
    (prefill, _), (decode, _), (collocated, _) = instances
    with pytest.raises(RouterConfigError, match="The router has no instances"):
        check_instances([], [], [])
    with pytest.raises(RouterConfigError, match="needs both kinds"):
        check_instances([prefill.url], [], [])
    with pytest.raises(RouterConfigError, match="Cannot reach the decode instance http://127.0"):
        check_instances([prefill.url], ["http://127.0.0.1:9"], [])
    with pytest.raises(RouterConfigError, match="--disaggregation-mode prefill"):
        check_instances([collocated.url], [decode.url], [])


def loaded(url: str, load: int) -> Instance:
    return Instance(url, "collocated", polled_load=load)


def test_round_robin_takes_turns():
    a, b = loaded("a", 0), loaded("b", 0)
    policy = RoundRobin()
    assert [policy.choose([a, b], "x").url for _ in range(4)] == ["a", "b", "a", "b"]


def test_least_loaded_counts_what_it_sent_since_the_last_poll():
    a, b = loaded("a", 3), loaded("b", 1)
    policy = LeastLoaded()
    chosen = []
    for _ in range(3):
        instance = policy.choose([a, b], "x")
        instance.sent_since_poll += 1
        chosen.append(instance.url)
    assert chosen == ["b", "b", "a"]


def test_cache_aware_follows_the_longest_prefix_unless_load_is_imbalanced():
    a, b = loaded("a", 0), loaded("b", 0)
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    system = "You are a helpful assistant. " * 4
    assert policy.choose([a, b], system + "first").url == "a"
    assert policy.choose([a, b], "something else entirely").url == "b"  # the smaller tree
    assert policy.choose([a, b], system + "second").url == "a"  # the shared prefix is on a
    a.polled_load = 10  # imbalanced: 10 - 0 > 4 and 10 > 0 * 1.5
    assert policy.choose([a, b], system + "third").url == "b"


def test_cache_aware_keeps_the_same_prompt_under_two_adapters_apart():
    """A LoRA adapter (the `model` field) computes other K/V for the same prompt: the prefix
    tree keys on it, so a request follows the instance that ran its adapter's prefix."""
    a, b = loaded("a", 0), loaded("b", 0)
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    system = "You are a helpful assistant. " * 4
    assert policy.choose([a, b], system + "first", {"model": "sql"}).url == "a"
    assert policy.choose([a, b], system + "first", {"model": "chat"}).url == "b"  # no hit on a
    assert policy.choose([a, b], system + "second", {"model": "sql"}).url == "a"
    assert policy.choose([a, b], system + "second", {"model": "chat"}).url == "b"


@pytest.mark.parametrize(
    ("load_a", "load_b", "routed_to"),
    [
        (4, 1, "a"),  # ratio 4 > 1.5, gap 3 <= 4: balanced, by cache
        (30, 25, "a"),  # gap 5 > 4, ratio 1.2 <= 1.5: balanced, by cache
        (6, 2, "a"),  # gap 4 is not over 4 (ratio 3 is): balanced, by cache
        (15, 10, "a"),  # ratio 1.5 is not over 1.5 (gap 5 is): balanced, by cache
        (30, 19, "b"),  # gap 11 > 4 and ratio 1.58 > 1.5: imbalanced, the least loaded
    ],
)
def test_cache_aware_leaves_the_cache_only_when_both_gap_and_ratio_are_over(
    load_a, load_b, routed_to
):
    """Load is imbalanced when the most loaded instance has more than `balance_abs_threshold`
    requests over the least loaded AND more than `balance_rel_threshold` times its load; either
    condition alone keeps the request on the instance holding its prefix."""
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    a, b = loaded("a", load_a), loaded("b", load_b)
    system = "You are a helpful assistant. " * 4
    a.tree.insert(system + "first")
    b.tree.insert("something else entirely")
    assert policy.choose([a, b], system + "second").url == routed_to


def test_pd_profile_measures_the_instances_and_the_cost_model_router_uses_it(instances, tmp_path):
    """`quire bench pd-profile` on the running instances writes a profile the router loads; the
    cost-model router then answers as one collocated instance does, and learns from the
    answers it relayed."""
    (prefill_server, prefill), (decode_server, decode), (collocated_server, _) = instances
    path = tmp_path / "profile.json"
    args = argparse.Namespace(
        prefill=prefill_server.url,
        decode=decode_server.url,
        collocated=collocated_server.url,
        model=MODEL,
        output=str(path),
        prompt_lens=[BLOCK, 25 * BLOCK],
        batch_sizes=[1, 2],
        contexts=[8, 40],
        decode_tokens=64,
        gamma_prompt_len=8 * CHUNK,
        rounds=1,
        timeout=60.0,
    )
    assert pd_profile.main(args) == 0
    profile = load_profile(path)
    measured = json.loads(path.read_text())["measured"]
    moved = {s["prompt_tokens"]: s["bytes"] for s in measured["prefill_and_transfer"]}
    assert moved[25 * BLOCK] == 25 * moved[BLOCK]  # blocks x block bytes
    assert profile.kv_bytes_per_token == moved[BLOCK] / BLOCK
    assert profile.chunk_tokens == CHUNK
    assert {(s["batch"], s["context"]) for s in measured["decode_steps"]} == {
        (1, 8), (2, 8), (1, 40), (2, 40)
    }  # fmt: skip

    router = Router(
        check_instances([prefill_server.url], [decode_server.url], [collocated_server.url]),
        "cost_model",
        cost_profile=profile,
    )
    server = ServerThread(build_router_app(router))
    try:
        prompt = token_prompt(CHUNK + 3, 11)
        expected = completion(collocated_server.url, prompt, ignore_eos=True)["choices"][0]["text"]
        assert completion(server.url, prompt, ignore_eos=True)["choices"][0]["text"] == expected
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
        body["ignore_eos"] = True
        assert streamed_text(server.url, "/v1/completions", body) == expected
        state = httpx.get(server.url + "/load").json()["policy_state"]
    finally:
        server.stop()
    assert sum(state["choices"].values()) == 2
    assert sum(a["requests"] for a in state["accuracy"].values()) == 1  # the streamed one
    assert router.first.routing.outputs.predict(CHUNK + 3, max_tokens=None) == 10
    assert not any(router.first.routing.flights.values())
    assert_idle(prefill, decode)

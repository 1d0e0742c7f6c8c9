"""`quire cluster` on a two-node Ray cluster on this machine: the prefill instance lands on the
node offering `quire_prefill`, the decode instances on the one offering `quire_decode`; greedy
output through the router equals one collocated instance's; a decode instance killed is routed
around (the request that met it is retried) and replaced by its supervisor."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.exceptions import RayActorError
from server_utils import completion_text, router_retries, wait_until

from quire import LLM, SamplingParams
from quire.cluster.placement import ClusterConfigError, QuireCluster
from quire.engine_args import EngineArgs
from quire.entrypoints.cli import main

BLOCK = 16
CHUNK = 24
SMALL_OBJECT_STORE = 80 * 2**20


@pytest.fixture(scope="module")
def nodes():
    """(head node id, worker node id): the head offers quire_prefill, the worker quire_decode.

    Ray's memory monitor is off: it kills a node's workers when the whole host is short of
    memory, and on a shared CI host that is other processes' doing, not these small actors'."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_memory_monitor_refresh_ms", "0")
        yield from two_nodes()


def two_nodes():
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=1,
            resources={"quire_prefill": 1},
            object_store_memory=SMALL_OBJECT_STORE,
            include_dashboard=False,
        ),
    )
    worker = cluster.add_node(
        num_cpus=1, resources={"quire_decode": 2}, object_store_memory=SMALL_OBJECT_STORE
    )
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster.head_node.node_id, worker.node_id
    ray.shutdown()
    cluster.shutdown()


def engine_args(model: str, **kwargs) -> EngineArgs:
    settings = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK)
    return EngineArgs(model=model, **settings, num_kv_blocks=48, **kwargs)


@pytest.fixture(scope="module")
def cluster(nodes, tiny_llama):
    placed = QuireCluster(
        engine_args(tiny_llama, kv_lease_timeout=2.0, kv_transfer_timeout=2.0),
        {"prefill": 1, "decode": 2},
        port=0,
        served_model_name="tiny",
        cpus_per_instance=0,
        poll_interval_s=60.0,  # the tests see the failures requests meet, not polls
        replace_timeout_s=60.0,
    )
    yield placed
    placed.shutdown()


@pytest.fixture(scope="module")
def collocated(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK)


def token_prompt(length: int, salt: int) -> list[int]:
    return [(53 * j + 997 * salt) % 40000 + 10 for j in range(length)]


def completion(prompt: list[int], stream: bool) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}
    return body | {"ignore_eos": True, "stream": stream}


def expected_text(llm: LLM, prompt: list[int]) -> str:
    sampling = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)[0].outputs[0].text


def assert_all_blocks_free(cluster: QuireCluster) -> None:
    for instance in cluster.instances:
        assert wait_until(
            lambda a=instance.actor: ray.get(a.num_free_blocks.remote()) == (48, 48)
        ), f"{instance.role} instance {instance.url} holds blocks"


def kill(actor) -> None:
    """Kills the actor's process and returns once Ray knows it is dead (ray.kill does not
    wait)."""

    def dead() -> bool:
        try:
            ray.get(actor.ping.remote(), timeout=10)
        except RayActorError:
            return True
        return False

    ray.kill(actor)
    assert wait_until(dead, timeout=30)


def test_each_role_runs_on_the_node_offering_its_resource(nodes, cluster):
    head, worker = nodes
    assert [(i.role, i.node_id) for i in cluster.instances] == [
        ("prefill", head),
        ("decode", worker),
        ("decode", worker),
    ]


@pytest.mark.parametrize("length", [5, 2 * BLOCK, CHUNK + 2 * BLOCK + 3])
def test_greedy_output_equals_one_collocated_instance(cluster, collocated, length):
    prompt = token_prompt(length, length)
    expected = expected_text(collocated, prompt)
    assert completion_text(cluster.url, completion(prompt, False), 120) == expected
    assert completion_text(cluster.url, completion(prompt, True), 120) == expected
    requests = httpx.get(cluster.url + "/metrics").text
    assert 'quire_router_requests_total{route="disaggregated"}' in requests
    assert_all_blocks_free(cluster)


def test_a_killed_decode_instance_is_routed_around_and_replaced(nodes, cluster, collocated):
    _, worker = nodes
    killed = cluster.instances[1]
    kill(killed.actor)
    before = router_retries(cluster.url, "decode")
    prompts = [token_prompt(20, 1), token_prompt(20, 2)]
    # round robin over the two decode instances: one of the two requests meets the dead one
    assert [completion_text(cluster.url, completion(p, True), 120) for p in prompts] == [
        expected_text(collocated, p) for p in prompts
    ]
    assert router_retries(cluster.url, "decode") == before + 1
    load = httpx.get(cluster.url + "/load").json()["instances"]
    assert {i["url"]: i["healthy"] for i in load}[killed.url] is False

    assert cluster.check() == [killed]
    replacement = cluster.instances[1]
    assert replacement.role == "decode" and replacement.node_id == worker
    assert replacement.url != killed.url
    load = httpx.get(cluster.url + "/load").json()["instances"]
    assert killed.url not in [i["url"] for i in load]
    assert replacement.url in [i["url"] for i in load]
    prompt = token_prompt(30, 3)
    assert [completion_text(cluster.url, completion(prompt, False), 120) for _ in range(2)] == [
        expected_text(collocated, prompt)
    ] * 2
    assert router_retries(cluster.url, "decode") == before + 1
    assert_all_blocks_free(cluster)


def test_a_prefill_instance_killed_before_its_kv_is_pulled_is_a_clear_error(cluster):
    """The prefill instance answered (its KV leased), then its process is killed: the decode
    instance's pull gets no answer, and the client an error naming the endpoint within the
    transfer timeout (2 s); the surviving instances hold no block. (Last: it kills the only
    prefill instance.)"""
    prefill, decode = cluster.instances[0], cluster.instances[2]
    body = {"model": "tiny", "prompt": token_prompt(40, 4), "max_tokens": 4, "temperature": 0}
    params = {"do_remote_decode": True, "transfer_id": "killed"}
    response = httpx.post(
        prefill.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60
    )
    assert response.status_code == 200
    kv = httpx.get(prefill.url + "/load").json()["kv_endpoint"]
    kill(prefill.actor)
    params = {
        "do_remote_prefill": True,
        "transfer_id": "killed",
        "remote_host": kv["host"],
        "remote_port": kv["port"],
    }
    response = httpx.post(
        decode.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60
    )
    assert response.status_code == 500
    assert (
        f"KV transfer failed: the prefill instance's KV endpoint {kv['host']}:{kv['port']} did "
        "not answer within 2 s" in response.json()["error"]["message"]
    )
    cluster.instances.remove(prefill)
    assert_all_blocks_free(cluster)


def test_instances_the_cluster_does_not_offer_fail_before_placing(nodes, tiny_llama):
    with pytest.raises(ClusterConfigError, match=r"2 prefill instances need 2 units .* offers 1"):
        QuireCluster(engine_args(tiny_llama), {"prefill": 2, "decode": 1})
    with pytest.raises(ClusterConfigError, match="quire cluster sets each instance's role"):
        QuireCluster(engine_args(tiny_llama, disaggregation_mode="decode"), {"decode": 1})


def test_the_command_refuses_bad_counts_before_joining_ray(capsys):
    assert main(["cluster", "--num-prefill", "1"]) == 2
    error = capsys.readouterr().err
    assert error == "error: Prefill instances need decode instances: give --num-decode.\n"


def test_quire_imports_and_builds_its_commands_without_ray():
    code = (
        "import sys; sys.modules['ray'] = None\n"  # `import ray` now fails
        "from quire.entrypoints.cli import build_parser\n"
        "import quire.cluster.placement, quire.router.app\n"
        "build_parser().parse_args(['cluster', '--num-prefill', '1', '--num-decode', '1'])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

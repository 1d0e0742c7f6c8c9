"""The Ray executor (`distributed_executor_backend="ray"`) on a two-node Ray cluster on this
machine: two tensor-parallel ranks on different nodes give one rank's greedy tokens (float32, up
to near-ties) and leave every block free, as do two pipeline stages on the two nodes, each placed
by a placement group of its own, with two steps in flight; a rank whose actor is killed (a
tensor-parallel rank, a stage) fails the next step within seconds, naming the rank; Ray arguments that cannot work fail at start, saying what to
change."""

from __future__ import annotations

import socket
import time

import pytest
import ray
from conftest import assert_idle, make_llm
from ray.cluster_utils import Cluster
from test_tensor_parallel import PROMPTS, assert_close_greedy, run

from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.executor.base import WorkerDiedError

SMALL_OBJECT_STORE = 100 * 2**20


@pytest.fixture(scope="module")
def nodes():
    """The ids of two Ray nodes on this machine (the head with two CPUs, the other with one),
    with this process connected.

    Ray's memory monitor is off: it kills a node's workers when the whole host is short of
    memory, and on a shared CI host that is other processes' doing, not these small actors'."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_memory_monitor_refresh_ms", "0")
        cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(
                num_cpus=2, object_store_memory=SMALL_OBJECT_STORE, include_dashboard=False
            ),
        )
        worker = cluster.add_node(num_cpus=1, object_store_memory=SMALL_OBJECT_STORE)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster.head_node.node_id, worker.node_id
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def spread_llm(nodes, tiny_llama):
    """Two ranks, one on each node (STRICT_SPREAD): no shared memory between them."""
    llm = make_llm(
        tiny_llama,
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        ray_placement_strategy="STRICT_SPREAD",
    )
    yield llm
    llm.engine.shutdown()


def the_placement_group() -> dict:
    """The one placement group of the cluster that holds resources (Ray's table)."""
    (group,) = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    return group


def test_ranks_packed_on_one_node_run_the_c_step_over_shared_memory(nodes, tiny_llama):
    """STRICT_PACK, the default: both ranks on the one node with room for them, where the
    decode step's all-reduces go through shared memory, inside the C step."""
    llm = make_llm(
        tiny_llama, dtype="bfloat16", tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    try:
        assert list(the_placement_group()["bundles_to_node_id"].values()) == [nodes[0]] * 2
        assert [s.c_decode_step for s in llm.engine.worker_states()] == [True, True]
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]
        assert_idle(llm)
    finally:
        llm.engine.shutdown()


def test_ranks_on_two_nodes_give_one_ranks_greedy_tokens(nodes, spread_llm, tiny_llama):
    assert sorted(the_placement_group()["bundles_to_node_id"].values()) == sorted(nodes)
    one = LLM(tiny_llama, dtype="float32", num_kv_blocks=64)
    assert_close_greedy(run(one), run(spread_llm))
    states = spread_llm.engine.worker_states()
    assert [(s.rank, s.num_kv_blocks) for s in states] == [(0, 64), (1, 64)]
    assert_idle(spread_llm)


def test_a_killed_rank_actor_fails_the_engine_within_seconds(spread_llm):
    """(Last of the module's tests on `spread_llm`: it ends its ranks.)"""
    group_id = the_placement_group()["placement_group_id"]
    ray.kill(ray.get_actor(f"quire-rank-1-{group_id}"))
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="The worker rank 1 actor died"):
        spread_llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 5
    assert ray.util.placement_group_table()[group_id]["state"] == "REMOVED"  # rank 0 ended too
    with pytest.raises(WorkerDiedError, match="The workers have ended"):
        spread_llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)


@ray.remote(num_cpus=1)
class _HoldACpu:
    def ready(self) -> bool:
        return True


def test_two_stages_on_two_nodes_give_one_stages_greedy_tokens(nodes, tiny_llama):
    """A CPU of the head held by another actor leaves one CPU on each node, so the two stages'
    placement groups land on different nodes: hidden states cross between Ray nodes. Then a
    killed stage actor fails the engine within seconds. (After the test that ends
    `spread_llm`: the cluster's CPUs are free again.)"""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    hold = _HoldACpu.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[0], soft=False)
    ).remote()
    ray.get(hold.ready.remote())
    one = LLM(tiny_llama, dtype="float32", num_kv_blocks=64)
    two = make_llm(
        tiny_llama,
        dtype="float32",
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
    )
    try:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert sorted(len(g["bundles"]) for g in groups) == [1, 1]  # a group per stage
        placed = [node for g in groups for node in g["bundles_to_node_id"].values()]
        assert sorted(placed) == sorted(nodes)  # one stage on each node
        assert_close_greedy(run(one), run(two))
        assert two.stats().most_steps_in_flight == 2
        assert_idle(two)
        ray.kill(_the_actor_of_rank(1, groups))
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            two.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 5
    finally:
        two.engine.shutdown()
        ray.kill(hold)


def _the_actor_of_rank(rank: int, groups: list[dict]):
    """The rank's actor, named after the placement group of its stage (executor/ray.py)."""
    for group in groups:
        try:
            return ray.get_actor(f"quire-rank-{rank}-{group['placement_group_id']}")
        except ValueError:
            continue
    raise AssertionError(f"no actor for rank {rank}")


def test_a_ray_address_where_nothing_answers_fails_at_start(tiny_llama):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
        start = time.monotonic()
        with pytest.raises(
            ValueError,
            match=f"No Ray cluster answers at ray_address '{address}' .*Connection refused.*: "
            "start one with `ray start --head --port 6379`",
        ):
            LLM(tiny_llama, distributed_executor_backend="ray", ray_address=address)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("address", ["6379", "head:port", "head:0", ":6379"])
def test_a_ray_address_that_is_not_host_port_is_refused(address):
    with pytest.raises(ValueError, match=f"ray_address must be HOST:PORT .* got '{address}'"):
        EngineConfig(distributed_executor_backend="ray", ray_address=address)


@pytest.mark.parametrize(
    "name, value", [("ray_address", "auto"), ("ray_placement_strategy", "SPREAD")]
)
def test_ray_arguments_without_the_ray_backend_are_refused(name, value):
    with pytest.raises(
        ValueError,
        match=f"{name} places the ranks of distributed_executor_backend 'ray'; with 'mp' leave",
    ):
        EngineConfig(tensor_parallel_size=2, **{name: value})


def test_an_engine_core_process_with_ray_ranks_is_refused_at_start():
    with pytest.raises(ValueError, match="engine_core_process does not drive Ray actors"):
        EngineConfig(distributed_executor_backend="ray", engine_core_process=True)

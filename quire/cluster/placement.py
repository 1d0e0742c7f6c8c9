"""`quire cluster`: prefill, decode and collocated instances and the router as Ray actors.

Each prefill instance is an actor that takes one unit of the custom resource `quire_prefill`,
each decode instance one of `quire_decode`, each collocated one of `quire_collocated`: the nodes
that offer a resource (`ray start --resources '{"quire_decode": 2}'`) are where that role runs,
as many instances per node as units. The router runs on the node of the `quire cluster` command
itself. Ray places and supervises the processes; HTTP and the KV bytes go between the instances
over quire's own transports, never through Ray.

A `QuireCluster` checks its actors every `check_interval_s`: an instance whose actor died (the
process crashed, its node left, or it was killed) is logged with its role and node, and replaced
by a new instance of its role, which the router routes to instead. Until then, the router has
stopped routing to the dead one on its own: a refused connection marks an instance down, and a
request that had not streamed a byte yet is retried on another instance of its role.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from quire.cluster.servers import InstanceServer, RouterServer
from quire.engine_args import EngineArgs

logger = logging.getLogger(__name__)

ROLE_RESOURCES = {
    "prefill": "quire_prefill",
    "decode": "quire_decode",
    "collocated": "quire_collocated",
}


class ClusterConfigError(ValueError):
    """The Ray cluster cannot hold the instances asked for, or the arguments contradict."""


class PlacementError(RuntimeError):
    """An instance or the router failed to start or to answer Ray."""


@dataclass
class PlacedInstance:
    role: str  # "prefill", "decode" or "collocated"
    actor: Any  # the Ray actor handle of an InstanceServer
    url: str
    node_id: str


def connect(address: str | None, num_instances: dict[str, int]) -> None:
    """Joins the Ray cluster at `address` ("auto": the one this node belongs to), or starts a
    one-node cluster here that offers every role's resource."""
    import ray

    if ray.is_initialized():
        return
    if address is None:
        resources = {ROLE_RESOURCES[role]: n for role, n in num_instances.items() if n}
        ray.init(resources=resources, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


def check_arguments(engine_args: EngineArgs, num_instances: dict[str, int]) -> None:
    """ClusterConfigError if the instance counts or the engine arguments cannot make a cluster
    (checked before Ray is started or joined)."""
    defaults = EngineArgs()
    if any(
        getattr(engine_args, name) != getattr(defaults, name)
        for name in ("disaggregation_mode", "kv_transfer_config", "kv_host", "kv_port")
    ):
        raise ClusterConfigError(
            "quire cluster sets each instance's role and KV endpoint: leave out "
            "--disaggregation-mode, --kv-transfer-config, --kv-host and --kv-port, and give "
            "--num-prefill / --num-decode / --num-collocated."
        )
    if any(n < 0 for n in num_instances.values()):
        raise ClusterConfigError(f"Instance counts must be 0 or more; got {num_instances}.")
    if num_instances.get("prefill", 0) and not num_instances.get("decode", 0):
        raise ClusterConfigError("Prefill instances need decode instances: give --num-decode.")
    if not any(num_instances.values()):
        raise ClusterConfigError("Give at least one instance (--num-prefill and --num-decode).")


def check_resources(num_instances: dict[str, int]) -> None:
    """ClusterConfigError unless the cluster offers a unit of each role's resource per instance."""
    import ray

    offered = ray.cluster_resources()
    for role, count in num_instances.items():
        name = ROLE_RESOURCES[role]
        if offered.get(name, 0) < count:
            raise ClusterConfigError(
                f"{count} {role} instances need {count} units of the Ray resource {name!r}, and "
                f"the cluster offers {offered.get(name, 0):g}: start the nodes meant for them "
                f"with `ray start ... --resources '{{\"{name}\": N}}'`."
            )


class QuireCluster:
    """The instances and the router of one `quire cluster`, as Ray actors."""

    def __init__(
        self,
        engine_args: EngineArgs,
        num_instances: dict[str, int],
        policy: str = "round_robin",
        host: str = "127.0.0.1",
        port: int = 8000,
        served_model_name: str | None = None,
        cpus_per_instance: float = 1.0,
        gpus_per_instance: float = 0.0,
        poll_interval_s: float = 0.5,
        replace_timeout_s: float = 120.0,
    ):
        """Places the instances (they start in parallel) and then the router; an instance
        that fails to start stops everything with its error. Ray must be connected."""
        from quire.entrypoints.api_server import DEFAULT_MODEL_NAME
        from quire.router.policies import make_policy

        check_arguments(engine_args, num_instances)
        make_policy(policy)  # a bad name fails before anything is placed
        check_resources(num_instances)
        self.engine_args = engine_args
        self.served_model_name = served_model_name or engine_args.model or DEFAULT_MODEL_NAME
        self.cpus_per_instance = cpus_per_instance
        self.gpus_per_instance = gpus_per_instance
        self.replace_timeout_s = replace_timeout_s
        self.instances: list[PlacedInstance] = []
        self.router: Any = None
        try:
            self.instances = self._place(
                [role for role, n in num_instances.items() for _ in range(n)]
            )
            self.router = self._place_router(policy, host, port, poll_interval_s)
            self.url = _get(self.router.url.remote(), "the router")
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "quire cluster: router at %s over %s",
            self.url,
            ", ".join(f"{i.role} {i.url}" for i in self.instances),
        )

    def _place(self, roles: list[str], timeout_s: float | None = None) -> list[PlacedInstance]:
        """Instances of `roles`, started in parallel; if one fails to start (or is not placed
        within `timeout_s`), all of them are ended and the error raised."""
        import ray

        actor_class = ray.remote(InstanceServer)
        actors = [
            actor_class.options(
                num_cpus=self.cpus_per_instance,
                num_gpus=self.gpus_per_instance,
                resources={ROLE_RESOURCES[role]: 1},
            ).remote(
                self.engine_args,
                None if role == "collocated" else role,
                self.served_model_name,
            )
            for role in roles
        ]
        placed = []
        for role, actor in zip(roles, actors):
            try:
                url, node_id = _get(
                    [actor.url.remote(), actor.node_id.remote()], f"a {role} instance", timeout_s
                )
            except BaseException:
                for other in actors:
                    ray.kill(other)
                raise
            placed.append(PlacedInstance(role, actor, url, node_id))
        return placed

    def _place_router(self, policy: str, host: str, port: int, poll_interval_s: float) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        urls = {role: [i.url for i in self.instances if i.role == role] for role in ROLE_RESOURCES}
        return (
            ray.remote(RouterServer)
            .options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
            )
            .remote(
                urls["prefill"],
                urls["decode"],
                urls["collocated"],
                policy,
                host,
                port,
                poll_interval_s,
            )
        )

    def check(self) -> list[PlacedInstance]:
        """The instances whose actor died since the last check, each replaced by a new instance
        of its role that the router now routes to instead. A dead router raises."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        _get(self.router.ping.remote(), "the router", self.replace_timeout_s)
        dead = []
        for instance in list(self.instances):
            try:
                ray.get(instance.actor.ping.remote(), timeout=self.replace_timeout_s)
            except GetTimeoutError:
                logger.warning(
                    "The %s instance %s does not answer Ray", instance.role, instance.url
                )
            except RayActorError as error:
                logger.error(
                    "The %s instance %s (node %s) died: %s",
                    instance.role,
                    instance.url,
                    instance.node_id,
                    str(error).splitlines()[0],
                )
                dead.append(instance)
        for instance in dead:
            index = self.instances.index(instance)
            try:
                new = self._replace(instance)
            except PlacementError as error:
                logger.error("Could not replace it: %s", error)
                del self.instances[index]
                continue
            self.instances[index] = new
            logger.info(
                "Replaced it with the %s instance %s (node %s)", new.role, new.url, new.node_id
            )
        return dead

    def _replace(self, dead: PlacedInstance) -> PlacedInstance:
        """A new instance of `dead`'s role, which the router routes to instead of `dead`."""
        import ray

        (new,) = self._place([dead.role], timeout_s=self.replace_timeout_s)
        try:
            _get(self.router.replace_instance.remote(dead.url, new.role, new.url), "the router")
        except PlacementError:  # the router cannot reach it
            ray.kill(new.actor)
            raise
        return new

    def supervise(self, check_interval_s: float = 2.0) -> None:
        """Checks (and replaces dead instances) until interrupted."""
        while True:
            time.sleep(check_interval_s)
            self.check()

    def shutdown(self) -> None:
        """Stops the router and every instance and ends their actors."""
        import ray

        actors = [i.actor for i in self.instances] + ([self.router] if self.router else [])
        for actor in actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception as error:  # a dead actor has nothing left to stop
                logger.debug("stopping an actor: %r", error)
            ray.kill(actor)
        self.instances, self.router = [], None


def _get(refs: Any, what: str, timeout_s: float | None = None) -> Any:
    """ray.get(refs); an actor that died or failed (or no answer within `timeout_s`) is a
    PlacementError saying `what` failed and why."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as error:
        raise PlacementError(
            f"{what} gave no answer within {timeout_s:g} s (a new actor waits for a free unit "
            "of its resource: `ray status` shows them)"
        ) from error
    except RayError as error:
        raise PlacementError(f"{what} failed: {error}") from error

"""RayExecutor: each rank (tensor_parallel_size in each of pipeline_parallel_size stages) a Ray
actor running quire's Worker, placed by Ray placement groups on any node of a Ray cluster; each
step sent to every rank, the output of the last stage's first rank returned.

The executor joins the cluster at `ray_address` (or starts a one-node cluster here), reserves a
bundle of CPUs per rank, a placement group per pipeline stage (`ray_placement_strategy`:
STRICT_PACK keeps a stage's tensor-parallel group on one node; stages go wherever Ray finds
room, other nodes included) and starts an actor in each. The actors report their node; rank 0's
picks a free port, and the ranks form their gloo group (NCCL on a GPU) at rank 0's node address.
Then each actor connects back to this process (a `multiprocessing.connection` over TCP, with a
key made for it) and serves steps over it until shutdown, as `mp`'s worker processes do over
their pipes: the steps, several in flight, go the way MultiprocExecutor sends them, not through
Ray calls, whose round trip would cost each step more than a small model's forward (measured in
docs/BENCHMARKS.md). Ranks that all
share one node all-reduce through shared memory, as `mp`'s do; otherwise every collective goes
over gloo, bound to the interface of each node's Ray address. Each rank is pinned to its share
of its node's cores (those of the ranks of this executor on that node).

A rank whose actor dies (killed, crashed, its node lost) fails the step that waits on it with
`WorkerDiedError` naming the rank, as soon as Ray reports its `serve` call ended or its
connection closes, whichever rank the engine waits on;
a rank whose step raised sends its traceback. Either way the other ranks may be stuck in a
collective, so every actor is killed and the executor runs no more steps.

This module imports Ray; it is imported only when the backend is `ray` (make_executor).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from quire.config import QuireConfig
from quire.distributed.parallel_state import RankPlacement
from quire.executor import child_process
from quire.executor.base import WorkerDiedError
from quire.executor.multiproc import MultiprocExecutor, serve_steps

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # for Ray to reserve every rank's CPUs
CONNECT_TIMEOUT_S = 5.0  # for the head at ray_address to accept a TCP connection
PEER_DEATH_S = 3.0  # how long a rank whose step failed waits for Ray to report a dead peer
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class RankActor:
    """One rank inside its Ray actor: where it runs, then its Worker and the calls the
    executor makes on it."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node(self) -> tuple[str, str]:
        """(Ray node id, the node's address as the cluster knows it)."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port nothing listens on now at this node's address (the OS picks it)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((ray.util.get_node_ip_address(), 0))
            return sock.getsockname()[1]

    def start(
        self, config: QuireConfig, placement: RankPlacement, local_index: int, cpus: int
    ) -> int:
        """Builds the rank's Worker (joining the group), pinned to the `local_index`-th share
        of `cpus` of this node's cores; its KV pool in blocks."""
        from quire.executor.plugins import make_kv_connector, make_proposer
        from quire.worker.worker import Worker

        if not placement.same_host:
            interface = interface_of(ray.util.get_node_ip_address())
            if interface is not None:  # else gloo binds what the host name resolves to
                os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        cores = sorted(os.sched_getaffinity(0))[local_index * cpus : (local_index + 1) * cpus]
        placement = RankPlacement(
            placement.rank,
            placement.world_size,
            placement.port,
            cores if len(cores) == cpus else None,
            placement.host,
            placement.same_host,
        )
        self.worker = Worker(
            config,
            placement,
            proposer=make_proposer(config),
            kv_connector=make_kv_connector(config),
        )
        return self.worker.num_kv_blocks

    def serve(self, address: tuple[str, int], authkey: bytes, rank: int) -> None:
        """Answers the executor's steps over a connection to `address` (multiproc.py's
        serve_steps) until it shuts down or goes away: this call holds the actor till then."""
        pipe = Client(tuple(address), authkey=authkey)
        try:
            pipe.send(rank)
            serve_steps(pipe, self.worker)
        finally:
            pipe.close()


class _Serving:
    """A rank's actor as multiproc.py's step loop sees a worker process: alive while its `serve`
    call runs."""

    exitcode = None  # the death is reported from Ray's error (RayExecutor._raise_if_one_died)

    def __init__(self, actor: Any, serving: Any):
        self.actor, self.serving = actor, serving

    def is_alive(self) -> bool:
        return not ray.wait([self.serving], timeout=0)[0]

    def terminate(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        ray.wait([self.serving], timeout=timeout)


class RayExecutor(MultiprocExecutor):
    """MultiprocExecutor's steps, over a connection per actor (below); Ray places the ranks,
    starts them and tells when one dies."""

    _worker_noun = "actor"

    def __init__(self, config: QuireConfig):
        parallel = config.parallel
        world_size, tp = parallel.world_size, parallel.tensor_parallel_size
        self._started_ray = connect(parallel.ray_address)
        self._actors: list[Any] = []
        self._groups: list[Any] = []  # a placement group per pipeline stage
        self._init_steps(config)
        try:
            cpus = cpus_per_rank(world_size)
            for _ in range(parallel.pipeline_parallel_size):
                self._groups.append(place(tp, cpus, parallel.ray_placement_strategy))
            actor_class = ray.remote(RankActor)
            self._actors = [
                actor_class.options(
                    # `ray list actors` names each rank
                    name=f"quire-rank-{rank}-{self._groups[rank // tp].id.hex()}",
                    num_cpus=cpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._groups[rank // tp], placement_group_bundle_index=rank % tp
                    ),
                ).remote()
                for rank in range(world_size)
            ]
            nodes = self._ray_call_all("node")  # (node id, address) per rank
            node_ids = [node_id for node_id, _ in nodes]
            host = nodes[0][1]  # the ranks meet at rank 0's node
            port = (
                parallel.tensor_parallel_port
                or self._ray_gather([self._actors[0].free_port.remote()])[0]
            )
            same_host = len(set(node_ids)) == 1  # by node id, not address: shared memory
            starts = []
            for rank, actor in enumerate(self._actors):
                placement = RankPlacement(rank, world_size, port, None, host, same_host)
                local_index = node_ids[:rank].count(node_ids[rank])  # among its node's ranks
                starts.append(actor.start.remote(config, placement, local_index, cpus))
            self.num_kv_blocks = min(self._ray_gather(starts))
            self._open_channels()
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "Started %d Ray actor(s) of %d CPU(s) on %d node(s), rendezvous %s:%d",
            world_size,
            cpus,
            len(set(node_ids)),
            host,
            port,
        )

    def _open_channels(self) -> None:
        """Each rank's steps over a connection of its own to this process (see the module
        doc). Ray keeps the actors' lives: a `serve` call that ends is the rank's death."""
        authkey = os.urandom(32)
        with socket.create_server((ray.util.get_node_ip_address(), 0)) as server:
            server.settimeout(child_process.POLL_S)
            address = server.getsockname()[:2]
            self._processes = [
                _Serving(actor, actor.serve.remote(address, authkey, rank))
                for rank, actor in enumerate(self._actors)
            ]
            pipes: list[Connection | None] = [None] * len(self._actors)
            deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
            while None in pipes:
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    self._raise_if_one_died()
                    if time.monotonic() > deadline:
                        raise WorkerDiedError(
                            f"Ray rank(s) {[r for r, p in enumerate(pipes) if p is None]} did "
                            f"not connect to {address[0]}:{address[1]} within "
                            f"{PLACEMENT_TIMEOUT_S:.0f} s."
                        ) from None
                    continue
                sock.settimeout(None)
                pipe = Connection(sock.detach())
                deliver_challenge(pipe, authkey)
                answer_challenge(pipe, authkey)
                pipes[pipe.recv()] = pipe
        self._pipes = pipes

    def _ray_call_all(self, method: str, *args: Any) -> list:
        """Calls `method` on every rank's actor (before the ranks serve steps); their answers,
        in rank order."""
        return self._ray_gather([getattr(actor, method).remote(*args) for actor in self._actors])

    def _ray_gather(self, refs: list) -> list:
        """The results of one call per rank (`refs` in rank order), taken as they come, so a
        rank that died raises WorkerDiedError while the others wait on it in a collective (a
        rank whose call failed because its peer went away is reported as that death); any
        failure ends every rank."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    try:
                        results[rank_of[ref]] = _result(ref, rank_of[ref])
                    except WorkerDiedError:
                        raise
                    except RuntimeError:
                        others, _ = ray.wait(
                            pending, num_returns=len(pending), timeout=PEER_DEATH_S
                        )
                        for other in others:
                            _result(other, rank_of[other])  # raises for a dead actor
                        raise
        except BaseException:
            self._end_workers()  # the other ranks may wait in a collective forever
            raise
        return results

    def _raise_if_one_died(self, cause: BaseException | None = None) -> None:
        serving = [process.serving for process in self._processes]
        done, _ = ray.wait(serving, num_returns=len(serving), timeout=0)
        for rank, ref in enumerate(serving):
            if ref in done:
                _result(ref, rank)  # a dead actor, or its serve call's failure
                raise WorkerDiedError(f"The worker rank {rank} actor stopped serving.") from cause

    def _end_workers(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        for group in self._groups:
            remove_placement_group(group)
        self._groups = []
        self._stop_sender()  # its writes fail now that no rank reads
        for pipe in self._pipes:
            pipe.close()
        self._pipes, self._processes = [], []

    def shutdown(self) -> None:
        """Tells the ranks to stop serving (after the steps in flight), then kills the actors
        (nothing in them needs an orderly end) and frees their CPUs; ends Ray if this executor
        started or joined it."""
        if self._pipes:
            super().shutdown()
        self._end_workers()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def _result(ref: Any, rank: int) -> Any:
    try:
        return ray.get(ref)
    except RayActorError as error:
        raise WorkerDiedError(
            f"The worker rank {rank} actor died: {str(error).splitlines()[0]}"
        ) from error
    except RayTaskError as error:
        raise RuntimeError(f"The worker rank {rank} failed:\n{error}") from error


def connect(address: str | None) -> bool:
    """Joins the Ray cluster at `address` ("auto": the one this node belongs to), or starts a
    one-node cluster here; whether this call did (False: this process was connected already).
    A HOST:PORT where nothing answers is a ValueError at once, not Ray's minute of retries."""
    if address is not None and address != "auto":
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as error:
            raise ValueError(_unreachable(address, error)) from error
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except ConnectionError as error:
        raise ValueError(_unreachable(address, error)) from error
    return True


def _unreachable(address: str | None, error: Exception) -> str:
    return (
        f"No Ray cluster answers at ray_address {address!r} ({error}): start one with "
        "`ray start --head --port 6379` and give HEAD_IP:6379, or leave ray_address out to "
        "start a one-node cluster here."
    )


def cpus_per_rank(world_size: int) -> int:
    """The CPUs each rank reserves: an equal share of the largest node's, at least one."""
    largest = max(
        (node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"]), default=0
    )
    return max(1, int(largest) // world_size)


def place(world_size: int, cpus: int, strategy: str) -> Any:
    """A placement group of one bundle of `cpus` CPUs per rank, once Ray has reserved them."""
    group = placement_group([{"CPU": cpus}] * world_size, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:
        remove_placement_group(group)
        raise ValueError(
            f"Ray could not place {world_size} ranks of {cpus} CPU(s) each ({strategy}) within "
            f"{PLACEMENT_TIMEOUT_S:g} s; the cluster has {ray.available_resources()} free. Add "
            "nodes, lower tensor_parallel_size or pipeline_parallel_size, or (STRICT_PACK needs "
            "one node with every rank of a stage's CPUs) choose another ray_placement_strategy."
        ) from None
    return group


def interface_of(ip: str) -> str | None:
    """The name of this host's network interface with IPv4 address `ip`, or None (none has
    it, or no Linux ioctl to ask)."""
    try:
        import fcntl
    except ImportError:
        return None
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                address = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24]
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(address) == ip:
                return name
    return None

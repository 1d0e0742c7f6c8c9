"""The scheduler side of the KV connector: which requests pull their prompt's K/V from a prefill
instance or lease theirs to a decode instance, and the step metadata that tells the worker side.

It holds ids, block ids and deadlines only; the scheduler (engine/scheduler.py) decides when a
request's blocks are allocated, leased and freed, and calls it:

- decode instance: a request whose `kv_transfer_params` say `do_remote_prefill` is admitted with
  blocks for its whole prompt (`add_load`: the blocks past its local prefix-cache hits are
  filled by the pull) and waits for its K/V; the pull's outcome comes back in the step's
  `KVConnectorOutput`.
- prefill instance: a request that says `do_remote_decode` is saved in the step that samples its
  first token (`add_save`) and finishes there; its blocks stay leased (`lease`) until the decode
  instance is done with them or `lease_timeout_s` passes (`expired`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from quire.messages import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLoadSpec,
    KVSaveSpec,
)


@dataclass(frozen=True)
class RemotePrefill:
    """A decode instance's request: where its prompt's K/V waits."""

    transfer_id: str
    host: str
    port: int


def remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The pull a request's `kv_transfer_params` ask for, if any; ValueError if malformed."""
    if not params or not params.get("do_remote_prefill"):
        return None
    try:
        return RemotePrefill(
            str(params["transfer_id"]), str(params["remote_host"]), int(params["remote_port"])
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            "kv_transfer_params with do_remote_prefill need transfer_id, remote_host and "
            f"remote_port; got {params!r}"
        ) from error


def remote_decode(params: dict[str, Any] | None) -> str | None:
    """The transfer id a prefill instance leases a request's blocks under, if it is asked to."""
    if not params or not params.get("do_remote_decode"):
        return None
    if "transfer_id" not in params:
        raise ValueError(
            f"kv_transfer_params with do_remote_decode need transfer_id; got {params!r}"
        )
    return str(params["transfer_id"])


@dataclass
class KVTransferStats:
    """Running totals, for metrics."""

    num_pulled: int = 0  # requests whose K/V arrived
    num_failed: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0  # summed pull time
    num_leases: int = 0  # leases given (prefill side)
    num_leases_expired: int = 0
    num_waiting: int = 0  # requests waiting for their K/V now
    num_leased: int = 0  # leases held now


class KVConnectorScheduler:
    def __init__(self, lease_timeout_s: float):
        self.lease_timeout_s = lease_timeout_s
        self._loads: dict[str, KVLoadSpec] = {}  # to start next step
        self._loading: set[str] = set()  # started (or to start), not finished
        self._cancels: list[str] = []
        self._saves: dict[str, KVSaveSpec] = {}
        self._releases: list[str] = []
        self._deadlines: dict[str, float] = {}  # transfer id -> lease end
        self.stats = KVTransferStats()

    # ---- decode side -----------------------------------------------------------------------
    def add_load(self, req_id: str, spec: KVLoadSpec) -> None:
        self._loads[req_id] = spec
        self._loading.add(req_id)

    def cancel_load(self, req_id: str) -> None:
        self._loading.discard(req_id)
        if self._loads.pop(req_id, None) is None:
            self._cancels.append(req_id)

    # ---- prefill side ----------------------------------------------------------------------
    def add_save(self, req_id: str, spec: KVSaveSpec) -> None:
        self._saves[req_id] = spec

    def lease(self, transfer_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._deadlines[transfer_id] = now + self.lease_timeout_s
        self.stats.num_leases += 1

    def expired(self, now: float | None = None) -> list[str]:
        """Leases past their deadline: given up here and released on the worker."""
        now = time.monotonic() if now is None else now
        gone = [t for t, deadline in self._deadlines.items() if deadline <= now]
        for transfer_id in gone:
            del self._deadlines[transfer_id]
        self._releases += gone
        self.stats.num_leases_expired += len(gone)
        return gone

    def end_leases(self, transfer_ids: list[str]) -> list[str]:
        """The leases among these still held (a lease can end twice: expired, then acked)."""
        ended = [t for t in transfer_ids if self._deadlines.pop(t, None) is not None]
        return ended

    # ---- the step --------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Whether the worker side must run a step even with no tokens to compute."""
        return bool(
            self._loading or self._cancels or self._saves or self._releases or self._deadlines
        )

    def metadata(self) -> KVConnectorMetadata:
        metadata = KVConnectorMetadata(
            load=self._loads, save=self._saves, cancel_loads=self._cancels, release=self._releases
        )
        self._loads, self._saves, self._cancels, self._releases = {}, {}, [], []
        return metadata

    def record(self, output: KVConnectorOutput) -> None:
        stats = self.stats
        for req_id, loaded in output.loaded.items():
            self._loading.discard(req_id)
            stats.num_pulled += 1
            stats.num_blocks += loaded.num_blocks
            stats.num_bytes += loaded.num_bytes
            stats.seconds += loaded.seconds
        for req_id in output.failed:
            self._loading.discard(req_id)
            stats.num_failed += 1

    def snapshot(self) -> KVTransferStats:
        return KVTransferStats(
            **{
                **self.stats.__dict__,
                "num_waiting": len(self._loading),
                "num_leased": len(self._deadlines),
            }
        )

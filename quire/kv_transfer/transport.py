"""The KV transport: a prefill instance serves its leased blocks over TCP (pyzmq), a decode
instance pulls them.

One request, one round trip. The decode side sends a JSON header (`op`, the transfer id, how many
leading blocks it already holds, its KV layout); the prefill side answers with a JSON header
(the first token and what decoding needs besides the blocks) and one frame per layer, each the
request's blocks of that layer contiguous: `[2 (K, V), num_blocks, block_size, num_kv_heads,
row]` in the cache's dtype (row: head_dim, or a quantized cache's codes and scale). So a request moves blocks x block bytes, nothing else. A second
message (`done`) ends the lease, whether the blocks were taken or the request was dropped.

A layout that differs (model, block size, KV dtype, heads, tensor-parallel size) is refused on
the first message with an error naming what differs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from quire.kernels import kv_format

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the server thread looks at its stop flag


class KVTransferError(RuntimeError):
    """A pull that failed: the peer refused it, is unreachable, or did not answer in time."""


@dataclass(frozen=True)
class KVLayout:
    """What two instances must agree on to exchange blocks."""

    model: str  # a fingerprint of the weights (kv_transfer/worker_connector.py)
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the KV cache's (kv_format.name): bfloat16, float32, int8, fp8_e4m3, fp8_e5m2
    tensor_parallel_size: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def differences(self, decode: dict[str, Any]) -> list[str]:
        """What differs between this (prefill) layout and a decode instance's, field by field."""
        return [
            f"{name} {mine!r} on the prefill instance, {decode.get(name)!r} on the decode instance"
            for name, mine in self.as_dict().items()
            if decode.get(name) != mine
        ]


@dataclass
class Lease:
    """A request's prompt blocks, held on the prefill instance until pulled."""

    block_ids: list[int]
    first_token_ids: list[int]  # one per sequence of the request (n), index order
    first_logprobs: list[dict[str, Any] | None]  # TopLogprobs fields, when asked for
    num_prompt_tokens: int
    seed: int | None


@dataclass
class PulledKV:
    first_token_ids: list[int]
    first_logprobs: list[dict[str, Any] | None]
    seed: int | None
    data: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    seconds: float


class KVServer:
    """Serves leases from a thread: `pull` reads the blocks (through `read_layer`, under the
    lock that `lock` exposes, so a lease is never read while it is being released) and `done`
    ends the lease. Bound at construction; `port` is the port it listens on."""

    def __init__(
        self,
        host: str,
        port: int,
        layout: KVLayout,
        read_blocks: Callable[[list[int]], torch.Tensor],
    ):
        self.layout = layout
        self._read_blocks = read_blocks
        self.lock = threading.Lock()
        self.leases: dict[str, Lease] = {}
        self._done: list[str] = []  # transfer ids ended by their decode instance, not yet taken
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:{port}")
        self.host = host
        self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self._thread.start()
        logger.info("KV transfer endpoint listening on %s:%d", host, port)

    def add(self, transfer_id: str, lease: Lease) -> None:
        with self.lock:
            self.leases[transfer_id] = lease

    def release(self, transfer_ids: list[str]) -> None:
        with self.lock:
            for transfer_id in transfer_ids:
                self.leases.pop(transfer_id, None)

    def take_done(self) -> list[str]:
        with self.lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()
        self._context.term()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            identity, *frames = self._socket.recv_multipart()
            try:
                reply = self._handle(json.loads(frames[0]))
            except Exception as error:  # a bad message must not end the server
                logger.exception("KV server: a request failed")
                reply = [_header(ok=False, error=f"the prefill instance failed: {error!r}")]
            self._socket.send_multipart([identity, *reply], copy=False)

    def _end_lease(self, transfer_id: str) -> None:
        with self.lock:
            if self.leases.pop(transfer_id, None) is not None:
                self._done.append(transfer_id)

    def _handle(self, message: dict[str, Any]) -> list[Any]:
        transfer_id = message.get("transfer_id")
        if message.get("op") == "done":
            self._end_lease(transfer_id)
            return [_header(ok=True)]
        differences = self.layout.differences(message.get("layout", {}))
        if differences:  # the lease is of no use to anyone: it ends now
            self._end_lease(transfer_id)
            return [
                _header(
                    ok=False,
                    error="incompatible prefill and decode instances: " + "; ".join(differences),
                )
            ]
        skip = int(message.get("skip_blocks", 0))
        with self.lock:
            lease = self.leases.get(transfer_id)
            if lease is None:
                return [
                    _header(
                        ok=False,
                        error=f"no KV leased under transfer id {transfer_id!r} on "
                        f"{self.host}:{self.port} (its lease ran out, or it was never "
                        "prefilled here)",
                    )
                ]
            data = self._read_blocks(lease.block_ids[skip:])
        header = _header(
            ok=True,
            first_token_ids=lease.first_token_ids,
            first_logprobs=lease.first_logprobs,
            seed=lease.seed,
            num_blocks=data.shape[2],
        )
        # One frame per layer, each contiguous: [2, num_blocks, block_size, heads, head_dim].
        return [header, *(data[i].contiguous().view(torch.uint8).numpy() for i in range(len(data)))]


def _header(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


class KVClient:
    """Pulls leases from prefill instances (one socket per pull: a peer that dies or hangs
    leaves nothing behind)."""

    def __init__(self, layout: KVLayout, dtype: torch.dtype, timeout_s: float):
        self.layout = layout
        self.dtype = dtype
        self.timeout_s = timeout_s
        self._context = zmq.Context()

    def pull(self, host: str, port: int, transfer_id: str, skip_blocks: int) -> PulledKV:
        """The lease's blocks past the first `skip_blocks`, and its first token; then ends the
        lease. Raises KVTransferError."""
        start = time.perf_counter()
        message = {
            "op": "pull",
            "transfer_id": transfer_id,
            "skip_blocks": skip_blocks,
            "layout": self.layout.as_dict(),
        }
        header, frames = self._request(host, port, message)
        layout = self.layout
        row = kv_format.row_width(layout.head_dim, self.dtype)
        shape = (2, header["num_blocks"], layout.block_size, layout.num_kv_heads, row)
        layers = [
            torch.frombuffer(f, dtype=torch.uint8).view(self.dtype).view(shape) for f in frames
        ]
        data = torch.stack(layers) if layers else torch.empty((0, *shape), dtype=self.dtype)
        self.done(host, port, transfer_id)
        return PulledKV(
            header["first_token_ids"],
            header["first_logprobs"],
            header["seed"],
            data,
            time.perf_counter() - start,
        )

    def done(self, host: str, port: int, transfer_id: str) -> None:
        """Ends a lease on the prefill instance (pulled, or no longer wanted)."""
        self._request(host, port, {"op": "done", "transfer_id": transfer_id})

    def _request(
        self, host: str, port: int, message: dict[str, Any]
    ) -> tuple[dict[str, Any], list[bytearray]]:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(f"tcp://{host}:{port}")
            socket.send(json.dumps(message).encode())
            if not socket.poll(int(self.timeout_s * 1000)):
                raise KVTransferError(
                    f"the prefill instance's KV endpoint {host}:{port} did not answer within "
                    f"{self.timeout_s:g} s (transfer {message['transfer_id']!r})"
                )
            first, *frames = socket.recv_multipart(copy=False)
        finally:
            socket.close()
        header = json.loads(first.bytes)
        if not header["ok"]:
            raise KVTransferError(header["error"])
        return header, [bytearray(f.buffer) for f in frames]

    def close(self) -> None:
        self._context.term()

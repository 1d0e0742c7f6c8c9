"""The worker side of the KV connector: reads and writes a request's blocks of the `KVCache`.

Each step the model runner hands it the step's `KVConnectorMetadata` before the forward
(`before_forward`) and the sampled tokens after it (`after_forward`):

- loads (decode instance): a pull per request runs on a thread of its own; a finished pull's
  blocks are written into the request's blocks at the start of a later step (never while a
  forward runs), and the request is reported in `KVConnectorOutput.loaded` with its first token.
  A load cancelled by the scheduler (the request was aborted, its blocks maybe reused) is
  dropped before anything is written.
- saves (prefill instance): once the step sampled the request's first token, its prompt blocks
  are leased to the KV server with that token; the server reports when a decode instance is
  done with them (`sent`), and a lease the scheduler gave up (`release`) stops being served.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xxhash

from quire.kernels import kv_format
from quire.kv_transfer.transport import KVClient, KVLayout, KVServer, Lease, PulledKV
from quire.messages import (
    ForkedRequestData,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLoaded,
    KVLoadSpec,
    TopLogprobs,
)
from quire.worker.kv_cache import KVBlocks, KVCache

logger = logging.getLogger(__name__)

_PULL_THREADS = 2


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the first parameter's first values: two instances exchanging KV must
    run the same weights, which shapes alone do not show."""
    first = next(model.parameters()).detach().reshape(-1)[:4096].float().cpu()
    return xxhash.xxh64(first.numpy().tobytes()).hexdigest()


class KVConnectorWorker:
    """Implements worker/protocols.py's KVConnector. Built by the executor with its endpoint;
    serves and pulls blocks once the worker registers its cache."""

    def __init__(self, host: str, port: int, tensor_parallel_size: int, transfer_timeout_s: float):
        self.host, self.port = host, port
        self.tensor_parallel_size = tensor_parallel_size
        self.transfer_timeout_s = transfer_timeout_s
        self._pool = ThreadPoolExecutor(_PULL_THREADS, thread_name_prefix="kv-pull")
        self._pulls: dict[str, tuple[KVLoadSpec, Future[PulledKV]]] = {}
        self.server: KVServer | None = None  # from register_kv_cache on
        self.client: KVClient | None = None

    def register_kv_cache(self, kv_cache: KVCache, model: torch.nn.Module) -> None:
        """Starts serving `kv_cache`'s blocks, and pulling into them, under the layout of this
        cache and `model`'s weights."""
        self.kv_cache = kv_cache
        layout = KVLayout(
            model=weights_fingerprint(model),
            num_layers=kv_cache.num_layers,
            block_size=kv_cache.block_size,
            num_kv_heads=kv_cache.num_kv_heads,
            head_dim=kv_cache.head_dim,
            dtype=kv_format.name(kv_cache.dtype),
            tensor_parallel_size=self.tensor_parallel_size,
        )
        self.server = KVServer(self.host, self.port, layout, self._read_blocks)
        self.client = KVClient(layout, kv_cache.dtype, self.transfer_timeout_s)

    def _read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.kv_cache.read_blocks(block_ids).data

    # ---- the step --------------------------------------------------------------------------
    def before_forward(self, metadata: KVConnectorMetadata | None) -> KVConnectorOutput:
        """Cancels, starts and finishes pulls and releases leases; returns what finished."""
        result = KVConnectorOutput()
        if metadata is not None:
            for req_id in metadata.cancel_loads:
                self._pulls.pop(req_id, None)  # a pull in flight ends its lease when it returns
            self.server.release(metadata.release)
            for req_id, spec in metadata.load.items():
                future = self._pool.submit(
                    self.client.pull, spec.host, spec.port, spec.transfer_id, spec.skip_blocks
                )
                self._pulls[req_id] = (spec, future)
        for req_id, (spec, future) in list(self._pulls.items()):
            if not future.done():
                continue
            del self._pulls[req_id]
            try:
                pulled = future.result()
                self._write(spec, pulled)
            except Exception as error:
                logger.warning("KV pull for request %s failed: %s", req_id, error)
                result.failed[req_id] = str(error)
                continue
            result.loaded[req_id] = KVLoaded(
                first_token_ids=pulled.first_token_ids,
                first_logprobs=[
                    None if t is None else TopLogprobs(**t) for t in pulled.first_logprobs
                ],
                num_blocks=len(spec.block_ids),
                num_bytes=pulled.data.nbytes,
                seconds=pulled.seconds,
            )
        result.sent = self.server.take_done()
        return result

    def _write(self, spec: KVLoadSpec, pulled: PulledKV) -> None:
        if pulled.data.shape[2] != len(spec.block_ids):
            raise ValueError(
                f"the prefill instance sent {pulled.data.shape[2]} blocks for "
                f"{len(spec.block_ids)} (transfer {spec.transfer_id!r}): the prompt differs"
            )
        if pulled.seed != spec.seed:
            raise ValueError(
                f"the prefill instance sampled with seed {pulled.seed}, this request has "
                f"seed {spec.seed} (transfer {spec.transfer_id!r})"
            )
        with torch.inference_mode():
            self.kv_cache.write_blocks(spec.block_ids, KVBlocks(pulled.data))

    def after_forward(
        self,
        metadata: KVConnectorMetadata | None,
        sampled: dict[str, list[int]],
        logprobs: dict[str, TopLogprobs],
        forks: list[ForkedRequestData],
    ) -> None:
        """Leases the blocks of each request saved this step, with the first token each of its
        sequences sampled (the request's own, then its forks' in index order) and their
        logprobs."""
        if metadata is None:
            return
        for req_id, spec in metadata.save.items():
            children = sorted(
                (f for f in forks if f.parent_req_id == req_id), key=lambda f: f.index
            )
            sequences = [req_id, *(f.req_id for f in children)]
            self.server.add(
                spec.transfer_id,
                Lease(
                    spec.block_ids,
                    [sampled[s][0] for s in sequences],
                    [_first_row(logprobs.get(s)) for s in sequences],
                    spec.num_prompt_tokens,
                    spec.seed,
                ),
            )

    @property
    def has_pending(self) -> bool:
        return bool(self._pulls)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
            self.client.close()


def _first_row(top: TopLogprobs | None) -> dict | None:
    """The first sampled position's logprobs as JSON-ready fields."""
    if top is None:
        return None
    return {"token_ids": top.token_ids[:1], "logprobs": top.logprobs[:1], "ranks": top.ranks[:1]}

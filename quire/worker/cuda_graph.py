"""CUDA graphs for decode-only batches: the model forward captured once per batch size, replayed.

A decode step runs the same kernels on the same shapes every step, and on a small model its time
goes mostly to launching them from Python. `CUDAGraphRunner` captures `model(input_ids, positions)`
(in a forward context of the step's metadata and the worker's KV cache) for a ladder of batch sizes (1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, 256), as
in vLLM), every graph reading the same static input buffers and writing one static output buffer,
all sharing one memory pool (captured largest first, so the smaller graphs fit in its blocks).

A decode batch of B requests is copied into the buffers and padded to the smallest captured size
that holds it. Padding rows read token 0 at position 0, have slot -1 (store_kv skips them), seq_len
0 (paged_decode writes zeros for them) and a block-table row of zeros. The metadata a graph is
captured with fixes every host-side value the Triton backend reads: num_decodes = num_decode_tokens
= num_seqs = the captured size, and max_seq_len = max_model_len, an upper bound on every seq_len
that keeps the decode grid the same whatever the batch's real lengths. The graphs run the fused
pointwise kernels (kernels/pointwise.py: add + RMSNorm, q/k norm + rotary, SiLU-and-mul), so a
step launches fewer kernels on the device; eager steps keep PyTorch's ops. Those round the
rotation and the gate step by step, so in bf16 a replayed step can sit an ulp from an eager one
(as cuBLAS's choice of kernel per batch size already makes a GPU step's bits depend on its
batch). A step that runs adapters runs eagerly: the graphs hold the base model's linears.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from quire.attention.backend import AttentionBackend, AttentionMetadata
from quire.attention.forward_context import forward_context
from quire.config import QuireConfig
from quire.kernels import fused_pointwise

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256  # larger decode batches are compute-heavy enough to run eagerly
NUM_WARMUP_RUNS = 2  # eager runs per size before its capture (Triton compiles, cuBLAS settles)


def use_cuda_graphs(config: QuireConfig) -> bool:
    """Decode batches replay CUDA graphs on CUDA with the Triton backend unless enforce_eager."""
    device = config.device
    return (
        device.device == "cuda"
        and device.attention_backend == "triton"
        and not device.enforce_eager
    )


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending: 1, 2, 4, then multiples of 8, up to and always
    including min(max_num_seqs, 256), so every decode batch up to that size has a graph (a replay
    after a preemption can make a larger one, which runs eagerly)."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8)) + [limit]


def padded_batch_size(sizes: list[int], batch_size: int) -> int | None:
    """The smallest of the ascending `sizes` that holds `batch_size` requests; None if none does."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """The graphs' static inputs, sized for the largest captured batch (one token per request)."""

    input_ids: torch.Tensor  # [max_batch_size] int64
    positions: torch.Tensor  # [max_batch_size] int64
    slot_mapping: torch.Tensor  # [max_batch_size] int64
    seq_lens: torch.Tensor  # [max_batch_size] int32
    block_tables: torch.Tensor  # [max_batch_size, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [max_batch_size + 1] int32: 0, 1, 2, ...

    @classmethod
    def allocate(
        cls, max_batch_size: int, max_blocks_per_seq: int, device: torch.device | str
    ) -> DecodeBuffers:
        """Buffers whose every row is padding."""
        return cls(
            input_ids=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            positions=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_batch_size,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.zeros(max_batch_size, dtype=torch.int32, device=device),
            block_tables=torch.zeros(
                max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device
            ),
            query_start_loc=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
        )

    @property
    def max_batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        """The metadata a graph of `batch_size` is captured with: views of the buffers, and host
        values that hold for any decode batch padded to that size. `seq_lens_cpu` holds the bound
        `max_seq_len` (the device `seq_lens` has the real lengths); the Triton backend reads only
        its length."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(batch_size + 1)),
            seq_lens_cpu=[max_seq_len] * batch_size,
            num_decodes=batch_size,
            num_decode_tokens=batch_size,
        )


def pad_decode_batch(
    buffers: DecodeBuffers,
    input_ids: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64
    metadata: AttentionMetadata,  # a decode-only batch of B requests
    padded_size: int,
) -> None:
    """Copies a decode batch into rows [0, B) of the buffers and makes rows [B, padded_size)
    padding. Block-table entries of rows [0, B) past the batch's width keep stale values: a request
    reads only its first cdiv(seq_len, block_size) entries, all inside that width."""
    batch_size = metadata.num_seqs
    width = metadata.block_tables.shape[1]
    assert metadata.num_decodes == batch_size <= padded_size <= buffers.max_batch_size
    assert width <= buffers.max_blocks_per_seq
    buffers.input_ids[:batch_size].copy_(input_ids)
    buffers.positions[:batch_size].copy_(positions)
    buffers.slot_mapping[:batch_size].copy_(metadata.slot_mapping)
    buffers.seq_lens[:batch_size].copy_(metadata.seq_lens)
    buffers.block_tables[:batch_size, :width].copy_(metadata.block_tables)
    buffers.input_ids[batch_size:padded_size].zero_()
    buffers.positions[batch_size:padded_size].zero_()
    buffers.slot_mapping[batch_size:padded_size].fill_(-1)
    buffers.seq_lens[batch_size:padded_size].zero_()
    buffers.block_tables[batch_size:padded_size].zero_()


class CUDAGraphRunner:
    """Captures the model's decode forward for each size of `capture_sizes(max_num_seqs)` and
    replays the smallest one that holds a decode batch. Build it after the KV cache is allocated:
    the graphs write into those cache tensors."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        config: QuireConfig,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.sizes = capture_sizes(config.scheduler.max_num_seqs)
        max_model_len = self.max_seq_len = config.model.max_model_len
        param = next(model.parameters())
        max_blocks_per_seq = -(-max_model_len // config.cache.block_size)
        with torch.inference_mode():
            self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks_per_seq, param.device)
            # [max_batch_size, hidden_size]: what the last replay computed
            self.output = torch.zeros(
                self.sizes[-1], model.config.hidden_size, dtype=param.dtype, device=param.device
            )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """Whether the batch is decode-only and fits a captured size and the buffers' bounds."""
        return (
            metadata.num_decodes == metadata.num_seqs <= self.sizes[-1]
            and metadata.max_seq_len <= self.max_seq_len
            and metadata.block_tables.shape[1] <= self.buffers.max_blocks_per_seq
        )

    def run(
        self,
        input_ids: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B] int64
        metadata: AttentionMetadata,  # decode-only, `can_run(metadata)`
    ) -> torch.Tensor:  # [B, hidden_size], a view of the static output (valid until next run)
        batch_size = metadata.num_seqs
        size = padded_batch_size(self.sizes, batch_size)
        pad_decode_batch(self.buffers, input_ids, positions, metadata, size)
        self._replay(size)
        return self.output[:batch_size]

    def _forward(self, size: int) -> None:
        """The work a graph of `size` captures: the model over the first `size` buffer rows."""
        metadata = self.buffers.metadata(size, self.max_seq_len)
        with forward_context(metadata, self.kv_caches, self.backend):
            hidden = self.model(self.buffers.input_ids[:size], self.buffers.positions[:size])
        self.output[:size] = hidden

    def _replay(self, size: int) -> None:
        self.graphs[size].replay()

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.perf_counter()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        with fused_pointwise():  # their launches' host cost is paid here, once
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                for _ in range(NUM_WARMUP_RUNS):
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(size)
                self.graphs[size] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (1..%d, max_seq_len %d) in %.1f s, "
            "%.0f MiB",
            len(self.sizes),
            self.sizes[-1],
            self.max_seq_len,
            time.perf_counter() - start,
            used / 2**20,
        )

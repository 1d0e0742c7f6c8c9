"""The physical KV cache: `KVCache` (per-layer K and V tensors, block copies, a request's blocks
read and written as data), how many blocks fit the memory budget, and the profiling step.

Layout, for every layer: K and V are each `[num_blocks, block_size, num_kv_heads, head_dim]`
tensors of the KV dtype (num_kv_heads is this rank's share under tensor parallelism); a quantized
cache's rows are `head_dim` codes and their scale (`head_dim + 4` elements, kernels/kv_format.py). Logical
position p of a request lives in block `block_table[p // block_size]` at offset
`p % block_size`; one slot index is `block * block_size + offset`. Block 0..num_blocks-1 are the
same ids the engine's KVCacheManager hands out.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from quire.attention.backend import AttentionBackend, AttentionMetadata
from quire.attention.forward_context import forward_context
from quire.config import QuireConfig
from quire.kernels import kv_format
from quire.layers.rotary import RotaryEmbedding
from quire.model.model_config import ModelConfig
from quire.sample.sampler import Sampler, SamplingBatch
from quire.sampling_params import SamplingParams
from quire.worker import host_memory

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 4 << 30  # capped at a quarter of physical memory
# Activation headroom per batched token when there is no model to profile.
_GPU_ACTIVATION_BYTES_PER_TOKEN = 64 << 10
# The costliest sampling a step can ask for: every filter and penalty, and this many logprobs.
_PROFILE_SAMPLING = SamplingParams(
    temperature=1.0,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
    logprobs=20,
)


def bytes_per_block(model_config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """One block of every layer in a cache of `kv_dtype` (a quantized one's scales included)."""
    per_token = kv_format.bytes_per_token(
        model_config.num_key_value_heads, model_config.head_dim, kv_dtype
    )
    return model_config.num_hidden_layers * block_size * per_token


def default_cpu_kv_bytes() -> int:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(_DEFAULT_CPU_KV_BYTES, physical // 4)


def gpu_kv_bytes(gpu_memory_utilization: float, activation_bytes: int, device: str) -> int:
    """What is left of `gpu_memory_utilization` of the card once what is already on it (weights,
    CUDA context and kernels, other processes) and the activations of the largest step are taken."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    budget = int(total * gpu_memory_utilization) - (total - free) - activation_bytes
    logger.info(
        "GPU memory: %.0f MiB total, %.0f MiB in use, %.0f MiB for activations; "
        "KV budget %.0f MiB at gpu_memory_utilization %.2f",
        total / 2**20,
        (total - free) / 2**20,
        activation_bytes / 2**20,
        budget / 2**20,
        gpu_memory_utilization,
    )
    return budget


def profile_activation_bytes(
    model: nn.Module,
    backend: AttentionBackend,
    block_size: int,
    dtype: torch.dtype,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> int:
    """Measures the peak CUDA memory the largest step allocates above what stays allocated (as
    vLLM does): `run_dummy_step` of max_num_batched_tokens tokens. Leaves the allocator's cache
    emptied, so what it compiled or kept (Triton kernels, cuBLAS workspaces) shows in free memory."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    run_dummy_step(model, backend, block_size, dtype, max_num_batched_tokens, max_num_seqs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def run_dummy_step(
    model: nn.Module,
    backend: AttentionBackend,
    block_size: int,
    dtype: torch.dtype,
    num_tokens: int,
    max_num_sampled: int,
) -> None:
    """The largest step's work on made-up input: a forward of `num_tokens` prompt tokens (requests
    of at most the model's max length), then logits and the costliest sampling for
    min(max_num_sampled, num_tokens) rows. Every token's K/V goes to a one-block cache per layer
    (block tables of zeros)."""
    layers = model.attention_layers
    device = next(model.parameters()).device
    max_len = next(m.max_position for m in model.modules() if isinstance(m, RotaryEmbedding))
    query_lens = [min(max_len, num_tokens - start) for start in range(0, num_tokens, max_len)]
    positions = torch.cat([torch.arange(n) for n in query_lens]).to(device)  # [num_tokens]
    query_start_loc = [0, *itertools.accumulate(query_lens)]
    max_blocks = -(-max(query_lens) // block_size)
    metadata = AttentionMetadata(
        slot_mapping=positions % block_size,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(query_lens), max_blocks, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=query_lens,
        num_decodes=0,
        num_decode_tokens=0,
    )
    caches = []
    for layer in layers:
        shape = (1, block_size, layer.num_kv_heads, layer.head_dim)
        caches.append(tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv"))
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    with forward_context(metadata, caches, backend):
        hidden = model(input_ids, positions)  # [num_tokens, hidden_size]
    num_sampled = min(max_num_sampled, num_tokens)
    logits = model.compute_logits(hidden[:num_sampled])  # [num_sampled, vocab_size]
    rows = [[0]] * num_sampled
    batch = SamplingBatch.from_params(
        [_PROFILE_SAMPLING] * num_sampled, rows, rows, [None] * num_sampled, rows, device
    )
    Sampler()(logits, batch)


def num_kv_blocks(
    config: QuireConfig,
    block_bytes: int,
    model: nn.Module | None = None,
    backend: AttentionBackend | None = None,
) -> int:
    """Blocks of `block_bytes` (one block of every cache the pool's block ids index: the target's
    and, with a draft model, the draft's) that fit the budget: `kv_cache_memory` if given; on
    CUDA, what `gpu_memory_utilization` leaves after the loaded `model` and the activations of
    its largest step, profiled (a heuristic per batched token when no model is given); on CPU, a
    fixed share of physical memory."""
    cache, scheduler, device = config.cache, config.scheduler, config.device.device
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif device == "cuda":
        if model is None:
            activations = scheduler.max_num_batched_tokens * _GPU_ACTIVATION_BYTES_PER_TOKEN
        else:
            activations = profile_activation_bytes(
                model,
                backend,
                cache.block_size,
                config.model.dtype,
                scheduler.max_num_batched_tokens,
                scheduler.max_num_seqs,
            )
        budget = gpu_kv_bytes(cache.gpu_memory_utilization, activations, device)
    else:
        budget = default_cpu_kv_bytes()
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"No room for the KV cache: the budget is {budget / 2**20:.0f} MiB. "
            "Raise kv_cache_memory / gpu_memory_utilization or use a smaller model or dtype."
        )
    return int(num_blocks)


@dataclass
class KVBlocks:
    """Some blocks of a KV cache as data, to move between instances or ranks.

    `data` is `[num_layers, 2, num_blocks, block_size, num_kv_heads, row]` (K then V) in the
    cache's dtype, which it carries: row is head_dim, or for a quantized cache head_dim codes
    and their scale (kv_format.py), so the scales travel inside the rows."""

    data: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class KVCache:
    """Per-layer K and V tensors in the layout of the module docstring, owned by the worker and
    handed to attention through the forward context (`layers`)."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.layers = layers  # per layer: (K, V)
        k = layers[0][0]
        self.num_blocks, self.block_size, self.num_kv_heads, _ = k.shape
        self.head_dim = kv_format.head_dim_of(k)
        self.dtype = k.dtype  # the cache's (kv_format.py): the model's, bf16, int8 or fp8
        self.device = k.device

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        huge_pages: bool = False,
    ) -> KVCache:
        """Zeroed tensors of `dtype` (kv_format.cache_dtype); on CPU all of them in one arena,
        on huge pages if `huge_pages` (host_memory.py), whose zero pages are faulted in as
        blocks are first written: allocating the pool costs no time, whatever its size."""
        shape = (num_blocks, block_size, num_kv_heads, kv_format.row_width(head_dim, dtype))
        specs = [(shape, dtype)] * (2 * num_layers)
        if torch.device(device).type == "cpu":
            tensors = host_memory.zeros(specs, huge_pages)
        else:
            tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
        cache = cls([(tensors[2 * i], tensors[2 * i + 1]) for i in range(num_layers)])
        logger.info(
            "KV cache: %d blocks of %d tokens, %.0f MiB",
            num_blocks,
            block_size,
            cache.nbytes / 2**20,
        )
        return cache

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicates block src into block dst in every layer."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]

    def read_blocks(self, block_ids: list[int], layers: range | None = None) -> KVBlocks:
        """A copy of these blocks of every layer (or of `layers` only, to move KV layer by
        layer)."""
        index = torch.tensor(block_ids, device=self.device)
        chosen = self.layers if layers is None else [self.layers[i] for i in layers]
        data = torch.stack([torch.stack([k[index], v[index]]) for k, v in chosen])
        return KVBlocks(data)

    def write_blocks(
        self, block_ids: list[int], blocks: KVBlocks, layers: range | None = None
    ) -> None:
        """Writes `blocks` (as `read_blocks` made them) into these block ids."""
        chosen = range(self.num_layers) if layers is None else layers
        row = kv_format.row_width(self.head_dim, self.dtype)
        expected = (len(chosen), 2, len(block_ids), self.block_size, self.num_kv_heads, row)
        if tuple(blocks.data.shape) != expected or blocks.dtype != self.dtype:
            raise ValueError(
                f"KV blocks of shape {tuple(blocks.data.shape)} and {blocks.data.dtype} do not "
                f"fit {len(block_ids)} blocks of this cache ({self.dtype}, "
                f"{self.num_kv_heads} KV heads x {self.head_dim}, block size {self.block_size})"
            )
        index = torch.tensor(block_ids, device=self.device)
        data = blocks.data.to(self.device)
        for i, layer in enumerate(chosen):
            k, v = self.layers[layer]
            k[index] = data[i, 0]
            v[index] = data[i, 1]

"""Sizes and allocates the physical KV cache and binds it to the model's attention layers."""

from __future__ import annotations

import itertools
import logging
import os

import torch
from torch import nn

from quire.attention.backend import AttentionMetadata
from quire.layers.attention import Attention
from quire.layers.rotary import RotaryEmbedding
from quire.layers.sampler import Sampler, SamplingBatch
from quire.model.model_config import ModelConfig
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


def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * model_config.num_key_value_heads * model_config.head_dim * dtype.itemsize
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
    run_dummy_step(model, block_size, dtype, max_num_batched_tokens, max_num_seqs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def run_dummy_step(
    model: nn.Module,
    block_size: int,
    dtype: torch.dtype,
    num_tokens: int,
    max_num_sampled: int,
) -> None:
    """The largest step's work on made-up input: a forward of `num_tokens` prompt tokens (requests
    of at most the model's max length), then logits and the costliest sampling for
    min(max_num_sampled, num_tokens) rows. Every token's K/V goes to a one-block cache bound to
    the layers for the call (block tables of zeros); their own caches are bound back after it."""
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
    caches = [(layer.k_cache, layer.v_cache) for layer in layers]
    for layer in layers:
        shape = (1, block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
    try:
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        hidden = model(input_ids, positions, metadata)  # [num_tokens, hidden_size]
        num_sampled = min(max_num_sampled, num_tokens)
        logits = model.compute_logits(hidden[:num_sampled])  # [num_sampled, vocab_size]
        rows = [[0]] * num_sampled
        batch = SamplingBatch.from_params(
            [_PROFILE_SAMPLING] * num_sampled, rows, rows, [None] * num_sampled, rows, device
        )
        Sampler()(logits, batch)
    finally:
        for layer, (k_cache, v_cache) in zip(layers, caches):
            layer.k_cache, layer.v_cache = k_cache, v_cache


def num_kv_blocks(
    model_config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    model: nn.Module | None = None,
    max_num_seqs: int = 256,
) -> int:
    """Blocks that fit the budget: `kv_cache_memory` if given; on CUDA, what
    `gpu_memory_utilization` leaves after the loaded `model` and the activations of its largest
    step, profiled (a heuristic per batched token when no model is given); on CPU, a fixed share
    of physical memory."""
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif device == "cuda":
        if model is None:
            activations = max_num_batched_tokens * _GPU_ACTIVATION_BYTES_PER_TOKEN
        else:
            activations = profile_activation_bytes(
                model, block_size, dtype, max_num_batched_tokens, max_num_seqs
            )
        budget = gpu_kv_bytes(gpu_memory_utilization, activations, device)
    else:
        budget = default_cpu_kv_bytes()
    num_blocks = budget // bytes_per_block(model_config, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"No room for the KV cache: the budget is {budget / 2**20:.0f} MiB. "
            "Raise kv_cache_memory / gpu_memory_utilization or use a smaller model or dtype."
        )
    return int(num_blocks)


def allocate_kv_cache(
    layers: list[Attention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    huge_pages: bool,
) -> None:
    """One K and one V tensor `[num_blocks, block_size, num_kv_heads, head_dim]` per layer; on
    CPU all of them in one arena, on huge pages if `huge_pages` (host_memory.py)."""
    specs = [
        ((num_blocks, block_size, layer.num_kv_heads, layer.head_dim), dtype)
        for layer in layers
        for _ in "kv"
    ]
    if torch.device(device).type == "cpu":
        caches = host_memory.zeros(specs, huge_pages)
    else:
        caches = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = caches[2 * i], caches[2 * i + 1]
    total = 2 * sum(layer.k_cache.nbytes for layer in layers)
    logger.info("KV cache: %d blocks of %d tokens, %.0f MiB", num_blocks, block_size, total / 2**20)


def copy_blocks(layers: list[Attention], copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: duplicates block src into block dst in every layer."""
    src = torch.tensor([s for s, _ in copies], device=layers[0].k_cache.device)
    dst = torch.tensor([d for _, d in copies], device=layers[0].k_cache.device)
    for layer in layers:
        layer.k_cache[dst] = layer.k_cache[src]
        layer.v_cache[dst] = layer.v_cache[src]

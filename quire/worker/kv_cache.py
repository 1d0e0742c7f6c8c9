"""Sizes and allocates the physical KV cache and binds it to the model's attention layers."""

from __future__ import annotations

import logging
import os

import torch

from quire.layers.attention import Attention
from quire.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 4 << 30  # capped at a quarter of physical memory
_GPU_ACTIVATION_BYTES_PER_TOKEN = 64 << 10  # headroom per batched token for activations


def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * model_config.num_key_value_heads * model_config.head_dim * dtype.itemsize
    return model_config.num_hidden_layers * block_size * per_token


def default_cpu_kv_bytes() -> int:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(_DEFAULT_CPU_KV_BYTES, physical // 4)


def gpu_kv_bytes(gpu_memory_utilization: float, max_num_batched_tokens: int, device: str) -> int:
    """What is left of `gpu_memory_utilization` of the card once the weights (already loaded) and
    room for the activations of the largest batch are taken."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    used = total - free
    activations = max_num_batched_tokens * _GPU_ACTIVATION_BYTES_PER_TOKEN
    return int(total * gpu_memory_utilization) - used - activations


def num_kv_blocks(
    model_config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
) -> int:
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif device == "cuda":
        budget = gpu_kv_bytes(gpu_memory_utilization, max_num_batched_tokens, device)
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
) -> None:
    """One K and one V tensor `[num_blocks, block_size, num_kv_heads, head_dim]` per layer."""
    for layer in layers:
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
    total = 2 * sum(layer.k_cache.nbytes for layer in layers)
    logger.info("KV cache: %d blocks of %d tokens, %.0f MiB", num_blocks, block_size, total / 2**20)


def copy_blocks(layers: list[Attention], copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: duplicates block src into block dst in every layer."""
    src = torch.tensor([s for s, _ in copies], device=layers[0].k_cache.device)
    dst = torch.tensor([d for _, d in copies], device=layers[0].k_cache.device)
    for layer in layers:
        layer.k_cache[dst] = layer.k_cache[src]
        layer.v_cache[dst] = layer.v_cache[src]

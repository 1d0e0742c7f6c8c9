"""The per-step forward context: what attention layers read during one forward pass.

The worker sets it around the model call; each `Attention` layer takes its KV cache tensors (by
its layer index), the step's metadata and the backend from it. Nothing of a step is stored on the
modules, so the same model serves any KV cache (a dummy one for profiling, another rank's shapes)
and the model's forward reads `forward(input_ids, positions)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from quire.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    # Per layer: (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(
    metadata: AttentionMetadata,
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    backend: AttentionBackend,
) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(metadata, kv_caches, backend)
    try:
        yield _current
    finally:
        _current = previous


def first_prompt_row(num_rows: int) -> int | None:
    """Where the step's prompt tokens start among its `num_rows` token rows, for an op that gives
    prompt rows numerics of their own (quantized_linear.py): the generated tokens' rows (decodes,
    replays after preemption, speculative tokens to verify) come first. None outside a forward,
    or for rows that are not the step's tokens (the LM head's, one a sequence)."""
    if _current is None or _current.metadata.slot_mapping.shape[0] != num_rows:
        return None
    return _current.metadata.num_decode_tokens


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("The model runs inside forward_context(...): it holds the KV cache.")
    return _current

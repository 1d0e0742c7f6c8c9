"""Rotary position embedding (the rotate-half form Hugging Face Llama/Qwen checkpoints use)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from quire.kernels import cpu as cpu_kernels


@dataclass
class RopeConfig:
    """A checkpoint's rope parameters (model_config.py reads them from config.json or GGUF)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def _inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:  # [head_dim // 2]
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope = rope
        self.register_buffer("cos_cache", torch.empty(max_position, head_dim), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_position, head_dim), persistent=False)
        if not self.cos_cache.is_meta:
            self.build_cache()

    def build_cache(self) -> None:
        """Fills the cos/sin tables (float32) on the buffers' device."""
        cpu_kernels.warm_up_torch_math()  # or a thread's part of the first cos may be off
        device = self.cos_cache.device
        inv_freq = _inv_freq(self.head_dim, self.rope).to(device)
        positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_position, head_dim]
        self.cos_cache = emb.cos()
        self.sin_cache = emb.sin()

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, 1, head_dim]
        """The step's cos/sin tables, looked up once and shared by every layer."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,
) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

"""Attention layer: projections, q/k norm, rotary, then the backend over the paged KV cache.

The cache, the step's metadata and the backend come from the forward context
(quire/attention/forward_context.py); the layer holds only its weights and its index."""

from __future__ import annotations

import torch
from torch import nn

from quire.attention.forward_context import get_forward_context
from quire.kernels import gpu_pointwise
from quire.kernels.cpu import pointwise
from quire.layers.norm import RMSNorm
from quire.layers.parallel_linear import QKVParallelLinear, RowParallelLinear
from quire.layers.rotary import apply_rotary


class Attention(nn.Module):
    """One rank's heads: `num_heads` and `num_kv_heads` are the model's, the layer holds its
    share (parallel_linear.QKVParallelLinear) and o_proj sums the ranks' outputs."""

    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx  # which (K, V) of the forward context's caches it uses
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [num_tokens, 1, head_dim]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)  # [T, Hq + 2 Hkv, D]
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        cos, sin = rotary
        triton = gpu_pointwise(qk)
        if triton is not None and triton.rotary_supported(qk):
            # q/k norm and rotary in one kernel, in place in the qkv buffer
            norms = ()
            if self.q_norm is not None:
                norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.k_norm.eps)
            triton.qk_norm_rotary_(qk, self.num_heads, cos, sin, *norms)
        else:
            if self.q_norm is not None:
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
                qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
            if pointwise.rotary_supported(qk):  # in place, in the qkv buffer
                pointwise.rotary_(qk, cos, sin)
            else:
                qk = apply_rotary(qk, cos, sin)  # queries and keys in one pass
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        context = get_forward_context()
        k_cache, v_cache = context.kv_caches[self.layer_idx]
        out = context.backend.forward(q, k, v, k_cache, v_cache, context.metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

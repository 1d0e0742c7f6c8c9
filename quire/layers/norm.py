"""RMSNorm, optionally fused with the residual add that precedes it (the residual stream is carried
beside the hidden states, as in vLLM, so each layer's add and norm are one pass).

bf16 on CPU runs the C kernel (quire/kernels/cpu/pointwise.c), a CUDA tensor inside CUDA graph
capture the Triton kernel (quire/kernels/pointwise.py), anything else torch's. All accumulate in
float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quire.kernels import gpu_pointwise
from quire.kernels.cpu import pointwise


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x) for x [..., hidden]; with a residual, (norm(x + residual), x + residual), the
        sum written into `residual` in place when the C kernel runs."""
        if pointwise.supported(x) and self.weight.dtype == x.dtype:
            if residual is None:  # any leading shape, e.g. Qwen3's per-head q/k norm [T, H, D]
                rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
                return pointwise.add_rms_norm(rows, None, self.weight, self.eps).view(x.shape)
            if x.dim() == 2 and residual.is_contiguous():
                return pointwise.add_rms_norm(x, residual, self.weight, self.eps), residual
        triton = gpu_pointwise(x)
        if triton is not None and triton.norm_supported(x) and self.weight.dtype == x.dtype:
            if residual is None:
                return triton.add_rms_norm(x, None, self.weight, self.eps)
            if residual.is_contiguous() and residual.dtype == x.dtype:
                return triton.add_rms_norm(x, residual, self.weight, self.eps), residual
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual

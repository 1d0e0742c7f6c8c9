"""SiLU-gated MLP activation. bf16 on CPU runs the C kernel (quire/kernels/cpu/pointwise.c),
torch's bits in one pass instead of three ops; inside CUDA graph capture the Triton kernel
(quire/kernels/pointwise.py); elsewhere torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quire.kernels import gpu_pointwise
from quire.kernels.cpu import pointwise


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
    if gate_up.dim() == 2 and gate_up.is_contiguous() and pointwise.supported(gate_up):
        return pointwise.silu_and_mul(gate_up)
    triton = gpu_pointwise(gate_up)
    if triton is not None and gate_up.dim() == 2:
        return triton.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

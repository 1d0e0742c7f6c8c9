"""Linear layers with weights pre-packed for oneDNN, for bfloat16 on CPU.

`nn.Linear` on CPU hands oneDNN a plain row-major weight on every call, and oneDNN reorders it
into its blocked layout each time: a decode step's GEMVs then read ~2x the weight bytes and reach
about half the memory bandwidth. Packing once at load time (what torch.compile's freezing pass
does) gives the same results bit for bit and 1.8-2x faster GEMVs, 1.1-1.3x faster small-batch
GEMMs. The packed tensor is opaque (layout `torch._mkldnn`), so packing happens after the
checkpoint is loaded and replaces the `nn.Linear` modules in place.
"""

from __future__ import annotations

import os

import torch
from torch import nn


def packed_linear_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where packing pays: bfloat16 on a CPU build of torch with oneDNN. QUIRE_PACK_WEIGHTS=0
    turns it off (to compare against plain `nn.Linear`)."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.bfloat16
        and os.environ.get("QUIRE_PACK_WEIGHTS", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        out = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, self.in_features), self.packed_weight, self.bias, "none", [], ""
        )
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linear_layers(module: nn.Module) -> int:
    """Replaces every `nn.Linear` under `module` with a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear.from_linear(child))
            count += 1
        else:
            count += pack_linear_layers(child)
    return count

"""Linear layers on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), kept in
their blocks.

The GGUF loader hands such a tensor over as a `QuantizedWeight` (its raw blocks, rows = output
features) instead of dequantizing it; `LlamaForCausalLM.load_weights` keeps it beside the
`nn.Linear` it belongs to (a fused q|k|v or gate|up linear collects one per shard), and
`quantize_linear_layers` then replaces each such linear with a `QuantizedLinear`: the blocks
repacked once for the int8 kernel (quire/kernels/cpu/qmatmul.c, qmatmul_k.c for the K-quants),
which quantizes each row of x to int8 in blocks of 32 and sums every row in one order whatever the number of rows, prompt and
generated tokens alike, so a request's bits do not depend on the batch. A decode step then
reads 4.5-8.5 bits a weight instead of bf16's 16. A fused linear whose shards come in different
types (Q4_K_M files give q and k in Q4_K, v in Q6_K) keeps each run of one type as a part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from quire.kernels.cpu import qmatmul
from quire.layers.parallel_linear import MergedColumnParallelLinear, QKVParallelLinear

logger = logging.getLogger(__name__)

# The GGUF types the kernel takes; others are dequantized at load (gguf_loader.py).
KERNEL_TYPES = frozenset(qmatmul.FORMATS)


@dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF tensor's blocks as stored: [out_features, bytes per row] uint8, `qtype` a
    GGMLQuantizationType name."""

    raw: np.ndarray
    qtype: str
    shape: tuple[int, int]  # (out_features, in_features)

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        values = dequantize(self.raw, GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row blocks of one type, one under the other (q | k | v, gate | up)."""
        (qtype,) = {p.qtype for p in parts}
        (in_features,) = {p.shape[1] for p in parts}
        raw = np.concatenate([p.raw for p in parts])
        return QuantizedWeight(raw, qtype, (raw.shape[0], in_features))


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W in GGUF blocks, packed for qmatmul.c; x bf16. W is given whole, or
    as row blocks in order (q, k, v): runs of one type are stacked, and blocks of several
    types become the parts of one packed weight (`qtype` their types joined by "+")."""

    def __init__(self, weight: QuantizedWeight | list[QuantizedWeight], bias: torch.Tensor | None):
        super().__init__()
        parts: list[QuantizedWeight] = []
        for part in weight if isinstance(weight, list) else [weight]:
            if parts and parts[-1].qtype == part.qtype:
                part = QuantizedWeight.stack([parts.pop(), part])
            parts.append(part)
        (self.in_features,) = {p.shape[1] for p in parts}
        self.out_features = sum(p.shape[0] for p in parts)
        self.qtype = "+".join(p.qtype for p in parts)
        self.format = qmatmul.format_of(self.qtype)
        if len(parts) == 1:
            self.packed = qmatmul.pack(parts[0].raw, self.qtype, self.in_features)
        else:
            self.packed = qmatmul.pack_parts([(p.raw, p.qtype) for p in parts], self.in_features)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    def forward(
        self, x: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:  # [..., in] -> [..., out], bf16 or `out_dtype` (float32: widened)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        out = qmatmul.qmatmul(
            rows, self.packed, self.qtype, self.bias, self.out_features, out_dtype or x.dtype
        )
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}"


def _shard_ids(linear: nn.Linear) -> list[str | int | None]:
    """The shards a linear's weight is loaded from, in its rows' order."""
    if isinstance(linear, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(linear, MergedColumnParallelLinear):
        return list(range(len(linear.output_sizes)))
    return [None]


def quantize_linear_layers(model: nn.Module) -> int:
    """Replaces every linear under `model` that load_weights gave quantized shards
    (`quantized_shards`: shard id -> QuantizedWeight) with a QuantizedLinear; returns how many.
    A linear whose shards are not all kept (a fused q|k|v with a float v) has its kept shards
    dequantized into its own weight instead."""
    count = 0
    for name, child in list(model.named_children()):
        shards = getattr(child, "quantized_shards", None)
        if isinstance(child, nn.Linear) and shards:
            ids = _shard_ids(child)
            if set(shards) == set(ids):
                setattr(model, name, QuantizedLinear([shards[i] for i in ids], child.bias))
                count += 1
                continue
            logger.warning(
                "%s has %s blocks for some shards only: dequantized to %s",
                name,
                "/".join(sorted({p.qtype for p in shards.values()})),
                child.weight.dtype,
            )
            with torch.no_grad():
                for shard_id, part in shards.items():
                    if shard_id is None:
                        child.weight.copy_(part.dequantize())
                    else:
                        child.weight_loader(child.weight, part.dequantize(), shard_id)
            del child.quantized_shards
        else:
            count += quantize_linear_layers(child)
    return count

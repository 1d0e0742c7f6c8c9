"""Linear layers on GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), kept as stored.

The GGUF loader hands such a tensor over as a `QuantizedWeight` (its raw blocks, rows = output
features) instead of dequantizing it; `LlamaForCausalLM.load_weights` keeps it beside the
`nn.Linear` it belongs to (a fused q|k|v or gate|up linear collects one per shard), and
`quantize_linear_layers` then replaces each such linear with a `QuantizedLinear`: the blocks
repacked once for the int8 kernel (quire/kernels/cpu/qmatmul.c, qmatmul_k.c for the K-quants),
which quantizes each row of x to int8 in blocks of 32 and sums every row in one order whatever
the number of rows, so a request's bits do not depend on the batch. A decode step then reads
4.5-8.5 bits a weight instead of bf16's 16. Where the bf16 matmul runs on AMX tiles, a step's
prompt rows (`first_prompt_row` of the forward context) take the kernel's bf16 loop instead
(`qmatmul.prompt_path`), as attention gives them a kernel of their own: a token's numerics follow
from whether it is a prompt or a generated token, never from the batch. A fused linear whose
shards come in different types (Q4_K_M files give q and k in Q4_K, v in Q6_K) keeps each run of
one type as a part.

Under tensor parallelism each rank keeps its shard's blocks, cut as the parallel layers cut a
float tensor (`Shard`): whole rows for column-parallel, q|k|v, gate|up and LM-head shards; whole
blocks of each row for a row-parallel shard (o_proj, down_proj), whose partial products are then
summed over the ranks. A row-parallel split that does not fall on a block boundary (input
features per rank not a multiple of the type's block, 32 or a K-quant's 256) dequantizes that
matrix, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from quire.attention.forward_context import first_prompt_row
from quire.distributed.parallel_state import all_reduce, tp_size
from quire.kernels.cpu import qmatmul
from quire.layers.activation import silu_and_mul
from quire.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    Shard,
)

logger = logging.getLogger(__name__)

_QUANTIZE_ROWS = 4096  # rows of a float weight quantized at a time (from_float)

# The GGUF types the kernel takes; others are dequantized at load (gguf_loader.py).
KERNEL_TYPES = frozenset(qmatmul.FORMATS)


def _dequantize_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """Q8_0 blocks [N, K / 32 * 34] (a float16 scale, then 32 int8 codes) -> [N, K] float32,
    each weight scale x code as gguf computes it."""
    blocks = torch.from_numpy(np.require(raw, np.uint8, ["C_CONTIGUOUS", "WRITEABLE"]))
    blocks = blocks.view(shape[0], -1, 34)
    scales = blocks[..., :2].contiguous().view(torch.float16).float()
    codes = blocks[..., 2:].contiguous().view(torch.int8)
    return (codes * scales).reshape(shape)


@dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF tensor's blocks as stored: [out_features, bytes per row] uint8, `qtype` a
    GGMLQuantizationType name."""

    raw: np.ndarray
    qtype: str
    shape: tuple[int, int]  # (out_features, in_features)

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        if self.qtype == "Q8_0":  # the common embedding type: torch's threads, not gguf's numpy
            return _dequantize_q8_0(self.raw, self.shape)
        values = dequantize(self.raw, GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))

    def shard(self, shard: Shard) -> QuantizedWeight | None:
        """This rank's part (`Shard`, as the parallel layers' loaders cut a float tensor): whole
        rows, or whole blocks of every row, with zero blocks (zero scales, adding nothing) where
        it runs past the end. None when a split of the input features does not fall on a block
        boundary."""
        if (shard.start, shard.size) == (0, self.shape[shard.dim]):
            return self
        if shard.dim == 0:
            rows = self.raw[shard.start : shard.start + shard.size]
            pad = np.zeros((shard.size - rows.shape[0], self.raw.shape[1]), np.uint8)
            raw = np.concatenate([rows, pad])
            return QuantizedWeight(raw, self.qtype, (shard.size, self.shape[1]))
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.qtype]]
        if shard.start % block or shard.size % block:
            return None
        first = shard.start // block * block_bytes
        width = shard.size // block * block_bytes
        cols = self.raw[:, first : first + width]
        pad = np.zeros((self.raw.shape[0], width - cols.shape[1]), np.uint8)
        raw = np.concatenate([cols, pad], axis=1)
        return QuantizedWeight(raw, self.qtype, (self.shape[0], shard.size))

    @staticmethod
    def from_float(weight: torch.Tensor) -> QuantizedWeight:
        """[out, in] (in a multiple of 32) -> symmetric int8 per output channel in blocks of 32
        along the input, as GGUF's Q8_0 (and the gguf package's quantizer, bit for bit): a block
        d = amax / 127 (float16), codes round(w / d) half away from zero. Done a slice of rows
        at a time, so a large LM head needs no float32 copy of itself."""
        rows, cols = weight.shape
        raw = torch.empty(rows, cols // qmatmul.QBLOCK, 2 + qmatmul.QBLOCK, dtype=torch.uint8)
        for start in range(0, rows, _QUANTIZE_ROWS):
            part = weight[start : start + _QUANTIZE_ROWS].detach().float()
            blocks = part.reshape(part.shape[0], -1, qmatmul.QBLOCK)
            d = blocks.abs().amax(dim=-1, keepdim=True) / 127
            scaled = blocks * torch.where(d == 0, 0.0, 1 / d)
            magnitude = scaled.abs()
            whole = magnitude.floor()
            codes = scaled.sign() * (whole + (2 * (magnitude - whole)).floor())
            out = raw[start : start + _QUANTIZE_ROWS]
            out[..., :2] = d.half().view(torch.uint8)
            out[..., 2:] = codes.to(torch.int8).view(torch.uint8)
        return QuantizedWeight(raw.reshape(rows, -1).numpy(), "Q8_0", (rows, cols))

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
            rows,
            self.packed,
            self.qtype,
            self.bias,
            self.out_features,
            out_dtype or x.dtype,
            first_prompt_row(rows.shape[0]),
        )
        return out.view(*lead, self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out / 2]
        """silu(gate) * up of this gate|up projection's output (gate rows first), as
        `activation.silu_and_mul(self(x))` gives it bit for bit. A step's prompt rows on AMX
        tiles (`qmatmul.prompt_path`) take one pass that never writes the [rows, out] products."""
        rows = x.reshape(-1, self.in_features)
        first = first_prompt_row(rows.shape[0])
        d = self.out_features // 2
        if (
            first is None
            or first == rows.shape[0]
            or self.bias is not None
            or d % qmatmul.QPANEL
            or self.format == qmatmul.PARTS
            or qmatmul.prompt_path() != "amx-bf16"
        ):
            return silu_and_mul(self(x))
        prompt = qmatmul.amx_silu_and_mul(rows[first:], self.packed, self.qtype, d)
        if first == 0:
            return prompt
        generated = qmatmul.qmatmul(rows[:first], self.packed, self.qtype, None, 2 * d)
        return torch.cat([silu_and_mul(generated), prompt])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}"

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, weight: QuantizedWeight | list[QuantizedWeight]
    ) -> QuantizedLinear:
        """`linear`'s replacement holding `weight` (its shard's blocks, whole or by shard) and
        its bias."""
        if isinstance(linear, RowParallelLinear) and tp_size() > 1:
            return QuantizedRowParallelLinear(weight, linear.bias)
        return cls(weight, linear.bias)


class QuantizedRowParallelLinear(QuantizedLinear):
    """A RowParallelLinear's shard in blocks: the partial product summed over the ranks, then
    the bias added once (as PackedRowParallelLinear)."""

    def __init__(self, weight: QuantizedWeight | list[QuantizedWeight], bias: torch.Tensor | None):
        super().__init__(weight, None)
        self.row_bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    def partial(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's product, before the sum over the ranks and the bias."""
        return super().forward(x, out_dtype)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        out = all_reduce(partial)
        return out if self.row_bias is None else out + self.row_bias

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.reduce(self.partial(x, out_dtype))


def shard_of(
    module: nn.Module, weight: QuantizedWeight, shard_id: str | int | None
) -> QuantizedWeight | None:
    """This rank's blocks of `weight` for `module` (a parallel linear or embedding: its `shard`;
    any other module takes it whole), or None where they are not whole blocks."""
    cut = getattr(module, "shard", None)
    if cut is None:
        return weight
    return weight.shard(cut() if shard_id is None else cut(shard_id))


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
            types = {p.qtype for p in shards.values()}
            if set(shards) == set(ids):
                setattr(model, name, QuantizedLinear.from_linear(child, [shards[i] for i in ids]))
                count += 1
                continue
            logger.warning(
                "%s has %s blocks for some shards only: dequantized to %s",
                name,
                "/".join(sorted(types)),
                child.weight.dtype,
            )
            with torch.no_grad():
                for shard_id, part in shards.items():  # this rank's blocks, into their rows
                    if shard_id is None:
                        child.weight.copy_(part.dequantize())
                    else:
                        rows = child.shard(shard_id)
                        child.weight.narrow(0, rows.offset, rows.size).copy_(part.dequantize())
            del child.quantized_shards
        else:
            count += quantize_linear_layers(child)
    return count


def int8_linear_layers(model: nn.Module) -> int:
    """`--quantization int8`: every linear under `model` (this rank's shard) whose input features
    are whole blocks of 32 becomes a QuantizedLinear on its weight quantized to Q8_0's blocks
    (`QuantizedWeight.from_float`); returns how many. Others stay in their dtype."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if child.in_features % qmatmul.QBLOCK == 0:
                weight = QuantizedWeight.from_float(child.weight)
                setattr(model, name, QuantizedLinear.from_linear(child, weight))
                count += 1
            else:
                logger.warning(
                    "%s stays %s: %d input features are not whole int8 blocks of %d",
                    name,
                    child.weight.dtype,
                    child.in_features,
                    qmatmul.QBLOCK,
                )
        else:
            count += int8_linear_layers(child)
    return count

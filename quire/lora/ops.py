"""The LoRA ops on CPU: each token row's `B (A x)` (A carries the scale) added to a linear's
output, summed in float32 over stacks in the model's dtype (bf16 or float32).

`CpuLoRAOps` runs quire's C kernel (kernels/cpu/lora.c): one call for all the step's rows, each
row alone in a fixed order. `TorchLoRAOps`, the reference and the fallback (no C compiler, other
devices), groups rows by adapter slot:

- SGMV: a prompt chunk's rows are contiguous and share a slot: sliced, no gather.
- BGMV: decode rows of one slot are gathered by index, computed, and scattered back.

Batch invariance: a row's bits must not depend on the other rows beside it (bf16, every CPU).
A float32 matmul's summation order depends on its row count (a lone row takes a GEMV path),
so every matmul here has one shape: rows in blocks of `ROWS`, zero-padded, one `torch.mm` per
block, whichever path and however many rows; a row's place in its block does not change its
sums. Shrink (x A^T over the fused modules' ranks at once), then expand (u B^T per module into
its columns), then `out = (out + delta)` in float32, rounded once to out's dtype; bf16 stacks
are widened to float32 (exactly) first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quire.kernels.cpu import lora as lora_kernel
from quire.layers.lora_linear import LoRAMapping, LoRAOps

ROWS = 16  # rows per matmul block: every block has this shape


def block_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W, [n, k] x [k, m] -> [n, m] float32, in blocks of ROWS rows: row i's bits depend on
    x[i] and W only."""
    n, k = x.shape
    padded = torch.zeros(-(-n // ROWS) * ROWS, k, dtype=torch.float32, device=x.device)
    padded[:n] = x
    out = torch.empty(padded.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    for start in range(0, padded.shape[0], ROWS):
        torch.mm(padded[start : start + ROWS], weight, out=out[start : start + ROWS])
    return out[:n]


def lora_delta(
    x: torch.Tensor,  # [n, in]
    lora_a: torch.Tensor,  # [modules * max_rank, in] one slot's
    lora_b: torch.Tensor,  # [max_rank, out] (B transposed)
    out_slices: Sequence[tuple[int, int]],
) -> torch.Tensor:  # [n, out] float32
    max_rank = lora_b.shape[0]
    lora_b = lora_b.float()
    shrunk = block_matmul(x, lora_a.float().t())  # [n, modules * max_rank]
    delta = torch.zeros(x.shape[0], lora_b.shape[1], dtype=torch.float32, device=x.device)
    for i, (first, size) in enumerate(out_slices):
        u = shrunk[:, i * max_rank : (i + 1) * max_rank]
        delta[:, first : first + size] = block_matmul(u, lora_b[:, first : first + size])
    return delta


class TorchLoRAOps:
    """quire/layers/lora_linear.LoRAOps with torch matmuls: any device, bits batch-invariant."""

    def add_lora(
        self,
        out: torch.Tensor,  # [num_tokens, out]
        x: torch.Tensor,  # [num_tokens, in]
        lora_a: torch.Tensor,  # [max_loras, modules * max_rank, in]
        lora_b: torch.Tensor,  # [max_loras, max_rank, out]
        out_slices: Sequence[tuple[int, int]],
        mapping: LoRAMapping,
    ) -> None:
        for start, end, slot in mapping.segments:
            rows = out[start:end]
            delta = lora_delta(x[start:end], lora_a[slot], lora_b[slot], out_slices)
            rows.copy_(rows.float() + delta)
        for slot, index in mapping.gathered:
            delta = lora_delta(x.index_select(0, index), lora_a[slot], lora_b[slot], out_slices)
            out.index_copy_(0, index, (out.index_select(0, index).float() + delta).to(out.dtype))


class CpuLoRAOps:
    """quire/layers/lora_linear.LoRAOps on quire's C kernel (bf16 or float32 on CPU)."""

    def __init__(self) -> None:
        self._slices: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}  # by layer shape

    def add_lora(
        self,
        out: torch.Tensor,  # [num_tokens, out]
        x: torch.Tensor,  # [num_tokens, in]
        lora_a: torch.Tensor,  # [max_loras, modules * max_rank, in]
        lora_b: torch.Tensor,  # [max_loras, max_rank, out]
        out_slices: Sequence[tuple[int, int]],
        mapping: LoRAMapping,
    ) -> None:
        key = tuple(out_slices)
        slices = self._slices.get(key)
        if slices is None:
            slices = self._slices[key] = torch.tensor(key, dtype=torch.int32)
        lora_kernel.lora_add(out, x.contiguous(), lora_a, lora_b, mapping.token_slots, slices)


def lora_ops(device: torch.device | str, dtype: torch.dtype) -> LoRAOps:
    """The ops a worker on `device` sets in its LoRAContext: Triton on a GPU, the C kernel on
    CPU where it builds, else torch."""
    if torch.device(device).type == "cuda":
        from quire.lora.triton_ops import TritonLoRAOps  # Triton is imported only on a GPU

        return TritonLoRAOps()
    if lora_kernel.supported(torch.empty(0, dtype=dtype)):
        return CpuLoRAOps()
    return TorchLoRAOps()

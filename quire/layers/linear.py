"""Linear layers with weights pre-packed once at load time, for bfloat16 on CPU.

Where the GEMV kernel runs (quire/kernels/cpu/gemv.c: AVX-512 BF16 or AVX2, EngineConfig.gemv on),
the weight is packed for it and every matmul runs there, whatever the number of rows: it streams a
decode step's weights faster than oneDNN, keeps up with it on prompt chunks, and sums every row in
one order, so a request's bits do not depend on the batch or on how its prompt was chunked (oneDNN
sums a lone row of K > 1,024 in another order than two rows or more, and on AMX tiles blocks K by
the row count). On a CPU with AMX the kernel runs on the tiles itself (kernels/cpu/matmul_amx.c).

Otherwise the weight is held in oneDNN's blocked layout: `nn.Linear` on CPU hands oneDNN a plain
row-major weight on every call, and oneDNN reorders it each time, so a decode step's GEMVs read
~2x the bytes. Packing once (what torch.compile's freezing pass does) gives the same results bit
for bit, 1.8-2x faster GEMVs and 1.1-1.3x faster small-batch GEMMs. The packed tensor is opaque
(layout `torch._mkldnn`), so packing happens after the checkpoint is loaded and replaces the
`nn.Linear` modules in place. On a CPU where oneDNN has no bf16 (AVX2 only) the weights the
GEMV kernel does not take stay `nn.Linear`s (torch's own bf16 matmul).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from quire.distributed.parallel_state import all_reduce, tp_size
from quire.kernels.cpu import gemv
from quire.layers.parallel_linear import RowParallelLinear


@functools.cache
def onednn_runs_bf16() -> bool:
    """Whether oneDNN's bf16 linear runs on this CPU. It needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT; on an AVX2-only CPU torch raises at the first reorder, and a bf16 `nn.Linear`
    runs in torch's fallback GEMM there, about half as fast as float32 (docs/ARCHITECTURE.md)."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def packed_linear_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where packing pays: bfloat16 on CPU, where torch's oneDNN runs bf16 on this CPU or
    the GEMV kernel runs (its AVX2 loop; the loader packs there unless EngineConfig.pack_weights
    is off)."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.bfloat16
        and (onednn_runs_bf16() or gemv.available())
    )


def gemv_k_block(weight: torch.Tensor, has_bias: bool) -> int | None:
    """The GEMV kernel's block size for `weight` (see gemv.py's `k_block_for`), or None where
    PackedLinear keeps no GEMV copy: no kernel for this weight here."""
    if not gemv.supported(weight):
        return None
    return gemv.k_block_for(weight.shape[0], weight.shape[1], has_bias)


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed for the GEMV kernel (`gemv_weight`) where it runs, else for
    oneDNN (`packed_weight`). `use_gemv` False (EngineConfig.gemv off) keeps oneDNN's copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, use_gemv: bool):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        weight = weight.detach()
        self.gemv_k_block = gemv_k_block(weight, bias is not None) if use_gemv else None
        self.gemv_weight = None if self.gemv_k_block is None else gemv.pack(weight)
        self.packed_weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight, None)
            if self.gemv_weight is None
            else None
        )
        self.bias = None if bias is None else bias.detach()

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, use_gemv: bool) -> PackedLinear:
        if isinstance(linear, RowParallelLinear) and tp_size() > 1:
            return PackedRowParallelLinear(linear.weight, linear.bias, use_gemv=use_gemv)
        return cls(linear.weight, linear.bias, use_gemv=use_gemv)

    def forward(
        self, x: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:  # [..., in] -> [..., out], in x's dtype or `out_dtype` (float32: widened)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if self.gemv_weight is not None:
            out = gemv.gemv(
                rows,
                self.gemv_weight,
                self.bias,
                self.out_features,
                self.gemv_k_block,
                out_dtype or x.dtype,
            )
            return out.view(*lead, self.out_features)
        out = torch.ops.mkldnn._linear_pointwise(
            rows, self.packed_weight, self.bias, "none", [], ""
        )
        if out_dtype is not None:
            out = out.to(out_dtype)
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PackedRowParallelLinear(PackedLinear):
    """A RowParallelLinear's shard, packed: the partial product summed over the ranks, then the
    bias added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, use_gemv: bool):
        super().__init__(weight, None, use_gemv=use_gemv)
        self.row_bias = None if bias is None else bias.detach()

    def partial(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's product, before the sum over the ranks and the bias."""
        return super().forward(x, out_dtype)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        out = all_reduce(partial)
        return out if self.row_bias is None else out + self.row_bias

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.reduce(self.partial(x, out_dtype))


def pack_linear_layers(module: nn.Module, *, use_gemv: bool) -> int:
    """Replaces every `nn.Linear` under `module` with a PackedLinear; returns how many. Where
    oneDNN cannot run bf16 (AVX2), only the weights the GEMV kernel takes are packed."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            if not onednn_runs_bf16() and not (
                use_gemv and gemv_k_block(child.weight, child.bias is not None)
            ):
                continue
            setattr(module, name, PackedLinear.from_linear(child, use_gemv=use_gemv))
            count += 1
        else:
            count += pack_linear_layers(child, use_gemv=use_gemv)
    return count

"""ctypes wrapper of gemv.c: bf16 matmul y = x W^T (+ b) for any number of rows of x, reading a
weight packed once by `pack` at load time, every row summed in one order whatever the number of
rows (the kernel is named for a decode step's GEMVs, which it was written for), with AVX-512 BF16
or AVX2. Without AMX the order is oneDNN's where a block size reproduces it (AVX2: the same order
as AVX-512, no oneDNN bf16 to match); with AMX (EngineConfig.cpu_amx) every call
runs on AMX tiles in matmul_amx.c's order. Callers check `supported` and `k_block_for` and keep
oneDNN otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from quire.kernels.cpu import load_library

logger = logging.getLogger(__name__)

GEMV_PANEL = 32  # output columns per packed panel (GEMV_PANEL in gemv.c)


_PROBE_ROWS = 16  # two passes of gemv.c's 8-row groups
_AVX2 = 2  # gemv_bf16_available()'s answer for the AVX2 kernel


def available() -> bool:
    """Whether the kernel runs here: the C kernels are on and build, on a CPU with AVX-512 BF16
    where torch has oneDNN's packed linear to match, or with AVX2 and FMA (no oneDNN bf16 there
    to match: the AVX-512 FMA loop's order, the same bits)."""
    lib = load_library()
    return lib is not None and _runs_with(lib)


@functools.cache
def _runs_with(lib: ctypes.CDLL) -> bool:
    if lib.gemv_bf16_available() == _AVX2:
        return True
    return (
        lib.gemv_bf16_available() == 1
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _avx2() -> bool:
    return load_library().gemv_bf16_available() == _AVX2


def amx_available() -> bool:
    """Whether the AMX kernel (matmul_amx.c) can run here, whatever EngineConfig.cpu_amx says."""
    return available() and load_library().matmul_amx_available() == 1


def uses_amx() -> bool:
    """Whether the kernel runs on AMX tiles (matmul_amx.c): a CPU with AMX-BF16, a Linux that
    grants the tile state, and EngineConfig.cpu_amx on."""
    return available() and load_library().gemv_bf16_uses_amx() == 1


def path() -> str:
    """Which loop the kernel runs here, for logs and tests: "amx", "avx512-fma", "avx512-bf16",
    "avx2-fma", or "off" where it does not run."""
    if not available():
        return "off"
    if uses_amx():
        return "amx"
    if _avx2():
        return "avx2-fma"
    return "avx512-fma" if load_library().gemv_bf16_uses_fma() == 1 else "avx512-bf16"


def supported(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] can be packed for the kernel: bf16 on CPU, `in` even."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and available()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 32), K / 2, 32, 2]: panels of 32 output columns, each holding, for
    every pair of input columns, the 32 outputs' two weights (zero rows pad N)."""
    n, k = weight.shape
    padded = -(-n // GEMV_PANEL) * GEMV_PANEL
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    return weight.view(padded // GEMV_PANEL, GEMV_PANEL, k // 2, 2).transpose(1, 2).contiguous()


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _probe(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and _PROBE_ROWS rows of x whose products sum to results that depend on the
    order of summation in almost every output: each row of W starts with a large weight that its
    last column cancels, so every float32 partial sum carries it and rounds at its scale."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.rand(_PROBE_ROWS, in_features, generator=gen) + 0.5
    big = 2.0 ** (12 + torch.arange(out_features) % 5)
    weight[:, 0], weight[:, -1] = big, -big
    x[:, 0] = x[:, -1] = 1.0
    return weight.to(torch.bfloat16), x.to(torch.bfloat16)


def _usual_k_block(in_features: int) -> int:
    """oneDNN 3's blocks on AVX-512 BF16 at two rows or more: the whole K up to 512, then 512,
    then 1024."""
    return in_features if in_features <= 512 else 512 if in_features <= 1024 else 1024


def k_block_for(out_features: int, in_features: int, has_bias: bool) -> int | None:
    """The kernel's column block for this weight shape (None where the kernel does not run).
    On AMX tiles, the whole K: one chain of tile products. Otherwise the block at which oneDNN
    restarts its float32 sums, found by matching oneDNN's bits on a probe of several rows (a lone
    row of K > 1,024 oneDNN sums in blocks of 512), so that the kernel's bits are oneDNN's; where
    no block reproduces them (oneDNN on AMX tiles while the kernel keeps to AVX-512), oneDNN's
    usual block all the same: the kernel's own order for every row count. On AVX2 (no oneDNN
    bf16) the usual block: an AVX-512 host's bits where oneDNN's order is matched there."""
    if not available():
        return None
    if uses_amx():
        return in_features
    if _avx2():
        return _usual_k_block(in_features)
    return _matching_k_block(out_features, in_features, has_bias) or _usual_k_block(in_features)


@functools.cache
def _matching_k_block(out_features: int, in_features: int, has_bias: bool) -> int | None:
    weight, x = _probe(out_features, in_features)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if has_bias else None
    expected = _onednn_linear(x, weight, bias)
    usual = _usual_k_block(in_features)
    packed = pack(weight)
    for k_block in dict.fromkeys([usual, in_features, 512, 1024, 256, 2048, 128, 64]):
        if k_block > in_features and k_block != usual:
            continue
        if torch.equal(gemv(x, packed, bias, out_features, k_block), expected):
            return k_block
    logger.info(
        "GEMV kernel in its own order for %dx%d weights: no block size reproduces oneDNN's sums",
        out_features,
        in_features,
    )
    return None


def gemv(
    x: torch.Tensor,  # [M, K] bf16, M >= 1; rows may be strided, each contiguous
    packed: torch.Tensor,  # from `pack`
    bias: torch.Tensor | None,  # [N] bf16
    out_features: int,
    k_block: int,  # from `k_block_for`
    out_dtype: torch.dtype = torch.bfloat16,  # float32: the bf16-rounded result, widened
) -> torch.Tensor:  # [M, N]
    rows, in_features = x.shape
    if x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16:
        raise ValueError(f"gemv: bf16 only, got x {x.dtype} and weight {packed.dtype}")
    if packed.dim() != 4 or packed.shape[1] * 2 != in_features:
        raise ValueError(
            f"gemv: x has {in_features} columns, the packed weight {tuple(packed.shape)} "
            f"was packed for {packed.shape[1] * 2 if packed.dim() == 4 else '?'}"
        )
    if packed.shape[0] * GEMV_PANEL < out_features:
        raise ValueError(f"gemv: the packed weight has fewer than {out_features} rows")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, out_features, dtype=out_dtype)
    bf16_out = out_dtype == torch.bfloat16
    status = load_library().gemv_bf16(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr() if bf16_out else None,
        None if bf16_out else out.data_ptr(),
        out_features,
        rows,
        out_features,
        in_features,
        k_block,
        torch.get_num_threads(),
    )
    if status == -3:
        raise MemoryError(f"gemv: out of memory widening {rows} rows of x to float32")
    if status != 0:
        raise ValueError(
            f"gemv: {rows} rows x {in_features} columns (block {k_block}) is not supported "
            "(at least 1 row, an even number of columns, AVX-512 BF16; on AMX tiles the block "
            "is the whole K)"
        )
    return out

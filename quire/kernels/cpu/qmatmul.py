"""ctypes wrapper of qmatmul.c: y = x W^T (+ b) with W in GGUF's Q8_0, Q4_0 or Q4_1 blocks or its
Q4_K, Q5_K or Q6_K super-blocks (qmatmul_k.c), x bf16 quantized per row to int8 blocks of 32
inside the call, for any number of rows (every row summed
in one order, so a row's bits do not depend on the batch). `pack` repacks a GGUF tensor's blocks
once at load time into the kernel's panels (layout: the top of qmatmul.c).

Where the bf16 matmul runs on AMX tiles (`prompt_path`), a step's prompt rows
(`first_prompt_row` on) take bf16 numerics instead, in every format (K-quants and weights in
parts included): the weight dequantized to bf16 a chunk of panels at a time and multiplied on the
tiles with the rows as they are (qmatmul_amx_bf16 in matmul_amx.c). Prefill is compute-bound,
and AMX's bf16 rate is far above VNNI's int8; decode rows stay int8, reading 4.5-8.5 bits a
weight.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from quire.kernels.cpu import load_library, pointwise, qmatmul_k

QPANEL = 32  # output columns per packed panel (QPANEL in qmatmul.c)
QBLOCK = 32  # weights per block along K in Q8_0 / Q4_x; the K-quants' super-blocks hold 256

# GGUF type name -> the kernel's format id (the enums in qmatmul.c and qmatmul_k.c)
FORMATS = {"Q8_0": 1, "Q4_0": 2, "Q4_1": 3, **qmatmul_k.FORMATS}
PARTS = 7  # a weight in row blocks of several formats (`pack_parts`; its qtype "Q4_K+Q6_K+...")
# bytes of one GGUF block: float16 d (and float16 m for Q4_1), then the codes
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def available() -> bool:
    """Whether the kernel runs here: the C kernels are on and build (AVX-512 VNNI, or the
    portable C loop without it)."""
    return load_library() is not None


def path() -> str:
    """Which loop the kernel runs here, for logs and tests: "avx512-vnni", "avx2", "c", or "off"
    where the C kernels do not run."""
    lib = load_library()
    return "off" if lib is None else ("c", "avx2", "avx512-vnni")[lib.qmatmul_path()]


@functools.cache
def uses_vnni() -> bool:
    lib = load_library()
    return lib is not None and lib.qmatmul_vnni() == 1


@functools.cache
def simd_types() -> frozenset[str]:
    """The block types a SIMD loop runs here (AVX-512 VNNI or AVX2): all of FORMATS, or none in
    a plain C build."""
    lib = load_library()
    return frozenset(FORMATS) if lib is not None and lib.qmatmul_path() >= 1 else frozenset()


def prompt_path() -> str:
    """The loop a step's prompt rows of a GGUF weight (any of FORMATS, or parts) take here:
    "amx-bf16" (dequantized to bf16, on AMX tiles: where the bf16 matmul runs on them,
    EngineConfig.cpu_amx), else `path()` (the int8 sums of every row)."""
    lib = load_library()
    if lib is not None and lib.gemv_bf16_uses_amx() == 1:
        return "amx-bf16"
    return path()


def dequantize_bf16(packed: torch.Tensor, qtype: str, out_features: int, in_features: int):
    """`packed`'s weight as the AMX prompt loop multiplies it: [out_features, in_features] bf16,
    each weight gguf's float32 value rounded once (d q + m, d (q - 8), d q; the K-quants'
    (d sc) q - (dmin m) and (d sc) (q - 32)). For tests."""
    if qtype not in FORMATS:
        raise ValueError(f"dequantize_bf16: {qtype} is not one of {', '.join(FORMATS)}")
    _check_packed(packed, qtype, in_features, out_features)
    panels = packed.shape[0]
    out = torch.empty(panels, in_features // 2, QPANEL, 2, dtype=torch.bfloat16)
    status = load_library().qmatmul_dequantize_bf16(
        format_of(qtype), packed.data_ptr(), 0, panels * in_features // QBLOCK, out.data_ptr()
    )
    if status != 0:
        raise ValueError(f"dequantize_bf16: status {status}")
    # [panel][k pair][column][2] -> [panel * 32 + column][k]
    return out.permute(0, 2, 1, 3).reshape(panels * QPANEL, in_features)[:out_features]


def amx_silu_and_mul(
    x: torch.Tensor,  # [M, K] bf16 prompt rows; rows may be strided, each contiguous
    packed: torch.Tensor,  # a gate|up weight of 2 d rows, gate first (`pack`)
    qtype: str,  # a FORMATS name (not parts), where prompt_path() is "amx-bf16"
    d: int,  # a multiple of QPANEL
) -> torch.Tensor:  # [M, d] bf16
    """silu(x Wg^T) * (x Wu^T) on AMX tiles, as `qmatmul(..., first_prompt_row=0)` and then
    pointwise.silu_and_mul give it bit for bit, without writing the [M, 2 d] products."""
    rows, in_features = x.shape
    _check_packed(packed, qtype, in_features, 2 * d)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, d, dtype=torch.bfloat16)
    status = load_library().qmatmul_amx_silu_bf16(
        format_of(qtype),
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        pointwise.silu_table().data_ptr(),
        out.data_ptr(),
        d,
        rows,
        d,
        in_features,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"amx_silu_and_mul: status {status} for {rows} x {in_features}, d {d}")
    return out


def packed_bytes(qtype: str, out_features: int, in_features: int) -> int:
    panels = -(-out_features // QPANEL)
    return panels * (in_features // block_size(qtype)) * _record_bytes(qtype)


def block_size(qtype: str) -> int:
    """Weights along K per packed record: a block, or a K-quant's super-block."""
    return qmatmul_k.SUPER_BLOCK if qtype in qmatmul_k.FORMATS else QBLOCK


def _record_bytes(qtype: str) -> int:
    if qtype in qmatmul_k.FORMATS:
        return qmatmul_k.record_bytes(qtype)
    codes = QPANEL * QBLOCK if qtype == "Q8_0" else QPANEL * QBLOCK // 2
    return codes + (4 if qtype == "Q4_1" else 2) * QPANEL


def pack(raw: np.ndarray, qtype: str, in_features: int) -> torch.Tensor:
    """A GGUF tensor's blocks [N, K / 32 * block bytes] (uint8, rows = output features) ->
    [ceil(N / 32), K / 32, record bytes] uint8 in qmatmul.c's layout (K-quants: qmatmul_k.pack)."""
    if qtype not in FORMATS:
        raise ValueError(f"qmatmul: {qtype} is not one of {', '.join(FORMATS)}")
    if qtype in qmatmul_k.FORMATS:
        return qmatmul_k.pack(raw, qtype, in_features)
    if in_features % QBLOCK:
        raise ValueError(f"qmatmul: {in_features} input features is not a multiple of {QBLOCK}")
    n = raw.shape[0]
    nb = in_features // QBLOCK
    blocks = np.ascontiguousarray(raw).reshape(n, nb, GGUF_BLOCK_BYTES[qtype])
    padded = -(-n // QPANEL) * QPANEL
    if padded != n:  # zero rows: zero scales, nothing added
        blocks = np.concatenate([blocks, np.zeros((padded - n, *blocks.shape[1:]), np.uint8)])
    panels = padded // QPANEL
    scale_bytes = 4 if qtype == "Q4_1" else 2
    # [panels, 32 columns, nb, bytes] -> per block, the columns' scales side by side
    per_column = blocks.reshape(panels, QPANEL, nb, -1)
    d = per_column[..., 0:2].transpose(0, 2, 1, 3).reshape(panels, nb, 2 * QPANEL)
    scales = [d]
    if qtype == "Q4_1":
        m = per_column[..., 2:4].transpose(0, 2, 1, 3).reshape(panels, nb, 2 * QPANEL)
        scales.append(m)
    codes = per_column[..., scale_bytes:]
    if qtype == "Q8_0":  # signed codes -> unsigned (+128), [g 8][c 32][i 4] per block
        codes = codes ^ np.uint8(0x80)
        codes = codes.reshape(panels, QPANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4)
    else:  # GGUF byte j holds codes j and 16 + j: bytes 4g + i, [g 4][c 32][i 4] per block
        codes = codes.reshape(panels, QPANEL, nb, 4, 4).transpose(0, 2, 3, 1, 4)
    codes = codes.reshape(panels, nb, -1)
    record = np.concatenate([codes, *scales], axis=2)
    assert record.shape[2] == _record_bytes(qtype)
    return torch.from_numpy(np.ascontiguousarray(record))


def pack_parts(parts: list[tuple[np.ndarray, str]], in_features: int) -> torch.Tensor:
    """Row blocks of a fused linear in different types ([(GGUF blocks [N_i, ...], qtype)], in
    row order) -> one uint8 buffer for format PARTS: int64 words [P, then format, rows and byte
    offset per part], then each part as `pack` lays it out, at 64-byte aligned offsets."""
    header_bytes = -(-(1 + 3 * len(parts)) * 8 // 64) * 64
    packed = [pack(raw, qtype, in_features).reshape(-1) for raw, qtype in parts]
    words, offset = [len(parts)], header_bytes
    for (raw, qtype), data in zip(parts, packed, strict=True):
        words += [FORMATS[qtype], raw.shape[0], offset]
        offset += -(-data.numel() // 64) * 64
    buffer = torch.zeros(offset, dtype=torch.uint8)
    buffer[: 8 * len(words)] = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    for (_, _, start), data in zip(np.reshape(words[1:], (-1, 3)), packed, strict=True):
        buffer[start : start + data.numel()] = data
    return buffer


def format_of(qtype: str) -> int:
    """The kernel's format id for a qtype, or PARTS for a joined one ("Q4_K+Q6_K")."""
    return PARTS if "+" in qtype else FORMATS[qtype]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's int8 activations of x [M, K] bf16: codes [M, K] int8, scales [M, K / 32]
    float32 and code sums [M, K / 32] int32 (x ~ codes * scale per block)."""
    rows, k = x.shape
    x = x.contiguous()
    codes = torch.empty(rows, k, dtype=torch.int8)
    scales = torch.empty(rows, k // QBLOCK, dtype=torch.float32)
    sums = torch.empty(rows, k // QBLOCK, dtype=torch.int32)
    status = load_library().quantize_rows_q8_bf16(
        x.data_ptr(), x.stride(0), rows, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr()
    )
    if status != 0:
        raise ValueError(f"quantize_rows: {rows} rows of {k} (a multiple of {QBLOCK}) bf16")
    return codes, scales, sums


def _check_packed(packed: torch.Tensor, qtype: str, in_features: int, out_features: int) -> None:
    if packed.dim() != 3 or packed.shape[1] * block_size(qtype) != in_features:
        raise ValueError(
            f"qmatmul: x has {in_features} columns, the packed weight {tuple(packed.shape)} "
            "was packed for another width"
        )
    if packed.shape[0] * QPANEL < out_features or packed.shape[2] != _record_bytes(qtype):
        raise ValueError(f"qmatmul: the packed weight does not hold {out_features} {qtype} rows")


def qmatmul(
    x: torch.Tensor,  # [M, K] bf16, M >= 1; rows may be strided, each contiguous
    packed: torch.Tensor,  # from `pack`, or `pack_parts` for this width
    qtype: str,  # a FORMATS name, or the parts' joined by "+"
    bias: torch.Tensor | None,  # [N] bf16
    out_features: int,
    out_dtype: torch.dtype = torch.bfloat16,  # float32: the bf16-rounded result, widened
    first_prompt_row: int | None = None,  # rows from it on are prompt tokens (`prompt_path`)
) -> torch.Tensor:  # [M, N]
    rows, in_features = x.shape
    if x.dtype != torch.bfloat16:
        raise ValueError(f"qmatmul: bf16 activations only, got {x.dtype}")
    if "+" not in qtype:  # parts: their formats and rows are checked in C
        _check_packed(packed, qtype, in_features, out_features)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, out_features, dtype=out_dtype)
    bf16_out = out_dtype == torch.bfloat16
    first_prompt = rows if first_prompt_row is None else first_prompt_row
    status = load_library().qmatmul_rows_bf16(
        format_of(qtype),
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
        first_prompt,
        torch.get_num_threads(),
    )
    if status == -3:
        raise MemoryError(f"qmatmul: out of memory for {rows} rows of x")
    if status != 0:
        raise ValueError(f"qmatmul: {rows} rows x {in_features} columns is not supported")
    return out

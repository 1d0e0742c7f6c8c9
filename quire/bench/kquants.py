"""A small numpy quantizer to GGUF's K-quant types (Q4_K, Q5_K, Q6_K), which the `gguf` package
reads but cannot write: for the random-weight benchmark models and the tests' tiny files.

Plain min/max scales per sub-block (no search for the best scale, as llama.cpp does), so the
files are valid K-quant files with a little more error than llama.cpp would give them; the
layout of the bytes is GGUF's own (checked against `gguf.quants.dequantize` in the tests).
"""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def quantize_k(values: np.ndarray, qtype: str) -> np.ndarray:
    """values [rows, K] float32 (K a multiple of 256) -> GGUF blocks [rows, K / 256 * bytes]."""
    rows, k = values.shape
    if k % SUPER_BLOCK:
        raise ValueError(f"{qtype} needs rows of whole super-blocks of {SUPER_BLOCK}, not {k}")
    blocks = values.astype(np.float32).reshape(-1, SUPER_BLOCK)
    out = _q6_k(blocks) if qtype == "Q6_K" else _q45_k(blocks, 31 if qtype == "Q5_K" else 15)
    return out.reshape(rows, -1)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x as float16 bytes [n, 2], x rounded to float16 as float32 [n])."""
    half = x.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b > 0)


def _q45_k(blocks: np.ndarray, qmax: int) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=2), 0.0)  # w = d sc q - dmin m with m >= 0
    scale = (sub.max(axis=2) - low) / qmax
    d_bytes, d = _f16(scale.max(axis=1) / 63)
    dmin_bytes, dmin = _f16(-low.min(axis=1) / 63)
    sc = np.clip(np.rint(_divide(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_divide(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc  # [n, 8]
    offset = dmin[:, None] * m
    q = np.rint(_divide(sub + offset[..., None], np.broadcast_to(step[..., None], sub.shape)))
    q = np.clip(q, 0, qmax).astype(np.uint8)  # [n, 8 sub-blocks, 32]
    # 12 bytes: sc / m 0..3 in the low 6 bits of bytes 0..7, their top 2 bits those of 4..7;
    # bytes 8..11 the low nibbles of sc 4..7 and, above, of m 4..7
    scales = np.concatenate(
        [
            (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )
    # qs: 4 chunks of 32 bytes, low nibbles sub-block 2c, high nibbles 2c + 1
    qs = ((q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)).reshape(n, 128)
    parts = [d_bytes, dmin_bytes, scales]
    if qmax == 31:  # qh: bit j of byte i the fifth bit of sub-block j's code i
        fifth = ((q >> 4) & 1).astype(np.uint16) << np.arange(8, dtype=np.uint16)[None, :, None]
        parts.append(fifth.sum(axis=1).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31  # w = d sc (q - 32), q - 32 in -32..31
    d_bytes, d = _f16(scale.max(axis=1) / 127)
    sc = np.clip(np.rint(_divide(scale, d[:, None])), -128, 127).astype(np.int8)
    step = np.broadcast_to((d[:, None] * sc)[..., None], sub.shape)
    q = (np.clip(np.rint(_divide(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    # ql [2 halves][64]: low nibbles codes 0..63 of the half, high nibbles 64..127
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)
    # qh [2][32]: bits 2s of byte i the top two bits of code 32 s + i
    top = (q >> 4).reshape(n, 2, 4, 32).astype(np.uint16)
    qh = (top << (2 * np.arange(4, dtype=np.uint16))[None, None, :, None]).sum(axis=2)
    parts = [ql.reshape(n, 128), qh.astype(np.uint8).reshape(n, 64), sc.view(np.uint8), d_bytes]
    return np.concatenate(parts, axis=1)

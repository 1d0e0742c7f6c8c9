"""Repacking GGUF K-quant tensors (Q4_K, Q5_K, Q6_K) for qmatmul_k.c, once at load time.

A K-quant super-block holds 256 weights of one row: GGUF packs their codes and 6-bit (Q6_K:
int8) sub-block scales tightly for storage; `pack` decodes them to integers and lays them out as
the kernel streams them (the layout is described at the top of qmatmul_k.c): panels of 32
output columns, per super-block the 8 sub-blocks of 32 codes (4-bit planes as the Q4_x panels,
then the high bits as bit planes), then the 32 columns' scales side by side.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import Q4_K

PANEL = 32  # output columns per packed panel (KPANEL in qmatmul_k.c)
SUPER_BLOCK = 256  # weights per super-block along K
SUB_BLOCK = 32
FORMATS = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}  # the enum in qmatmul_k.c
GGUF_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_HIGH_BYTES = {"Q4_K": 0, "Q5_K": 128, "Q6_K": 256}  # per sub-block, after its 512 nibble bytes


def record_bytes(qtype: str) -> int:
    """Bytes of one packed super-block of a panel (qmatmul_k_record_bytes)."""
    scales = 16 * PANEL + 2 * PANEL if qtype == "Q6_K" else 16 * PANEL + 4 * PANEL
    return 8 * (PANEL * SUB_BLOCK // 2 + _HIGH_BYTES[qtype]) + scales


def decode(blocks: np.ndarray, qtype: str) -> dict[str, np.ndarray]:
    """GGUF super-blocks [n, block bytes] -> their integers: `codes` [n, 8, 32] uint8 (the
    unsigned codes per sub-block of 32), `sc` [n, 8] uint8 and `m` [n, 8] uint8 with `d`, `dmin`
    [n] float16 (Q4_K, Q5_K); Q6_K: `sc` [n, 16] int8 and `d`."""
    n = blocks.shape[0]
    if qtype == "Q6_K":
        ql, qh, sc, d = np.split(blocks, [128, 192, 208], axis=1)
        # ql [2 halves][64]: low nibbles codes 0..63 of the half, high nibbles 64..127; qh [2][32]:
        # bits 2s of byte i the top bits of code 32 s + i
        low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        codes = low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)
        return {"codes": codes, "sc": sc.view(np.int8), "d": d.view(np.float16)[:, 0]}
    d, dmin, packed_scales, rest = np.split(blocks, [2, 4, 16], axis=1)
    sc, m = Q4_K.get_scale_min(packed_scales)
    qh, qs = (None, rest) if qtype == "Q4_K" else np.split(rest, [32], axis=1)
    # qs [4][32]: low nibbles sub-block 2c, high nibbles 2c + 1
    codes = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    codes = codes.reshape(n, 8, 32)
    if qh is not None:  # qh [32]: bit j of byte i the fifth bit of sub-block j's code i
        fifth = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        codes = codes | (fifth << 4)
    return {
        "codes": codes,
        "sc": sc,
        "m": m,
        "d": d.view(np.float16)[:, 0],
        "dmin": dmin.view(np.float16)[:, 0],
    }


def _columns_side_by_side(values: np.ndarray, panels: int, supers: int) -> np.ndarray:
    """[rows, supers, ...] -> [panels, supers, ..., 32 columns] flattened to bytes per record."""
    per_column = values.reshape(panels, PANEL, supers, *values.shape[2:])
    moved = np.moveaxis(per_column, 1, -1)  # [panels, supers, ..., 32]
    return np.ascontiguousarray(moved).view(np.uint8).reshape(panels, supers, -1)


def pack(raw: np.ndarray, qtype: str, in_features: int) -> torch.Tensor:
    """A GGUF K-quant tensor's blocks [N, K / 256 * block bytes] (uint8, rows = output features)
    -> [ceil(N / 32), K / 256, record bytes] uint8 in qmatmul_k.c's layout."""
    if in_features % SUPER_BLOCK:
        raise ValueError(
            f"qmatmul: {qtype} holds super-blocks of {SUPER_BLOCK} weights; {in_features} input "
            f"features is not a multiple of {SUPER_BLOCK}"
        )
    n, supers = raw.shape[0], in_features // SUPER_BLOCK
    padded = -(-n // PANEL) * PANEL
    blocks = np.ascontiguousarray(raw).reshape(n * supers, GGUF_BLOCK_BYTES[qtype])
    fields = {k: v.reshape(n, supers, *v.shape[1:]) for k, v in decode(blocks, qtype).items()}
    if padded != n:  # zero rows: zero scales, nothing added
        fields = {
            k: np.concatenate([v, np.zeros((padded - n, *v.shape[1:]), v.dtype)])
            for k, v in fields.items()
        }
    panels = padded // PANEL
    # codes [panels, 32 columns, supers, 8 sub-blocks, 2 halves h, 4 groups g, 4 i]: code h 16 + 4g + i
    codes = fields["codes"].reshape(panels, PANEL, supers, 8, 2, 4, 4)
    codes = codes.transpose(0, 2, 3, 1, 4, 5, 6)  # [panels, supers, 8, column, h, g, i]
    nibbles = (codes[:, :, :, :, 0] & 0x0F) | ((codes[:, :, :, :, 1] & 0x0F) << 4)
    planes = [nibbles.transpose(0, 1, 2, 4, 3, 5).reshape(panels, supers, 8, 512)]  # [g][c][i]
    # the high bits by halves of 16 columns: [panels, supers, 8, half, c, i, g, h]
    top = (codes >> 4).reshape(panels, supers, 8, 2, 16, 2, 4, 4).transpose(0, 1, 2, 3, 4, 7, 6, 5)
    top = top.reshape(panels, supers, 8, 2, 16, 4, 8).astype(np.uint16)  # last axis 2g + h
    if qtype == "Q5_K":  # bit 2g + h of byte 4c + i
        bits = (top << np.arange(8, dtype=np.uint16)).sum(axis=-1).astype(np.uint8)
        planes.append(bits.reshape(panels, supers, 8, 128))
    elif qtype == "Q6_K":  # plane t, bits 2s of byte 4c + i, 2g + h = 4t + s
        crumbs = top.reshape(panels, supers, 8, 2, 16, 4, 2, 4)
        crumbs = (crumbs << (2 * np.arange(4, dtype=np.uint16))).sum(axis=-1).astype(np.uint8)
        planes.append(crumbs.transpose(0, 1, 2, 3, 6, 4, 5).reshape(panels, supers, 8, 256))
    sub_blocks = np.concatenate(planes, axis=3).reshape(panels, supers, -1)
    names = ["sc", "d"] if qtype == "Q6_K" else ["sc", "m", "d", "dmin"]
    scales = [_columns_side_by_side(fields[name], panels, supers) for name in names]
    record = np.concatenate([sub_blocks, *scales], axis=2)
    assert record.shape[2] == record_bytes(qtype)
    return torch.from_numpy(np.ascontiguousarray(record))

"""A GGUF file's scalar metadata, read from its header alone: what the engine's arguments are
checked against before anything loads (the full parse, gguf_loader.py, reads the tokenizer's
tens of thousands of strings too, and takes seconds).

The header is the magic `GGUF`, a version (2 or 3), the tensor and key counts, then each key:
its name, a type code and a value; an array (the tokenizer's vocabulary) is skipped over.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import BinaryIO

# GGUF's value type codes -> struct formats of the fixed-size ones
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"
}  # fmt: skip
_STRING, _ARRAY = 8, 9


def iter_gguf_scalars(path: str) -> Iterator[tuple[str, int | float | bool | str]]:
    """(key, value) of each scalar or string in the metadata of the GGUF file at `path`, in file
    order; arrays are skipped. Raises ValueError when the header is not GGUF v2 or v3."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path!r} is not a GGUF file (it does not start with 'GGUF').")
        version = f.read(4)
        orders = [o for o in "<>" if struct.unpack(o + "I", version)[0] in (2, 3)]
        if not orders:  # little-endian, or a big-endian file's
            (number,) = struct.unpack("<I", version)
            raise ValueError(f"{path!r} is GGUF version {number}; quire reads versions 2 and 3.")
        order = orders[0]
        _, num_keys = struct.unpack(order + "QQ", f.read(16))
        for _ in range(num_keys):
            key = _read_string(f, order)
            (kind,) = struct.unpack(order + "I", f.read(4))
            if kind == _ARRAY:
                _skip_array(f, order)
            else:
                yield key, _read_value(f, order, kind)


def _read_string(f: BinaryIO, order: str) -> str:
    (length,) = struct.unpack(order + "Q", f.read(8))
    return f.read(length).decode("utf-8")


def _read_value(f: BinaryIO, order: str, kind: int) -> int | float | bool | str:
    if kind == _STRING:
        return _read_string(f, order)
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {kind}")
    fmt = order + _SCALARS[kind]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _skip_array(f: BinaryIO, order: str) -> None:
    kind, count = struct.unpack(order + "IQ", f.read(12))
    if kind in _SCALARS:
        f.seek(count * struct.calcsize(order + _SCALARS[kind]), 1)
        return
    for _ in range(count):  # strings (or nested arrays): each says its own length
        if kind == _STRING:
            (length,) = struct.unpack(order + "Q", f.read(8))
            f.seek(length, 1)
        else:
            _skip_array(f, order)

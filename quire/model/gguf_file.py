"""The GGUF file format, read: metadata as Python values and tensors as views of the memory-mapped
file, every offset checked against the file's size.

The header is read straight from the memory map with `struct` (SmolLM2's 49k-token vocabulary
and 48k merges are most of it), and a tensor's bytes are not touched until its data is used.
Anything that is not a whole GGUF file (a wrong magic or version, a header or a tensor cut off
by the end of the file, an unknown value or tensor type) raises ModelFileError naming the file
and what is wrong.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quire.model.model_config import ModelFileError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count

# GGUF metadata value types: struct formats of the scalars; 8 is a string, 9 an array
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9

# tensor types stored as plain elements; every other type is blocks, given as bytes
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: ne0 (the row length) first
    n_elements: int
    n_bytes: int
    # torch order (shape reversed), read-only; a block type as [..., rows, bytes per row]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]  # numbers, strings, and arrays as lists
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads the header's little-endian fields in order, refusing to read past the file's end."""

    def __init__(self, path: str, buffer: mmap.mmap | bytes):
        self.path = path
        self.buffer = buffer
        self.size = len(buffer)
        self.offset = 0

    def _need(self, num_bytes: int) -> None:
        if self.offset + num_bytes > self.size:
            raise ModelFileError(
                f"{self.path}: the GGUF file is truncated: {self.size} bytes, its header runs "
                "past the end (an interrupted download or copy?)"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self._need(length)
        start = self.offset
        self.offset += length
        try:
            return self.buffer[start : self.offset].decode("utf-8")
        except UnicodeDecodeError:
            raise self._not_utf8(start) from None

    def _not_utf8(self, offset: int) -> ModelFileError:
        return ModelFileError(
            f"{self.path}: the GGUF header has a string that is not UTF-8 at byte {offset}"
        )

    def strings(self, count: int) -> list[str]:
        """`count` strings one after the other (a vocabulary: one tight loop, 50 ms for 49k)."""
        buffer, offset, size = self.buffer, self.offset, self.size
        unpack = struct.Struct("<Q").unpack_from
        items = []
        while len(items) < count and offset + 8 <= size:
            start = offset + 8
            offset = start + unpack(buffer, offset)[0]
            try:
                items.append(buffer[start:offset].decode("utf-8"))
            except UnicodeDecodeError:
                raise self._not_utf8(start) from None
        self.offset = offset
        self._need(8 if len(items) < count else 0)  # cut off by the end of the file
        return items

    def value(self, value_type: int, key: str) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type])
                self._need(count * dtype.itemsize)
                items = np.frombuffer(self.buffer, dtype, count, self.offset)
                self.offset += count * dtype.itemsize
                return items.tolist()
            if item_type == _STRING:
                return self.strings(count)
            return [self.value(item_type, key) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ModelFileError(
                f"{self.path}: the GGUF metadata key {key!r} has an unknown value type {value_type}"
            )
        return self.scalar(_SCALARS[value_type])


def read_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensors (views of its memory map, which stays open as long as
    they do). Raises FileNotFoundError for a missing file, ModelFileError for a broken one."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < _HEADER_BYTES:
            raise ModelFileError(
                f"{path}: not a GGUF file: {size} bytes, fewer than a GGUF header's {_HEADER_BYTES}"
            )
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(path, buffer)
    magic = buffer[:4]
    if magic != _MAGIC:
        raise ModelFileError(
            f"{path}: not a GGUF file: it starts with {magic!r}, a GGUF file with {_MAGIC!r}"
        )
    cursor.offset = 4
    version = cursor.scalar("<I")
    if version not in _VERSIONS:
        raise ModelFileError(
            f"{path}: GGUF version {version} is not supported; quire reads versions "
            f"{', '.join(map(str, _VERSIONS))} (little-endian)"
        )
    num_tensors, num_keys = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_keys):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"), key)
    infos = [_tensor_info(cursor) for _ in range(num_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 1:
        raise ModelFileError(
            f"{path}: general.alignment must be a positive integer, not {alignment!r}"
        )
    data_start = -(-cursor.offset // alignment) * alignment
    everything = np.frombuffer(buffer, np.uint8)
    tensors = [_tensor(path, everything, data_start, *info) for info in infos]
    return GGUFFile(path, metadata, tensors)


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """(name, shape in GGUF order, type, offset in the data section) of the next tensor."""
    name = cursor.string()
    num_dims = cursor.scalar("<I")
    shape = tuple(cursor.scalar("<Q") for _ in range(num_dims))
    return name, shape, cursor.scalar("<I"), cursor.scalar("<Q")


def _tensor(
    path: str,
    everything: np.ndarray,
    data_start: int,
    name: str,
    shape: tuple[int, ...],
    type_id: int,
    offset: int,
) -> GGUFTensor:
    try:
        tensor_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelFileError(f"{path}: tensor {name!r} has an unknown type {type_id}") from None
    n_elements = int(np.prod(shape, dtype=np.int64))
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    torch_shape = tuple(reversed(shape))
    if tensor_type in _ELEMENT_DTYPES:
        dtype = np.dtype(_ELEMENT_DTYPES[tensor_type])
    else:
        if not shape or shape[0] % block_size:
            raise ModelFileError(
                f"{path}: tensor {name!r} of shape {shape} is not in whole {tensor_type.name} "
                f"blocks of {block_size}"
            )
        dtype = np.dtype(np.uint8)
        torch_shape = (*torch_shape[:-1], shape[0] // block_size * type_size)
    n_bytes = n_elements // block_size * type_size
    start = data_start + offset
    if start + n_bytes > everything.size:
        raise ModelFileError(
            f"{path}: the GGUF file is truncated: {everything.size} bytes, and tensor {name!r} "
            f"needs bytes {start} to {start + n_bytes} (an interrupted download or copy?)"
        )
    data = everything[start : start + n_bytes].view(dtype).reshape(torch_shape)
    return GGUFTensor(name, tensor_type, shape, n_elements, n_bytes, data)

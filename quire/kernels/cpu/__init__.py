"""CPU kernels in C, compiled on first use with the system C compiler and called through ctypes.

Each has a pure-PyTorch twin in quire/attention/torch_backend.py; when no compiler is available
(or QUIRE_CPU_KERNELS=0) the engine uses that instead. Builds are cached under
~/.cache/quire/kernels, keyed by the source, the flags and the machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

logger = logging.getLogger(__name__)

_SOURCE_DIR = os.path.dirname(__file__)
# -ffast-math at compile time only (vectorized expf from libmvec, reassociated dot products; the
# inputs are finite). Linking is a separate step without it: gcc would otherwise link
# crtfastmath.o, which turns on flush-to-zero for the whole process when the library loads.
_COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-ffast-math", "-c"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "quire", "kernels")


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here."""
    if os.environ.get("QUIRE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("No C compiler found: using the PyTorch attention path on CPU")
        return None
    sources = sorted(
        os.path.join(_SOURCE_DIR, name) for name in os.listdir(_SOURCE_DIR) if name.endswith(".c")
    )
    digest = hashlib.sha256(" ".join(_COMPILE_FLAGS + _LINK_FLAGS).encode())
    for source in sources:
        with open(source, "rb") as f:
            digest.update(f.read())
    digest.update(platform.node().encode())
    key = digest.hexdigest()
    path = os.path.join(_cache_dir(), f"quire_cpu_{key[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(_cache_dir(), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=_cache_dir()) as build:
            objects = [os.path.join(build, f"{i}.o") for i in range(len(sources))]
            lib = os.path.join(build, "kernels.so")
            commands = [
                [compiler, *_COMPILE_FLAGS, source, "-o", obj]
                for source, obj in zip(sources, objects, strict=True)
            ]
            commands.append([compiler, *_LINK_FLAGS, *objects, "-o", lib, "-lm"])
            for command in commands:
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    logger.warning("Building CPU kernels failed; using PyTorch:\n%s", result.stderr)
                    return None
            os.replace(lib, path)
    lib = ctypes.CDLL(path)
    args = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    for name in ("paged_decode_bf16", "paged_decode_f32"):
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


_DECODE_FUNCTIONS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


def supports_paged_decode(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    return (
        dtype in _DECODE_FUNCTIONS
        and num_heads <= 64
        and head_dim <= 256
        and load_library() is not None
    )


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, contiguous
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    query = query.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    fn = getattr(load_library(), _DECODE_FUNCTIONS[query.dtype])
    status = fn(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            "paged_decode: unsupported shape (more than 64 heads, head_dim > 256 or block > 128)"
        )
    return out

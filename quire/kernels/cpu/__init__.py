"""CPU kernels in C, compiled on first use with the system C compiler and called through ctypes.

Each has a pure-PyTorch twin in quire/attention/torch_backend.py; when no compiler is available
(or EngineConfig.cpu_kernels is off) the engine uses that instead. Builds are cached under
$XDG_CACHE_HOME/quire/kernels (~/.cache by default), keyed by the source, the flags and the
machine.

The library is built for this CPU (-march=native). QUIRE_CPU_MARCH names another target, e.g.
x86-64-v3 (AVX2, no AVX-512) to run the portable paths on an AVX-512 machine, as on an AVX2-only
CPU: every kernel has a plain-C branch, and the AVX-512 BF16-only ones report themselves absent.
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
from dataclasses import dataclass

import torch

from quire import envs
from quire.kernels import kv_format

logger = logging.getLogger(__name__)

_SOURCE_DIR = os.path.dirname(__file__)
# -ffast-math at compile time only (vectorized expf from libmvec, reassociated dot products; the
# inputs are finite). Linking is a separate step without it: gcc would otherwise link
# crtfastmath.o, which turns on flush-to-zero for the whole process when the library loads.
_COMPILE_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-ffast-math", "-c"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_PAGED_DECODE = [_P] * 6 + [_I32] * 6 + [_F32, _I32]
# The library's functions and their argument types (see kernels.h and each .c file).
_SIGNATURES = {
    # q, k_cache, v_cache, block_tables, seq_lens, out; num_seqs, num_heads, num_kv_heads,
    # head_dim, block_size, max_blocks; scale, num_threads.
    "paged_decode_bf16": _PAGED_DECODE,
    "paged_decode_f32": _PAGED_DECODE,
    # kind (kv_quant.h), then paged_decode_bf16's arguments over a quantized cache.
    "paged_decode_quant": [_I32, *_PAGED_DECODE],
    "paged_decode_path": [],
    # kind, key, value, their token strides, k_cache, v_cache, slots; tokens, num_kv_heads,
    # head_dim, num_threads.
    "store_kv_rows": [_I32, _P, _P, _I64, _I64, _P, _P, _P] + [_I32] * 4,
    # q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out; q and out token strides;
    # num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks; scale, num_threads.
    "prefill_attention_bf16": [_P] * 7 + [_I64] * 2 + [_I32] * 6 + [_F32, _I32, _I32],
    "prefill_attention_path": [],
    "prefill_attention_uses_amx": [],
    # x, x row stride, residual, weight, out; rows, dim, eps, num_threads.
    "add_rms_norm_bf16": [_P, _I64, _P, _P, _P, _I32, _I32, _F32, _I32],
    # x, x row stride, cos, sin; tokens, heads, head_dim, num_threads.
    "rotary_bf16": [_P, _I64, _P, _P] + [_I32] * 4,
    # gate_up, silu table, out; rows, d, num_threads.
    "silu_and_mul_bf16": [_P] * 3 + [_I32] * 3,
    # x, x row stride, packed weight, bias, y (bf16) or y (float32), y row stride; M, N, K,
    # k_block, threads.
    "gemv_bf16": [_P, _I64] + [_P] * 4 + [_I64] + [_I32] * 5,
    "gemv_bf16_available": [],
    # format, x, x row stride, packed weight, bias, y (bf16) or y (float32), y row stride; M, N,
    # K, threads (qmatmul.c).
    "qmatmul_bf16": [_I32, _P, _I64] + [_P] * 4 + [_I64] + [_I32] * 4,
    # qmatmul_bf16's arguments with the step's first prompt row before the threads.
    "qmatmul_rows_bf16": [_I32, _P, _I64] + [_P] * 4 + [_I64] + [_I32] * 5,
    # format, x, x row stride, packed gate|up weight, SiLU table, y, y row stride; M, N (y's
    # columns), K, threads (matmul_amx.c).
    "qmatmul_amx_silu_bf16": [_I32, _P, _I64, _P, _P, _P, _I64] + [_I32] * 4,
    # format, packed weight, first block, end block, out (bf16, gemv.c's packed layout).
    "qmatmul_dequantize_bf16": [_I32, _P, _I64, _I64, _P],
    # x, x row stride, rows, K, codes, scales, sums.
    "quantize_rows_q8_bf16": [_P, _I64, _I32, _I32, _P, _P, _P],
    "qmatmul_record_bytes": [_I32],
    "qmatmul_vnni": [],
    "qmatmul_path": [],
    "gemv_bf16_uses_fma": [],
    # 1: every GEMV call runs on AMX tiles in matmul_amx.c's order (where AMX runs); 0: not.
    "gemv_bf16_set_amx": [_I32],
    "gemv_bf16_uses_amx": [],
    "matmul_amx_available": [],
    # -1 (probe), 0 (vdpbf16ps) or 1 (FMA): the inner loop from the next call on.
    "gemv_bf16_set_fma": [_I32],
    # x, rows, cols, out, num_threads.
    "argmax_f32": [_P, _I64, _I64, _P, _I32],
    # x, cols, bitmask, words, rows (int64), number of masked rows, num_threads.
    "apply_token_bitmask_f32": [_P, _I64, _P, _I64, _P, _I64, _I32],
    # ShmGroup*, x (bf16), number of elements.
    "shm_all_reduce_bf16": [_P, _P, _I64],
    # is_bf16, x, x row stride, out, out row stride, lora_a, lora_b, token slots, out slices;
    # modules, tokens, in, out, max_rank, num_threads (lora.c).
    "lora_add": [_I32, _P, _I64, _P, _I64] + [_P] * 4 + [_I32, _I64] + [_I32] * 4,
    # format, x, x row stride, packed weight, bias, y (bf16), y row stride; M, N, K; lora_a,
    # lora_b, token slots, out slices; modules, max_rank, num_threads (lora.c).
    "qmatmul_lora_bf16": [_I32, _P, _I64, _P, _P, _P, _I64] + [_I32] * 3 + [_P] * 4 + [_I32] * 3,
    # DecodeModel*, DecodeStep*, token ids, positions, hidden, residual, out.
    "decode_step_bf16": [_P] * 7,
    # The same, then logits (float32) and the argmax ids (int64).
    "decode_step_argmax_bf16": [_P] * 9,
    # DecodeModel*, x (bf16 rows), rows, logits (float32), argmax ids (int64), num_threads.
    "lm_head_argmax_bf16": [_P, _P, _I32, _P, _P, _I32],
}


# The float unary ops ATen hands to MKL's VML (aten/src/ATen/cpu/vml.h).
_VML_OPS = (
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "erfinv", "exp",
    "expm1", "floor", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round",
    "rsqrt", "sigmoid", "sin", "sinh", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip


@functools.cache
def warm_up_torch_math() -> None:
    """Has oneMKL pick its kernel for each float unary op ATen hands to VML, with one element on
    this thread, before any such op runs split over threads. oneMKL picks at a function's first
    call, and first calls made at once from several threads can run a low-accuracy kernel on one
    thread's part (pytorch/pytorch#188792). Seen here, on an Intel Xeon with AMX: the rotary
    tables' first `cos` off by up to 1.5e-4 on rows 80-159 of 160 in 2 to 4 of 10 processes, so
    a request's tokens depended on the process. Once per process, ~0.1 ms."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in _VML_OPS:
            getattr(torch, name)(x)


def _cache_dir() -> str:
    return os.path.join(envs.XDG_CACHE_HOME, "quire", "kernels")


@dataclass(frozen=True)
class KernelSettings:
    """The process's choices for the C kernels, from EngineConfig's fields of the same meaning.

    Process-wide, not per engine, because what they choose is: a process loads one copy of the
    library, the GEMV inner loop is a static in gemv.c, and the layers that ask whether a kernel
    runs (norms, rotary, attention backends) are built without the engine's config and ask at
    every call. Each engine sets them once when it builds its model (`configure`); two engines
    in one process with different choices share the later one's. (Packing weights and huge
    pages are decided per engine at load time and are passed down as parameters instead.)
    """

    enabled: bool  # build and use the library; False: PyTorch everywhere
    gemv_fma: bool | None  # GEMV inner loop: True FMA, False vdpbf16ps, None a timing probe
    amx: bool = envs.QUIRE_CPU_AMX  # GEMV on AMX tiles where the CPU has them (matmul_amx.c)


_settings = KernelSettings(
    enabled=envs.QUIRE_CPU_KERNELS, gemv_fma=envs.QUIRE_GEMV_FMA, amx=envs.QUIRE_CPU_AMX
)


def configure(settings: KernelSettings) -> None:
    """Sets the process's kernel choices; they apply from the next `load_library()` on."""
    global _settings
    _settings = settings
    load_library.cache_clear()


def settings() -> KernelSettings:
    return _settings


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library with the GEMV loop set as the settings ask, or None when the
    kernels are off or cannot be built here. Cached (it is called at every layer of a step), and
    the cache cleared by `configure`; the build itself is done once (`build_library`)."""
    if not _settings.enabled:
        return None
    lib = build_library(_SOURCE_DIR)
    if lib is not None:
        fma = _settings.gemv_fma
        lib.gemv_bf16_set_fma(-1 if fma is None else int(fma))
        lib.gemv_bf16_set_amx(int(_settings.amx))
    return lib


@functools.cache
def build_library(source_dir: str) -> ctypes.CDLL | None:
    """The library built from the .c and .h files of `source_dir` (this package's own for
    load_library; another tree's for an A/B of two builds in one process, see
    scripts/ab_kernels.py), or None when it cannot be built here."""
    compiler = envs.CC or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("No C compiler found: using the PyTorch attention path on CPU")
        return None
    names = sorted(os.listdir(source_dir))
    sources = [os.path.join(source_dir, name) for name in names if name.endswith(".c")]
    compile_flags = [*_COMPILE_FLAGS, f"-march={envs.QUIRE_CPU_MARCH}"]
    digest = hashlib.sha256(" ".join(compile_flags + _LINK_FLAGS).encode())
    for name in names:
        if name.endswith((".c", ".h")):  # a header change must rebuild too
            with open(os.path.join(source_dir, name), "rb") as f:
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
                [compiler, *compile_flags, source, "-o", obj]
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
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int  # a status (0: done), or 1 / 0 for the yes/no queries
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
    lib = load_library()
    if kv_format.is_quantized(k_cache.dtype):
        if query.dtype != torch.bfloat16:
            raise ValueError("paged_decode: a quantized KV cache takes bf16 queries")
        fn = functools.partial(lib.paged_decode_quant, kv_format.kind(k_cache.dtype))
    else:
        fn = getattr(lib, _DECODE_FUNCTIONS[query.dtype])
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
    if status == -3:
        raise MemoryError("paged_decode: out of memory for the partial results")
    if status != 0:
        raise ValueError(
            "paged_decode: unsupported shape (more than 64 heads, head_dim > 256 or block > 128)"
        )
    return out


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] bf16, heads and dims contiguous
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim (+ 4 quantized)]
    v_cache: torch.Tensor,  # bf16, or a quantized cache (kv_format)
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Writes each token's K and V rows into their slots (kv_quant.c): bf16 rows copied, or
    quantized per KV head with a scale each."""
    num_tokens, num_kv_heads, head_dim = key.shape
    for x in (key, value):
        if x.dtype != torch.bfloat16 or x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError("store_kv: K/V must be bf16 with heads and dims contiguous")
    quantized = kv_format.is_quantized(k_cache.dtype)
    if not quantized and k_cache.dtype != torch.bfloat16:
        raise ValueError(f"store_kv: a bf16 or quantized cache, not {k_cache.dtype}")
    slots = slot_mapping.to(torch.int64).contiguous()
    status = load_library().store_kv_rows(
        kv_format.kind(k_cache.dtype) if quantized else 0,
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        num_tokens,
        num_kv_heads,
        head_dim,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"store_kv: not a cache it writes ({k_cache.dtype})")


class ShmGroup(ctypes.Structure):
    """A tensor-parallel group's shared-memory file as the C collectives see it (ShmGroup in
    kernels.h, field for field; quire/distributed/shm_all_reduce.py maps the file)."""

    _fields_ = [
        ("base", ctypes.c_void_p),
        ("slot_bytes", ctypes.c_int64),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
    ]


def shm_all_reduce_bf16(group: ShmGroup, x: torch.Tensor) -> None:
    """x (bf16, contiguous, CPU), in place: its sum over the group's ranks, in the C code the
    decode step runs (collective: every rank calls it)."""
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError("shm_all_reduce_bf16: x must be contiguous bf16")
    status = load_library().shm_all_reduce_bf16(ctypes.byref(group), x.data_ptr(), x.numel())
    if status != 0:
        raise ValueError(f"shm_all_reduce_bf16: {x.nbytes} bytes do not fit a slot")


def decode_attention_path() -> str:
    """The paged decode kernel's loop here, for bf16 and quantized caches: "avx512-bf16"
    (head_dim a multiple of 32), "avx2" (a multiple of 16), "c" (the portable loop, also what
    other head sizes take), or "off" (no library: PyTorch)."""
    lib = load_library()
    return "off" if lib is None else ("c", "avx2", "avx512-bf16")[lib.paged_decode_path()]


def _prefill_loop() -> int:
    """The C prefill_attention_path(): 2 AVX-512 BF16, 1 AVX2, 0 none (or no library)."""
    lib = load_library()
    return 0 if lib is None else _prefill_loop_built(lib)


@functools.cache
def _prefill_loop_built(lib: ctypes.CDLL) -> int:
    return lib.prefill_attention_path()


def prefill_attention_path() -> str:
    """The prefill-attention kernel's loop here: "amx" (S and O on AMX tiles, where the bf16
    matmul runs on them: EngineConfig.cpu_amx), "avx512-bf16", "avx2", or "off" (no kernel:
    PyTorch, or one decode per prompt token)."""
    loop = _prefill_loop()
    if loop == 2 and load_library().prefill_attention_uses_amx() == 1:
        return "amx"
    return ("off", "avx2", "avx512-bf16")[loop]


def supports_prefill_attention(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether `prefill_attention` runs this shape here: bf16, GQA groups up to 32 heads, on a
    CPU with AVX-512 BF16 (the library is built with -march=native) for head_dim 32/64/128/256,
    or with AVX2 and FMA for head_dim a multiple of 8 up to 256."""
    loop = _prefill_loop()
    head_dim_ok = (
        head_dim in (32, 64, 128, 256)
        if loop == 2
        else loop == 1 and head_dim % 8 == 0 and 8 <= head_dim <= 256
    )
    return (
        dtype == torch.bfloat16
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 32
        and head_dim_ok
    )


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] bf16; heads and dims contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16, contiguous,
    v_cache: torch.Tensor,  # or quantized (kernels/kv_format.py): rows of head_dim + 4
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets into query's tokens
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached prefix + chunk
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] bf16; heads and dims contiguous
) -> None:
    """Causal attention of every request's chunk over its whole context, read from the paged
    cache (the chunks' own K/V must already be stored there); writes into `out`. Chunk token j
    of request i sits at position seq_lens[i] - query_len + j. A quantized cache is read in its
    codes, each row dequantized to bf16 as `kv_format.dequantize(rows).bfloat16()` gives it."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    for x in (query, out):
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError("prefill_attention: heads and dims of query / out must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("prefill_attention: the KV cache must be contiguous")
    if {query.dtype, out.dtype} != {torch.bfloat16} or not (
        k_cache.dtype == v_cache.dtype
        and (k_cache.dtype == torch.bfloat16 or kv_format.is_quantized(k_cache.dtype))
    ):
        raise ValueError("prefill_attention: bf16 queries, and a bf16 or quantized KV cache")
    if kv_format.head_dim_of(k_cache) != head_dim:
        raise ValueError("prefill_attention: the KV cache's rows are for another head_dim")
    kind = kv_format.kind(k_cache.dtype) if kv_format.is_quantized(k_cache.dtype) else 0
    # Held in locals: the C code reads them through raw pointers.
    block_tables = block_tables.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    status = load_library().prefill_attention_bf16(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        query.stride(0),
        out.stride(0),
        seq_lens.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        kind,
        torch.get_num_threads(),
    )
    if status != 0:
        reason = {-1: "unsupported shape or inconsistent lengths", -3: "out of memory"}
        raise ValueError(
            f"prefill_attention: {reason.get(status, 'no AVX2 or AVX-512 BF16 build')}"
        )

"""The KV cache's element formats: `--kv-cache-dtype` names, the tensors that hold each, and
the bytes a token takes.

`auto` stores K/V in the model's dtype and `bfloat16` in bf16 (the model's activations must be
bf16 for it). The quantized formats store each token's row per KV head as `head_dim` one-byte
codes followed by that row's float32 scale, so a cache tensor is
`[num_blocks, block_size, num_kv_heads, head_dim + 4]` of the code's dtype (torch.int8,
torch.float8_e4m3fn or torch.float8_e5m2; the last 4 elements are the scale's bytes). A value
is code * scale, with scale = the row's largest magnitude over the code's largest (127, 448,
57344), set once when the token is written (kernels/cpu/kv_quant.h). The scale living in the
row means a block is self-contained: copy-on-write, prefix reuse, read_blocks/write_blocks and
KV transfer move codes and scales together with no second tensor.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype's values: vLLM's (fp8 is fp8_e4m3), and int8.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
SCALE_BYTES = 4
# The quantized formats: their cache tensor dtype and their number in kernels/cpu/kv_quant.h.
_QUANTIZED = {
    "int8": (torch.int8, 1),
    "fp8_e4m3": (torch.float8_e4m3fn, 2),
    "fp8_e5m2": (torch.float8_e5m2, 3),
}
_KINDS = {dtype: kind for dtype, kind in _QUANTIZED.values()}


def check_kv_cache_dtype(name: str) -> str:
    """The canonical name of a `--kv-cache-dtype` value (`fp8` is `fp8_e4m3`, as in vLLM)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}."
        )
    return "fp8_e4m3" if name == "fp8" else name


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, c_decode: bool) -> torch.dtype:
    """The dtype of the cache tensors for a (canonical) `kv_cache_dtype` and the model's dtype.
    Raises ValueError where the attention kernels cannot read it: a bf16 or quantized cache
    needs bf16 activations, and a quantized one the C decode kernel for the model's attention
    shape (`c_decode`: kernels/cpu.supports_paged_decode; there is no PyTorch path for it)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if model_dtype != torch.bfloat16:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} needs bfloat16 activations, and this model "
            f"runs in {str(model_dtype).removeprefix('torch.')}: pass --dtype bfloat16, or "
            "kv_cache_dtype auto."
        )
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16
    if not c_decode:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is read by the C attention kernels, which are "
            "off, could not be built here (cpu_kernels, a C compiler) or do not take this "
            "model's attention (at most 64 heads, head_dim 256): use kv_cache_dtype auto."
        )
    return _QUANTIZED[kv_cache_dtype][0]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _KINDS


def kind(dtype: torch.dtype) -> int:
    """The format's number in the C kernels (kv_quant.h)."""
    return _KINDS[dtype]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one token's row per KV head in a cache of `dtype`."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """head_dim of a cache tensor `[num_blocks, block_size, num_kv_heads, row]`."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache.dtype) else 0)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """The float32 values of quantized rows `[..., head_dim + 4]`: code * scale, as the C
    kernels compute them (kv_quant.h)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return rows[..., :head_dim].to(torch.float32) * scale


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token of one layer."""
    return 2 * num_kv_heads * row_width(head_dim, dtype) * dtype.itemsize


def name(dtype: torch.dtype) -> str:
    """The format's name, as the disaggregation layout check compares it."""
    for key, (quantized, _) in _QUANTIZED.items():
        if quantized == dtype:
            return key
    return str(dtype).removeprefix("torch.")

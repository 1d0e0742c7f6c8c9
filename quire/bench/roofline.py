"""The roofline: this machine's measured memory bandwidth and matmul peak, and the bytes and FLOPs
a model moves and computes per decode step and per prefill.

Decode is memory-bound: its floor is (weights + KV read) / bandwidth. Prefill is compute-bound:
its floor is FLOPs / matmul peak. The cost model counts the matmul weights only (the attention
projections, the MLP and the LM head); norms and biases are under 0.1% of a real model and are
left out. The embedding table costs one row per token (also left out) but, tied or not, the LM
head reads a whole `vocab x hidden` matrix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quire.kernels import kv_format
from quire.model.model_config import ModelConfig
from quire.worker import host_memory

_CPU_BANDWIDTH_BYTES = 512 << 20
_GPU_BANDWIDTH_BYTES = 4 << 30
_CPU_MATMUL_SIZE = 2048
_CPU_SCREEN_SIZE = 384  # a product that takes milliseconds, not seconds, on any CPU
_GPU_MATMUL_SIZE = 8192


@dataclass
class Hardware:
    """Measured peaks: read bandwidth (what a decode step does), copy bandwidth (read + write,
    both counted) and dense bf16 matmul throughput."""

    device: str
    read_gbps: float
    copy_gbps: float
    matmul_tflops: float

    @property
    def bandwidth_gbps(self) -> float:
        return self.read_gbps


def _timed(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _best_seconds(fn: Callable[[], object], device: str, iters: int) -> float:
    """The fastest of `iters` timed calls after one warm-up: on a shared machine the fastest run
    is the one least disturbed by other jobs."""
    fn()
    return min(_timed(fn, device) for _ in range(iters))


class BandwidthProbe:
    """Read bandwidth, one timed read at a time: a sum over a tensor much larger than the caches.
    (Measured here, interleaved: torch's sum, a prefetching C read loop and the GEMV kernel
    streaming its weights all read at the same median speed.) On CPU the tensor is on huge pages
    where the engine puts its weights and KV cache there (`huge_pages`, as EngineConfig's;
    worker/host_memory.py): ~4% faster reads here, which the roofline must include."""

    def __init__(self, device: str = "cpu", nbytes: int | None = None, huge_pages: bool = True):
        if nbytes is None:
            nbytes = _GPU_BANDWIDTH_BYTES if device == "cuda" else _CPU_BANDWIDTH_BYTES
        self.device, self.nbytes = device, nbytes
        if torch.device(device).type == "cpu":
            (self.src,) = host_memory.zeros([((nbytes // 4,), torch.float32)], huge_pages)
            self.src.fill_(1.0)
        else:
            self.src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        self.src.sum()  # warm-up

    def read_gbps(self) -> float:
        return self.nbytes / _timed(self.src.sum, self.device) / 1e9


def _fast_cpu_dtypes(dtypes: list[torch.dtype]) -> list[torch.dtype]:
    """Those of `dtypes` whose small product runs within 4x of the fastest's. Where the CPU has
    no bf16 instructions torch's bf16 product is a slow fallback (an AMD EPYC Zen 1 here: ~1
    GFLOP/s against ~30 in float32), and one full-size product of it would take half a minute."""
    rates = {}
    for dtype in dtypes:
        a = torch.randn(_CPU_SCREEN_SIZE, _CPU_SCREEN_SIZE).to(dtype)
        a @ a  # warm-up
        rates[dtype] = 1.0 / _best_seconds(lambda a=a: a @ a, "cpu", 3)
    best = max(rates.values())
    return [dtype for dtype in dtypes if rates[dtype] * 4 >= best]


class MatmulProbe:
    """Dense matmul throughput on `dtype` inputs, one timed `size x size` product (2 * size^3
    FLOPs) per operand dtype at a time. On CPU, bf16 inputs are also multiplied widened to
    float32 (exact), and the faster of the two counts: where vdpbf16ps issues at half the FMA
    rate (an Intel Xeon without AMX here: torch's bf16 matmul 0.17 TFLOP/s, float32 0.33), the
    GEMV kernel computes in float32, and the floor must be what the machine can do. A small product
    of each goes first, and a type 4x slower than the other is not timed at full size."""

    def __init__(
        self, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, size: int | None = None
    ):
        if size is None:
            size = _GPU_MATMUL_SIZE if device == "cuda" else _CPU_MATMUL_SIZE
        self.device, self.size = device, size
        dtypes = [dtype]
        if device == "cpu" and dtype == torch.bfloat16:
            dtypes = _fast_cpu_dtypes([torch.bfloat16, torch.float32])
        self.operands = []
        for operand_dtype in dtypes:
            a = torch.randn(size, size, device=device).to(operand_dtype)
            b = torch.randn(size, size, device=device).to(operand_dtype)
            a @ b  # warm-up
            self.operands.append((a, b))

    def tflops(self) -> float:
        best = min(_timed(lambda a=a, b=b: a @ b, self.device) for a, b in self.operands)
        return 2 * self.size**3 / best / 1e12


def measure_bandwidth(
    device: str = "cpu", nbytes: int | None = None, iters: int = 5
) -> tuple[float, float]:
    """(read GB/s, copy GB/s), the best of `iters`: a sum reads a tensor much larger than the
    caches once, a copy reads and writes it."""
    probe = BandwidthProbe(device, nbytes)
    read_gbps = max(probe.read_gbps() for _ in range(iters))
    dst = torch.empty_like(probe.src)
    copy_s = _best_seconds(lambda: dst.copy_(probe.src), device, iters)
    return read_gbps, 2 * probe.nbytes / copy_s / 1e9


def measure_matmul_tflops(
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    size: int | None = None,
    iters: int = 5,
) -> float:
    """Dense `size x size` matmul throughput in TFLOP/s, the best of `iters`."""
    probe = MatmulProbe(device, dtype, size)
    return max(probe.tflops() for _ in range(iters))


def measure_hardware(device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Hardware:
    read_gbps, copy_gbps = measure_bandwidth(device)
    return Hardware(device, read_gbps, copy_gbps, measure_matmul_tflops(device, dtype))


# ---- the cost model ------------------------------------------------------------------------
def layer_matmul_params(mc: ModelConfig) -> int:
    """Weights of one decoder layer's matmuls: q, k, v, o and the gated MLP's gate, up, down."""
    q_size = mc.num_attention_heads * mc.head_dim
    kv_size = mc.num_key_value_heads * mc.head_dim
    attention = mc.hidden_size * (q_size + 2 * kv_size) + q_size * mc.hidden_size
    mlp = 3 * mc.hidden_size * mc.intermediate_size
    return attention + mlp


def lm_head_params(mc: ModelConfig) -> int:
    return mc.vocab_size * mc.hidden_size


def num_params(mc: ModelConfig) -> int:
    """Every matmul weight plus the embedding table (one copy when tied to the LM head)."""
    embeddings = lm_head_params(mc) * (1 if mc.tie_word_embeddings else 2)
    return mc.num_hidden_layers * layer_matmul_params(mc) + embeddings


def kv_bytes_per_token(mc: ModelConfig, kv_dtype: torch.dtype) -> int:
    """K and V of one token across all layers, in a cache of `kv_dtype` (a quantized one's
    scales included)."""
    return mc.num_hidden_layers * kv_format.bytes_per_token(
        mc.num_key_value_heads, mc.head_dim, kv_dtype
    )


def decode_weight_bytes(mc: ModelConfig, dtype: torch.dtype) -> int:
    """Weights one decode step reads: every layer's matmuls and the LM head."""
    return (mc.num_hidden_layers * layer_matmul_params(mc) + lm_head_params(mc)) * dtype.itemsize


def decode_step_bytes(
    mc: ModelConfig,
    dtype: torch.dtype,
    context_lens: Sequence[int],
    weight_bytes: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """Bytes one decode step moves: the weights once (`weight_bytes`, default
    `decode_weight_bytes`: all in `dtype`), plus each request's K/V over its context
    (`context_lens[i]` tokens attended, the new one included) in `kv_dtype` (default `dtype`)."""
    if weight_bytes is None:
        weight_bytes = decode_weight_bytes(mc, dtype)
    kv_bytes = kv_bytes_per_token(mc, dtype if kv_dtype is None else kv_dtype)
    return weight_bytes + sum(context_lens) * kv_bytes


def attention_flops(mc: ModelConfig, num_queries: int, context_len: int) -> int:
    """QK^T and PV for `num_queries` new tokens that end a context of `context_len` tokens, causal:
    query j (0-based) attends to context_len - num_queries + j + 1 keys; each (query, key) pair
    costs 2 * head_dim FLOPs per head for QK^T and as many for PV."""
    start = context_len - num_queries
    keys = num_queries * start + num_queries * (num_queries + 1) // 2
    return 4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * keys


def prefill_flops(mc: ModelConfig, num_tokens: int) -> int:
    """A prompt of `num_tokens`: 2 FLOPs per weight per token in the layers, the LM head for the
    last position only (the one that is sampled), and causal attention."""
    layers = 2 * mc.num_hidden_layers * layer_matmul_params(mc) * num_tokens
    return layers + 2 * lm_head_params(mc) + attention_flops(mc, num_tokens, num_tokens)


def decode_step_flops(mc: ModelConfig, context_lens: Sequence[int]) -> int:
    """One decode step of len(context_lens) requests, one token each."""
    per_token = 2 * (mc.num_hidden_layers * layer_matmul_params(mc) + lm_head_params(mc))
    attention = sum(attention_flops(mc, 1, n) for n in context_lens)
    return per_token * len(context_lens) + attention


def roofline_fraction(ideal_seconds: float, measured_seconds: float) -> float:
    """How close a measurement is to its floor: 1.0 = at the roofline."""
    return ideal_seconds / measured_seconds


def workload_floor_seconds(
    mc: ModelConfig,
    dtype: torch.dtype,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    hardware: Hardware,
) -> tuple[float, float]:
    """(prefill, decode) seconds no engine can beat on this hardware for an offline workload.

    Prefill: every prompt's FLOPs at the matmul peak (its first output token comes with it).
    Decode: every request decodes from the first step on, all at once (no batch-size limit), and
    each step costs max(bytes / bandwidth, FLOPs / matmul peak): weights once per step, each
    active request's K/V and its share of the FLOPs."""
    peak_flops = hardware.matmul_tflops * 1e12
    bandwidth = hardware.bandwidth_gbps * 1e9
    prefill = sum(prefill_flops(mc, n) for n in prompt_lens) / peak_flops
    decode = 0.0
    for step in range(max(output_lens, default=1) - 1):
        contexts = [
            p + step + 1 for p, o in zip(prompt_lens, output_lens, strict=True) if o > step + 1
        ]
        step_bytes = decode_step_bytes(mc, dtype, contexts)
        decode += max(step_bytes / bandwidth, decode_step_flops(mc, contexts) / peak_flops)
    return prefill, decode

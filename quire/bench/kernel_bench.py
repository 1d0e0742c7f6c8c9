"""Times the paged_decode kernel and reports its K/V read bandwidth against the GPU's peak.

    python -m quire.bench.kernel_bench [--batch-size 64] [--context-len 4096] [--peak-gbps 4800]

Decode attention is memory-bound: every step reads each request's whole K/V context once, so the
roofline is bytes of K/V over memory bandwidth (4800 GB/s on an H200, 3350 on an H100 SXM).
"""

from __future__ import annotations

import argparse

import torch

NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
WARMUP_ITERS = 10
TIMED_ITERS = 100


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=4096, help="tokens per request")
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM bandwidth, GB/s")
    return parser.parse_args()


def time_paged_decode(batch_size: int, context_len: int) -> tuple[float, int]:
    """Mean milliseconds per paged_decode call, and the bytes of K/V it reads."""
    from quire.kernels.paged_decode import paged_decode

    device = torch.device("cuda")
    blocks_per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = batch_size * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(cache_shape, dtype=DTYPE, device=device)
    # Scattered blocks, as after a while of serving.
    block_tables = torch.randperm(num_blocks, device=device).view(batch_size, blocks_per_seq)
    block_tables = block_tables.to(torch.int32)
    seq_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device=device)
    query = torch.randn(batch_size, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    def step() -> None:
        paged_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, context_len, out=out)

    for _ in range(WARMUP_ITERS):
        step()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_ITERS):
        step()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / TIMED_ITERS
    kv_bytes = 2 * batch_size * context_len * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    return ms, kv_bytes


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA device; none found, nothing to time.")
        return 0
    ms, kv_bytes = time_paged_decode(args.batch_size, args.context_len)
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    print(
        f"paged_decode batch={args.batch_size} context={args.context_len} "
        f"heads={NUM_HEADS}/{NUM_KV_HEADS} head_dim={HEAD_DIM} {str(DTYPE).removeprefix('torch.')} "
        f"on {torch.cuda.get_device_name()}"
    )
    print(
        f"{ms * 1e3:.1f} us/call, K/V read {kv_bytes / 1e9:.3f} GB, {gbps:.0f} GB/s = "
        f"{gbps / args.peak_gbps:.1%} of {args.peak_gbps:.0f} GB/s peak"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

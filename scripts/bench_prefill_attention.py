"""Times the C prefill-attention kernel in each loop it runs in on this CPU, in one process.

    .venv/bin/python scripts/bench_prefill_attention.py
    .venv/bin/python scripts/bench_prefill_attention.py --prompt-lens 512 2048 --heads 16 8 --head-dim 128

One layer's attention over one whole prompt (the keys of a paged bf16 cache, blocks shuffled),
the loops alternating ABAB: the AVX-512 BF16 one and, where the bf16 matmul can run on AMX
tiles, the AMX one (quire.kernels.cpu.prefill_attention_path). Prints the median time of each
and their ratio, and each loop's largest and mean error against SDPA in float32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import quire.kernels.cpu as cpu_kernels  # noqa: E402
from quire.kernels.cpu import gemv  # noqa: E402


def paged_prompt(length: int, heads: int, kv_heads: int, head_dim: int, block_size: int = 16):
    """q [length, heads, head_dim] and a shuffled paged K/V cache holding the prompt's keys."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-length // block_size)
    shape = (blocks + 4, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    table = torch.randperm(blocks + 4, generator=gen)[:blocks].int().view(1, -1)
    q = torch.randn(length, heads, head_dim, generator=gen).bfloat16()
    return q, k_cache, v_cache, table


def run(q, k_cache, v_cache, table, scale):
    out = torch.empty_like(q)
    n = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    cpu_kernels.prefill_attention(q, k_cache, v_cache, table, n, n[1:].clone(), scale, out)
    return out


def reference(q, k_cache, v_cache, table, scale):
    length, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    k = k_cache[table[0].long()].reshape(-1, kv_heads, head_dim)[:length].float()
    v = v_cache[table[0].long()].reshape(-1, kv_heads, head_dim)[:length].float()
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    heads, kv_heads = args.heads
    if not cpu_kernels.supports_prefill_attention(torch.bfloat16, heads, kv_heads, args.head_dim):
        sys.exit("the prefill-attention kernel does not run this shape on this CPU")
    orders = [False, True] if gemv.amx_available() else [False]
    settings = cpu_kernels.settings()
    scale = args.head_dim**-0.5
    print(f"{torch.get_num_threads()} threads, heads {heads}/{kv_heads}, head_dim {args.head_dim}")
    try:
        for length in args.prompt_lens:
            inputs = paged_prompt(length, heads, kv_heads, args.head_dim)
            expected = reference(*inputs, scale)
            times, errors = {}, {}
            for r in range(args.rounds):
                for amx in orders if r % 2 == 0 else orders[::-1]:
                    cpu_kernels.configure(
                        cpu_kernels.KernelSettings(enabled=True, gemv_fma=None, amx=amx)
                    )
                    path = cpu_kernels.prefill_attention_path()
                    start = time.perf_counter()
                    out = run(*inputs, scale)
                    times.setdefault(path, []).append(time.perf_counter() - start)
                    error = (out.float() - expected).abs()
                    errors[path] = (error.max().item(), error.mean().item())
            line = ", ".join(
                f"{path} {statistics.median(t) * 1e3:.2f} ms (error max {errors[path][0]:.4f} "
                f"mean {errors[path][1]:.5f})"
                for path, t in times.items()
            )
            if len(times) == 2:
                ratio = statistics.median(times["amx"]) / statistics.median(times["avx512-bf16"])
                line += f"; amx / avx512-bf16 {ratio:.3f}x the time"
            print(f"prompt {length}: {line}")
    finally:
        cpu_kernels.configure(settings)


if __name__ == "__main__":
    main()

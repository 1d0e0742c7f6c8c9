"""Times the C prefill-attention kernel in each loop it has on this CPU, in one process.

    .venv/bin/python scripts/bench_prefill_attention.py
    .venv/bin/python scripts/bench_prefill_attention.py --prompt-lens 512 2048 --heads 16 8 --head-dim 128

One layer's attention over one whole prompt (the keys of a paged bf16 cache, blocks shuffled),
the contenders alternating ABAB: this CPU's loop (quire.kernels.cpu.prefill_attention_path:
AVX-512 BF16, and AMX where the bf16 matmul runs on its tiles; or AVX2), the AVX2 loop of an
x86-64-v3 build where this CPU's own is another, and one paged decode per prompt token (what
runs where no prefill kernel does, `decoded_prefill`). Prints the median time of each, its
GFLOP/s (4 heads head_dim L (L + 1) / 2 multiply-adds counted twice) and its ratio to the first,
and each one's largest and mean error against SDPA in float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import quire.kernels.cpu as cpu_kernels  # noqa: E402
from quire import envs  # noqa: E402
from quire.attention.backend import AttentionMetadata  # noqa: E402
from quire.attention.torch_backend import decoded_prefill  # noqa: E402
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


def decoded(q, k_cache, v_cache, table, scale):
    """The prompt as one paged decode per token (decoded_prefill)."""
    length = q.shape[0]
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(length, dtype=torch.int64),
        query_start_loc=torch.tensor([0, length], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        block_tables=table,
        max_query_len=length,
        max_seq_len=length,
        query_start_loc_cpu=[0, length],
        seq_lens_cpu=[length],
        num_decodes=0,
        num_decode_tokens=0,
    )
    out = torch.empty_like(q)
    decoded_prefill(q, k_cache, v_cache, metadata, scale, out)
    return out


def avx2_library():
    """The kernels built for x86-64-v3 (AVX2 and FMA, no AVX-512)."""
    march = envs.QUIRE_CPU_MARCH
    envs.QUIRE_CPU_MARCH = "x86-64-v3"
    try:
        return cpu_kernels.build_library.__wrapped__(cpu_kernels._SOURCE_DIR)
    finally:
        envs.QUIRE_CPU_MARCH = march


def contenders(settings) -> list[tuple[str, object]]:
    """(name, setup) pairs: setup() makes that loop the one `run` reaches."""
    own = cpu_kernels.load_library

    def loop(amx: bool, library=None):
        def setup():
            cpu_kernels.configure(dataclasses.replace(settings, enabled=True, amx=amx))
            if library is not None:
                cpu_kernels.load_library = lambda: library
            return cpu_kernels.prefill_attention_path()

        return setup

    cpu_kernels.configure(dataclasses.replace(settings, enabled=True, amx=False))
    native = cpu_kernels.prefill_attention_path()
    out = [(native, loop(False))]
    if gemv.amx_available():
        out.append(("amx", loop(True)))
    if native != "avx2":
        library = avx2_library()
        if library is not None and library.prefill_attention_path() == 1:
            out.append(("avx2 (x86-64-v3 build)", loop(False, library)))
    cpu_kernels.load_library = own
    return out


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
    settings = cpu_kernels.settings()
    own = cpu_kernels.load_library
    scale = args.head_dim**-0.5
    print(f"{torch.get_num_threads()} threads, heads {heads}/{kv_heads}, head_dim {args.head_dim}")
    try:
        loops = contenders(settings)
        for length in args.prompt_lens:
            inputs = paged_prompt(length, heads, kv_heads, args.head_dim)
            expected = reference(*inputs, scale)
            flops = 4 * heads * args.head_dim * length * (length + 1) / 2
            sides = [*loops, ("one decode per token", None)]
            times, errors = {}, {}
            for r in range(args.rounds):
                for name, setup in sides if r % 2 == 0 else sides[::-1]:
                    cpu_kernels.load_library = own
                    cpu_kernels.configure(settings)
                    if setup is not None:
                        assert setup() == name.split(" ")[0]
                    start = time.perf_counter()
                    out = run(*inputs, scale) if setup is not None else decoded(*inputs, scale)
                    times.setdefault(name, []).append(time.perf_counter() - start)
                    error = (out.float() - expected).abs()
                    errors[name] = (error.max().item(), error.mean().item())
            first = statistics.median(times[sides[0][0]])
            print(f"prompt {length}:")
            for name, t in times.items():
                median = statistics.median(t)
                print(
                    f"  {name}: {median * 1e3:.2f} ms, {flops / median / 1e9:.1f} GFLOP/s, "
                    f"{median / first:.3f}x the time of {sides[0][0]} (error max "
                    f"{errors[name][0]:.4f} mean {errors[name][1]:.5f})"
                )
    finally:
        cpu_kernels.load_library = own
        cpu_kernels.configure(settings)


if __name__ == "__main__":
    main()

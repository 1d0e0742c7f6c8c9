"""Batch-1 decode tokens/s and prompt time on a GGUF file, in one process, interleaved: quire with
the file's blocks kept (`quantization="auto"`), quire with the same weights dequantized to bf16
(`quantization="none"`), and llama.cpp on the same file. Each round runs every side once, in
turn (the order reversed every other round); ratios are taken within a round, since a shared
host drifts within minutes.

    python scripts/bench_gguf_decode.py FILE --rounds 5 --prompt-len 128 --steps 64 \
        [--llama-site-packages DIR]   # where llama-cpp-python is installed (default: skip it)

quire: one request, greedy, `ignore_eos`: the time of a prompt of --prompt-len tokens with one
output token (prefill), and of the same with --steps more tokens; decode tokens/s = steps over
the difference. llama.cpp: its forward loop, as the issue asks (no sampler: llama-cpp-python's
Python sampler adds ~40%): the same prompt through `Llama.eval`, then one token at a time, with
as many threads as torch uses. Each side's prompt is new every round (no prefix-cache hit).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def quire_side(path: str, quantization: str, prompt_len: int, steps: int):
    from quire import LLM, SamplingParams

    llm = LLM(path, quantization=quantization, num_kv_blocks=64, enable_prefix_caching=False)

    def run(seed: int) -> tuple[float, float]:
        prompt = {"prompt_token_ids": [(97 * j + seed) % 10000 + 10 for j in range(prompt_len)]}
        times = []
        for max_tokens in (1, steps + 1):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        return steps / (times[1] - times[0]), times[0]

    return run


def llama_side(path: str, prompt_len: int, steps: int):
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    llm = Llama(
        path,
        n_ctx=prompt_len + steps + 8,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )

    def run(seed: int) -> tuple[float, float]:
        prompt = [(97 * j + seed) % 10000 + 10 for j in range(prompt_len)]
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(steps):
            llm.eval([(31 * i) % 10000 + 10])
        return steps / (time.perf_counter() - start), prefill

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--llama-site-packages", help="folder holding llama_cpp (default: skip)")
    args = parser.parse_args()
    sides = {
        "quire": quire_side(args.file, "auto", args.prompt_len, args.steps),
        "quire-bf16": quire_side(args.file, "none", args.prompt_len, args.steps),
    }
    if args.llama_site_packages:
        sys.path.append(args.llama_site_packages)
        sides["llama.cpp"] = llama_side(args.file, args.prompt_len, args.steps)
    for run in sides.values():
        run(-1)  # warm-up
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            results[name].append(sides[name](r))
        line = ", ".join(
            f"{name} {tps:.1f} tok/s / {prefill * 1e3:.0f} ms"
            for name, [*_, (tps, prefill)] in results.items()
        )
        print(f"round {r} (load {os.getloadavg()[0]:.1f}): {line}", flush=True)
    print(f"{os.path.basename(args.file)}, {args.prompt_len}-token prompt, {args.steps} steps:")
    for name, values in results.items():
        tps = statistics.median(v[0] for v in values)
        prefill = statistics.median(v[1] for v in values)
        print(f"  {name}: decode {tps:.1f} tok/s, prefill {prefill * 1e3:.0f} ms (medians)")
    for other in [name for name in sides if name != "quire"]:
        decode = sorted(q[0] / o[0] for q, o in zip(results["quire"], results[other]))
        prefill = sorted(o[1] / q[1] for q, o in zip(results["quire"], results[other]))
        print(
            f"  quire / {other}: decode {statistics.median(decode):.2f}x "
            f"({decode[0]:.2f}-{decode[-1]:.2f}), prompt speed {statistics.median(prefill):.2f}x "
            f"({prefill[0]:.2f}-{prefill[-1]:.2f}), per-round ratios"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

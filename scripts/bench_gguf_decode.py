"""Batch-1 decode tokens/s and prompt time on a GGUF file, in one process, interleaved: quire with
the file's blocks kept (`quantization="auto"`), quire with the same weights dequantized to bf16
(`quantization="none"`), and llama.cpp on the same file. Each round runs every side once, in
turn (the order reversed every other round); ratios are taken within a round, since a shared
host drifts within minutes.

    python scripts/bench_gguf_decode.py FILE --rounds 5 --prompt-len 128 --steps 64 \
        [--llama-site-packages DIR]   # where llama-cpp-python is installed (default: skip it)
        [--llama-also FILE ...]       # llama.cpp on other files of the same model, same rounds

`--llama-also` answers "quire on its file against llama.cpp's best file": llama.cpp runs each
listed file (say the model's Q8_0 and Q4_K_M) as a side of its own, `llama.cpp:<name>`.

quire: one request, greedy, `ignore_eos`, through the engine's steps: the first step is the
prompt's (prefill), each later one decodes a token, timed one by one. llama.cpp: its forward
loop, as the issue asks (no sampler: llama-cpp-python's Python sampler adds ~40%): the same prompt through `Llama.eval`, then one token at a time, with
as many threads as torch uses, each `eval` timed. Each side's prompt is new every round.
Reported per side: the median decode step and the fastest (on a host shared with other work,
the fastest step is the one least disturbed), the prompt's time, and per-round ratios.
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

    engine = LLM(
        path, quantization=quantization, num_kv_blocks=64, enable_prefix_caching=False
    ).engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)

    def run(seed: int) -> tuple[list[float], float]:
        prompt = [(97 * j + seed) % 10000 + 10 for j in range(prompt_len)]
        engine.add_request(f"r{seed}", prompt, params)
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times[1:], times[0]  # the first step is the prompt's

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

    def run(seed: int) -> tuple[list[float], float]:
        prompt = [(97 * j + seed) % 10000 + 10 for j in range(prompt_len)]
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        times = []
        for i in range(steps):
            start = time.perf_counter()
            llm.eval([(31 * i) % 10000 + 10])
            times.append(time.perf_counter() - start)
        return times, prefill

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--llama-site-packages", help="folder holding llama_cpp (default: skip)")
    parser.add_argument(
        "--llama-also", nargs="*", default=[], help="more files for llama.cpp (same model)"
    )
    args = parser.parse_args()
    if args.llama_also and not args.llama_site_packages:
        parser.error("--llama-also needs --llama-site-packages")
    sides = {
        "quire": quire_side(args.file, "auto", args.prompt_len, args.steps),
        "quire-bf16": quire_side(args.file, "none", args.prompt_len, args.steps),
    }
    if args.llama_site_packages:
        sys.path.append(args.llama_site_packages)
        sides["llama.cpp"] = llama_side(args.file, args.prompt_len, args.steps)
        for path in args.llama_also:
            name = f"llama.cpp:{os.path.basename(path)}"
            sides[name] = llama_side(path, args.prompt_len, args.steps)
    for run in sides.values():
        run(-1)  # warm-up
    # per side and round: (median decode step, fastest decode step, prompt seconds)
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            steps, prefill = sides[name](r)
            results[name].append((statistics.median(steps), min(steps), prefill))
        line = ", ".join(
            f"{name} {1 / med:.1f} tok/s (best step {1 / best:.1f}) / {prefill * 1e3:.0f} ms"
            for name, [*_, (med, best, prefill)] in results.items()
        )
        print(f"round {r} (load {os.getloadavg()[0]:.1f}): {line}", flush=True)
    print(f"{os.path.basename(args.file)}, {args.prompt_len}-token prompt, {args.steps} steps:")
    for name, values in results.items():
        med = statistics.median(v[0] for v in values)
        best = min(v[1] for v in values)
        prefill = statistics.median(v[2] for v in values)
        print(
            f"  {name}: decode {1 / med:.1f} tok/s (median step; fastest step {1 / best:.1f}), "
            f"prefill {prefill * 1e3:.0f} ms (median)"
        )
    for other in [name for name in sides if name != "quire"]:
        pairs = list(zip(results["quire"], results[other]))
        ratios = {
            "decode (median step)": sorted(o[0] / q[0] for q, o in pairs),
            "decode (fastest step)": sorted(o[1] / q[1] for q, o in pairs),
            "prompt": sorted(o[2] / q[2] for q, o in pairs),
        }
        text = ", ".join(
            f"{what} {statistics.median(v):.2f}x ({v[0]:.2f}-{v[-1]:.2f})"
            for what, v in ratios.items()
        )
        print(f"  quire / {other}, speed, per-round ratios: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

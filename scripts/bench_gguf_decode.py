"""Batch-1 decode tokens/s on GGUF files: quire with the file's blocks kept (`--quantization auto`),
quire with the same weights dequantized to bf16 (`--quantization none`), and llama.cpp on the same
file, in rounds that alternate the three (the host drifts within minutes: compare within a round).

    python scripts/bench_gguf_decode.py FILE [FILE ...] --rounds 3 --prompt-len 128 --steps 64 \
        [--llama-python PATH/TO/python]   # an interpreter with llama-cpp-python installed

quire's side is `quire bench latency --batch-size 1` (its JSON's batch-1 tokens/s: the mean over
the timed decode steps, after a prompt of --prompt-len tokens). llama.cpp's is its forward loop:
the same prompt evaluated, then `Llama.eval` of one token at a time, timed over --steps tokens
(no sampler: llama-cpp-python's Python sampler adds ~40%), with as many threads as quire.
Each run is a fresh process. Prints one line per run, then per file the median tokens/s and
the median (and range) of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

LLAMA_LOOP = r"""
import sys, time
from llama_cpp import Llama
path, prompt_len, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(path, n_ctx=prompt_len + steps + 8, n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False)
prompt = [(97 * j) % 10000 + 10 for j in range(prompt_len)]
llm.eval(prompt)
llm.eval([11])  # warm-up decode
start = time.perf_counter()
for i in range(steps):
    llm.eval([(31 * i) % 10000 + 10])
print(steps / (time.perf_counter() - start))
"""


def quire_tokens_per_s(path: str, quantization: str, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "latency.json")
        command = [
            sys.executable, "-m", "quire.entrypoints.cli", "bench", "latency",
            "--model", path, "--quantization", quantization, "--batch-size", "1",
            "--prompt-len", str(args.prompt_len), "--decode-steps", str(args.steps),
            "--num-iters", "1", "--num-kv-blocks", "64", "--output-json", out,
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, text=True)
        with open(out) as f:
            return json.load(f)["decode"][0]["tokens_per_s"]


def llama_tokens_per_s(path: str, args: argparse.Namespace) -> float:
    command = [args.llama_python, "-c", LLAMA_LOOP, path, str(args.prompt_len), str(args.steps)]
    result = subprocess.run(
        [*command, str(args.threads)], check=True, capture_output=True, text=True
    )
    return float(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--llama-python", help="python with llama-cpp-python (default: skip)")
    args = parser.parse_args()
    runs: dict[tuple[str, str], dict[int, float]] = {}
    for r in range(args.rounds):
        for path in args.files:
            sides = [
                ("quire", lambda p=path: quire_tokens_per_s(p, "auto", args)),
                ("quire-bf16", lambda p=path: quire_tokens_per_s(p, "none", args)),
            ]
            if args.llama_python:
                sides.append(("llama.cpp", lambda p=path: llama_tokens_per_s(p, args)))
            if r % 2:
                sides.reverse()
            for name, run in sides:
                try:
                    value = run()
                except subprocess.CalledProcessError as error:
                    print(f"{name} {path}: failed\n{error.stderr[-2000:]}", flush=True)
                    continue
                runs.setdefault((path, name), {})[r] = value
                load = os.getloadavg()[0]
                print(f"round {r} {os.path.basename(path)} {name}: {value:.1f} tok/s (load {load:.1f})", flush=True)  # fmt: skip
    for path in args.files:
        by_name = {name: values for (p, name), values in runs.items() if p == path}
        medians = {name: statistics.median(v.values()) for name, v in by_name.items()}
        line = ", ".join(f"{name} {tps:.1f}" for name, tps in medians.items())
        ratios = []
        for other in ("quire-bf16", "llama.cpp"):
            # per round, then the median and the spread: ratios within one round
            mine, theirs = by_name.get("quire", {}), by_name.get(other, {})
            each = sorted(mine[r] / theirs[r] for r in mine.keys() & theirs.keys())
            if each:
                spread = f"{each[0]:.2f}-{each[-1]:.2f}"
                ratios.append(f"quire / {other} {statistics.median(each):.2f}x ({spread})")
        print(f"{os.path.basename(path)}: median tok/s {line}; {'; '.join(ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

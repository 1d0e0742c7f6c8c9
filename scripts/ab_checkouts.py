"""Times a `quire bench` command in two checkouts, alternating them ABBA, one process per run.

    git worktree add /tmp/quire-before <commit>
    .venv/bin/python scripts/ab_checkouts.py --before /tmp/quire-before --rounds 6 -- \\
        latency --prompt-len 600 --batch-size 32 --decode-steps 32 --num-iters 1
    .venv/bin/python scripts/ab_checkouts.py --before /tmp/quire-before --rounds 6 -- \\
        throughput --workload w1 --num-requests 32
    .venv/bin/python scripts/ab_checkouts.py --before /tmp/quire-before --rounds 6 -- \\
        overhead --batch-sizes 1 64 256 512

Each run is `python -m quire.entrypoints.cli bench ...` with the checkout as its working
directory, so it imports that checkout's `quire` (the interpreter and its packages are shared).
Rounds alternate the order (A B, then B A, ...) so a machine that drifts within minutes (these
hosts' memory bandwidth moves 35-75 GB/s) weighs on both sides alike. Per round it prints each
side's numbers and the after/before ratio of the time per step or token; at the end the median
ratio per metric. A ratio below 1 means the `--after` checkout (default: this one) is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_THIS_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def metrics(kind: str, report: dict) -> dict[str, float]:
    """Seconds per unit of work (lower is better) from a bench JSON report."""
    if kind == "latency":
        out = {"prefill_s": report["prefill"]["seconds"]}
        for d in report["decode"]:
            out[f"decode_b{d['batch_size']}_step_s"] = d["median_step_seconds"]
        return out
    if kind == "throughput":
        result = report["results"][0]
        return {"s_per_output_token": 1.0 / result["output_tokens_per_s"]}
    if kind == "overhead":
        return {
            f"b{r['batch_size']}_{r['kind']}_step_s": r["step_us"] / 1e6 for r in report["results"]
        }
    raise SystemExit(f"ab_checkouts: no metrics for `quire bench {kind}`")


def run(checkout: str, bench_args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        command = [sys.executable, "-m", "quire.entrypoints.cli", "bench", *bench_args]
        command += ["--output-json", path]
        subprocess.run(command, cwd=checkout, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return metrics(bench_args[0], json.load(f))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the A checkout")
    p.add_argument("--after", default=_THIS_TREE, help="the B checkout (default: this one)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the `quire bench` arguments")
    args = p.parse_args(argv)
    bench_args = [a for a in args.bench if a != "--"]
    ratios: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
        results = {side: run(getattr(args, side), bench_args) for side in order}
        line = []
        for name, before in results["before"].items():
            ratio = results["after"][name] / before
            ratios.setdefault(name, []).append(ratio)
            line.append(f"{name}: {before:.5f} -> {results['after'][name]:.5f} ({ratio:.3f}x)")
        print(f"round {round_index + 1} ({'/'.join(order)}): " + "; ".join(line), flush=True)
    for name, values in ratios.items():
        print(f"median after/before {name}: {statistics.median(values):.3f}x over {len(values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

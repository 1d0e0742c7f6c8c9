"""Serves with two sets of `quire serve` flags in turn, ABBA, and loads each with `quire bench serve`.

    .venv/bin/python scripts/ab_serve.py --a= --b=--engine-core-process --rounds 6 -- \\
        --num-prompts 32 --input-len 100 400 --output-len 64 128 --request-rate inf

Each run starts a fresh server on a free port (the default model unless the flags name one),
waits for /ready, runs the bench once and stops the server. Rounds alternate the order (A B,
then B A) so a drifting machine weighs on both sides alike. Per round it prints each side's
output tokens/s, mean TTFT and mean TPOT and the B/A ratio; at the end the median ratios.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")
_CLI = [sys.executable, "-m", "quire.entrypoints.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"ab_serve: the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"ab_serve: {url} not ready after {timeout:.0f} s")


def run(serve_flags: str, bench_args: list[str]) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [*_CLI, "serve", "--port", str(port), *shlex.split(serve_flags)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/report.json"
            command = [*_CLI, "bench", "serve", "--base-url", url, *bench_args]
            subprocess.run([*command, "--output-json", path], check=True, stdout=subprocess.DEVNULL)
            with open(path) as f:
                report = json.load(f)["runs"][0]
        return {name: report[name] for name in METRICS}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="", help="`quire serve` flags of side A")
    p.add_argument("--b", required=True, help="`quire serve` flags of side B")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `quire bench serve` flags")
    args = p.parse_args(argv)
    bench_args = [a for a in args.bench if a != "--"]
    ratios: dict[str, list[float]] = {name: [] for name in METRICS}
    for round_index in range(args.rounds):
        order = ["a", "b"] if round_index % 2 == 0 else ["b", "a"]
        results = {side: run(getattr(args, side), bench_args) for side in order}
        line = []
        for name in METRICS:
            ratio = results["b"][name] / results["a"][name]
            ratios[name].append(ratio)
            line.append(
                f"{name}: {results['a'][name]:.2f} -> {results['b'][name]:.2f} ({ratio:.3f}x)"
            )
        print(f"round {round_index + 1} ({'/'.join(order)}): " + "; ".join(line), flush=True)
    for name, values in ratios.items():
        spread = f"{min(values):.3f}-{max(values):.3f}"
        print(f"median B/A {name}: {statistics.median(values):.3f}x ({spread}) over {len(values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

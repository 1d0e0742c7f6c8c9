"""Disaggregation against collocation, end to end: two instances, three routers, Poisson rates.

    python scripts/bench_pd.py [--rates 0.25 0.5 1] [--num-prompts 16] [--out-dir bench-pd]

Starts two `quire serve` instances of the default model with `kv_role` kv_both (each pinned to
one core: `taskset -c 0` and `-c 1`, one thread; 1024 KV blocks, 377 MiB, not the default
4 GiB: the host has 23 GiB for everyone), measures them with `quire bench pd-profile`,
and puts three routers in front of the same two instances:

  least_loaded    both instances collocated
  disaggregated   instance 0 prefills, instance 1 decodes
  cost_model      every option: either instance collocated, or either one prefilling for the other

Then, for each rate, the `quire bench serve` client (its functions, in this process) sends the
same workload (same prompt and output lengths, Poisson arrivals of the same seed; the token ids
differ per router so that no run hits a prefix another one cached) to each router in turn, the
order rotating from rate to rate. Per run: TTFT, ITL (and TPOT) p50/p99, goodput under the
--goodput SLOs, the KV bytes and pull seconds the instances counted, and for cost_model its
choices and its mean predicted TTFT/ITL against the measured ones (the client's mean TTFT and
TPOT). Writes results.json, results.md and the plots into --out-dir. The routers and the client
are not pinned: they share the two cores with the instances.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from quire.bench import serve
from quire.bench.pd_profile import kv_transfer_counters, loadavg

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("least_loaded", "disaggregated", "cost_model")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quire(*args: str, core: int | None = None, log: Path) -> subprocess.Popen:
    env = os.environ | {
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "quire.entrypoints.cli", *args]
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
    with open(log, "w") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}: see its log")
        try:
            if httpx.get(f"{url}/load", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not come up in {timeout_s:.0f} s")


def kv_counters(urls: list[str]) -> tuple[float, float]:
    """(bytes, seconds) of KV pulled, summed over the instances."""
    counters = [kv_transfer_counters(httpx.get(f"{url}/metrics", timeout=10).text) for url in urls]
    return sum(c[0] for c in counters), sum(c[1] for c in counters)


def cost_model_sums(router: str) -> dict[str, dict[str, float]]:
    """The cost model's accuracy report as sums, so that runs can be told apart by difference."""
    state = httpx.get(f"{router}/load", timeout=10).json().get("policy_state", {})
    sums = {}
    for path, a in state.get("accuracy", {}).items():
        sums[path] = {
            "requests": a["requests"],
            "predicted_ttft_s": a["mean_predicted_ttft_s"] * a["requests"],
            "observed_ttft_s": a["mean_observed_ttft_s"] * a["requests"],
            "predicted_itl_s": a["mean_predicted_itl_s"] * a["requests"],
            "observed_itl_s": a["mean_observed_itl_s"] * a["requests"],
        }
    sums["choices"] = dict(state.get("choices", {}))
    return sums


def workload(args: argparse.Namespace, rate_index: int, config_index: int) -> list:
    """Token-id prompts: lengths and outputs drawn from the rate's seed (the same for every
    router), ids from the router's too (no prefix shared across runs)."""
    lengths = random.Random(args.seed + rate_index)
    ids = random.Random(1_000_003 * (rate_index + 1) + config_index)
    requests = []
    for _ in range(args.num_prompts):
        length = lengths.randint(*args.input_len)
        output = lengths.randint(*args.output_len)
        prompt = [ids.randrange(100, 30000) for _ in range(length)]
        requests.append(serve.ServeRequest(prompt, length, output))
    return requests


def run_one(args, name: str, router: str, instances: list[str], rate: float, requests) -> dict:
    slos = serve.parse_goodput(args.goodput)
    model = asyncio.run(serve.served_model(router, None))
    kv_before = kv_counters(instances)
    model_before = cost_model_sums(router) if name == "cost_model" else None
    results, duration = asyncio.run(
        serve.run_benchmark(router, model, requests, rate, seed=args.seed, show_progress=False)
    )
    kv_after = kv_counters(instances)
    metrics = serve.compute_metrics(results, duration, slos)
    run = {"config": name, "request_rate": rate, "loadavg": loadavg()} | metrics
    run["kv_bytes"] = kv_after[0] - kv_before[0]
    run["kv_transfer_s"] = kv_after[1] - kv_before[1]
    run["errors"] = sorted({r.error for r in results if not r.success})[:3]
    if model_before is not None:
        after = cost_model_sums(router)
        run["choices"] = {
            path: count - model_before["choices"].get(path, 0)
            for path, count in after["choices"].items()
        }
        sums = {"requests": 0.0, "predicted_ttft_s": 0.0, "predicted_itl_s": 0.0}
        for path, a in after.items():
            if path == "choices":
                continue
            for key in sums:
                sums[key] += a[key] - model_before.get(path, {}).get(key, 0.0)
        n = max(sums["requests"], 1)
        run["predicted_mean_ttft_ms"] = sums["predicted_ttft_s"] / n * 1e3
        run["predicted_mean_itl_ms"] = sums["predicted_itl_s"] / n * 1e3
        run["ttft_error"] = run["predicted_mean_ttft_ms"] / run["mean_ttft_ms"] - 1
        run["itl_error"] = run["predicted_mean_itl_ms"] / run["mean_tpot_ms"] - 1
    return run


def table(runs: list[dict], slos: str) -> str:
    lines = [
        f"goodput SLO: {slos}",
        "",
        "| rate | config | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT mean ms | goodput req/s "
        "| KV MiB | pull s | cost model: choices, predicted / measured TTFT, ITL | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        model = ""
        if r["config"] == "cost_model":
            model = (
                f"{r['choices']}; {r['predicted_mean_ttft_ms']:.0f} / {r['mean_ttft_ms']:.0f} "
                f"({r['ttft_error']:+.0%}), {r['predicted_mean_itl_ms']:.0f} / "
                f"{r['mean_tpot_ms']:.0f} ({r['itl_error']:+.0%})"
            )
        lines.append(
            f"| {r['request_rate']:g} | {r['config']} | {r['median_ttft_ms']:.0f} / "
            f"{r['p99_ttft_ms']:.0f} | {r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | "
            f"{r['mean_tpot_ms']:.0f} | {r['request_goodput']:.3f} | "
            f"{r['kv_bytes'] / 2**20:.0f} | {r['kv_transfer_s']:.2f} | {model} | {r['loadavg']} |"
        )
    lines.append("")
    for rate in sorted({r["request_rate"] for r in runs}):
        at = {r["config"]: r for r in runs if r["request_rate"] == rate}
        best = max(at[c]["request_goodput"] for c in CONFIGS if c != "cost_model")
        ok = at["cost_model"]["request_goodput"] >= best * 0.95
        lines.append(
            f"rate {rate:g}: cost_model goodput {at['cost_model']['request_goodput']:.3f} vs "
            f"best fixed {best:.3f}: {'within' if ok else 'NOT within'} 5%"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("p99_ttft_ms", "TTFT p99 (ms)"),
        ("median_itl_ms", "ITL p50 (ms)"),
        ("p99_itl_ms", "ITL p99 (ms)"),
        ("request_goodput", "goodput (req/s)"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, (key, title) in zip(axes, panels):
        for config in CONFIGS:
            mine = sorted(
                (r for r in runs if r["config"] == config), key=lambda r: r["request_rate"]
            )
            ax.plot(
                [r["request_rate"] for r in mine], [r[key] for r in mine], marker="o", label=config
            )
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 384])
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    parser.add_argument("--goodput", nargs="+", default=["ttft:4000", "tpot:80"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench-pd")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started: list[subprocess.Popen] = []
    try:
        kv_both = json.dumps({"kv_connector": "quire", "kv_role": "kv_both"})
        instances = []
        for core in (0, 1):
            port = free_port()
            started.append(
                quire(
                    "serve",
                    "--kv-transfer-config",
                    kv_both,
                    "--port",
                    str(port),
                    "--num-kv-blocks",
                    "1024",
                    core=core,
                    log=out / f"instance{core}.log",
                )
            )
            instances.append(f"http://127.0.0.1:{port}")
        for url, process in zip(instances, started):
            wait_ready(url, process)
        a, b = instances
        print(f"instances up: {instances} (load {loadavg()})", file=sys.stderr)
        profile = out / "profile.json"
        subprocess.run(
            [
                sys.executable, "-m", "quire.entrypoints.cli", "bench", "pd-profile",
                "--prefill", a, "--decode", b, "--collocated", a, "--output", str(profile),
                "--prompt-lens", "64", "256", "512", "--contexts", "32", "256",
                "--batch-sizes", "1", "2", "4", "8", "--decode-tokens", "16",
                "--gamma-prompt-len", "256", "--rounds", "2",
            ],
            env=os.environ | {"PYTHONPATH": str(ROOT)},
            check=True,
        )  # fmt: skip
        router_args = {
            "least_loaded": ["--collocated", a, b, "--policy", "least_loaded"],
            "disaggregated": ["--prefill", a, "--decode", b, "--policy", "round_robin"],
            "cost_model": [
                "--prefill", a, b, "--decode", a, b, "--collocated", a, b,
                "--policy", "cost_model", "--cost-profile", str(profile),
            ],
        }  # fmt: skip
        routers = {}
        for name in CONFIGS:
            port = free_port()
            process = quire(
                "router", *router_args[name], "--port", str(port), log=out / f"router-{name}.log"
            )
            started.append(process)
            routers[name] = f"http://127.0.0.1:{port}"
            wait_ready(routers[name], process, timeout_s=120)
        runs = []
        for i, rate in enumerate(args.rates):
            order = CONFIGS[i % 3 :] + CONFIGS[: i % 3]
            for name in order:
                requests = workload(args, i, CONFIGS.index(name))
                run = run_one(args, name, routers[name], instances, rate, requests)
                print(json.dumps({k: run[k] for k in ("config", "request_rate", "completed")}))
                runs.append(run)
        runs.sort(key=lambda r: (r["request_rate"], CONFIGS.index(r["config"])))
        (out / "results.json").write_text(
            json.dumps(
                {"args": vars(args), "profile": json.loads(profile.read_text()), "runs": runs},
                indent=2,
                default=lambda v: "inf" if isinstance(v, float) and math.isinf(v) else str(v),
            )
        )
        report = table(runs, " ".join(args.goodput))
        (out / "results.md").write_text(report + "\n")
        print(report)
        plot(runs, out / "pd.png")
        for name in CONFIGS:
            serve.plot_runs(
                [r for r in runs if r["config"] == name], str(out / f"latency-{name}.png")
            )
    finally:
        for process in started:
            process.send_signal(signal.SIGINT)
        for process in started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()

"""`quire bench startup`: how long a model takes to be ready, each run in a fresh process.

Three measurements per iteration, on the default model unless --model says otherwise:
- `LLM()`, timed phase by phase where the engine runs them: import quire, the engine args, the
  model config (with the GGUF header read), the tokenizer, the weights (loaded, then moved to
  huge pages), the KV pool, the rest of construction; then the first request (8 tokens);
- `quire generate` of 8 tokens, wall time of the whole command;
- `quire serve`, from the process start until /health answers 200.

`--baseline DIR` runs the same in another checkout (`git worktree add /tmp/quire-main main`),
alternating with this one in each iteration, and prints this checkout's time over the
baseline's: on a shared machine, compare ratios taken in one run rather than absolute times.
The baseline's phases are not timed (its functions may differ); its totals are.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

_THIS_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MAX_TOKENS = 8
_READY_TIMEOUT_S = 300.0

# (key, label) in the order printed; the phases are parts of llm_s
_PHASES = [
    ("engine_args_s", "engine args -> config"),
    ("model_config_s", "model config"),
    ("gguf_header_s", "  of which the GGUF header"),
    ("tokenizer_s", "tokenizer"),
    ("weights_s", "weights"),
    ("huge_pages_s", "weights to huge pages"),
    ("kv_pool_s", "KV pool"),
    ("other_s", "the rest"),
]
_TOTALS = [
    ("import_s", "import quire"),
    ("llm_s", "LLM()"),
    ("first_request_s", f"first request ({_MAX_TOKENS} tokens)"),
    ("generate_s", f"quire generate ({_MAX_TOKENS} tokens), wall"),
    ("serve_s", "quire serve until /health"),
]

# The child that builds LLM(): with phases, the engine's steps are wrapped in timers first.
_LLM_CHILD = """
import json, sys, time
start = time.perf_counter()
import quire
from quire import LLM, SamplingParams
imported = time.perf_counter()
phases = {}
if sys.argv[2] == "phases":
    from quire.bench.startup import time_phases
    time_phases(phases)
llm = LLM(**json.loads(sys.argv[1]))
built = time.perf_counter()
llm.generate(["Hello"], SamplingParams(max_tokens=int(sys.argv[3]), ignore_eos=True))
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "llm_s": built - imported,
                  "first_request_s": done - built, **phases}))
"""


def time_phases(phases: dict[str, float]) -> None:
    """Wraps the steps LLM() runs so that each adds its seconds to `phases` (in the child)."""
    from quire import config
    from quire.engine import llm_engine
    from quire.engine_args import EngineArgs
    from quire.model import gguf_loader
    from quire.worker import host_memory, kv_cache, model_forward

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - start

        return wrapper

    EngineArgs.create_engine_config = timed("engine_args_s", EngineArgs.create_engine_config)
    config.load_model_config = timed("model_config_s", config.load_model_config)
    gguf_loader.read_gguf = timed("gguf_header_s", gguf_loader.read_gguf)
    llm_engine.load_tokenizer = timed("tokenizer_s", llm_engine.load_tokenizer)
    model_forward.load_model = timed("weights_s", model_forward.load_model)
    host_memory.move_to_huge_pages = timed("huge_pages_s", host_memory.move_to_huge_pages)
    kv_cache.KVCache.allocate = classmethod(timed("kv_pool_s", kv_cache.KVCache.allocate.__func__))


def _run_llm(checkout: str, model: str | None, phases: bool) -> dict[str, float]:
    kwargs = {} if model is None else {"model": model}
    argv = [sys.executable, "-c", _LLM_CHILD, json.dumps(kwargs), "phases" if phases else "-"]
    argv.append(str(_MAX_TOKENS))
    done = subprocess.run(argv, cwd=checkout, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"LLM() in {checkout} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if phases:
        parts = ("engine_args_s", "model_config_s", "tokenizer_s", "weights_s")
        parts += ("huge_pages_s", "kv_pool_s")
        result["other_s"] = result["llm_s"] - sum(result.get(key, 0.0) for key in parts)
    return result


_CLI = [sys.executable, "-m", "quire.entrypoints.cli"]


def _run_generate(checkout: str, model: str | None) -> float:
    argv = [*_CLI, "generate", "Hello", "--max-tokens", str(_MAX_TOKENS)]
    argv += [] if model is None else ["--model", model]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=checkout, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"quire generate in {checkout} failed:\n{done.stderr[-2000:]}")
    return elapsed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_serve(checkout: str, model: str | None) -> float:
    port = _free_port()
    argv = [*_CLI, "serve", *([] if model is None else [model]), "--port", str(port)]
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        server = subprocess.Popen(argv, cwd=checkout, stdout=subprocess.DEVNULL, stderr=log)
        try:
            while time.perf_counter() - start < _READY_TIMEOUT_S and server.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                        return time.perf_counter() - start
                except OSError:
                    time.sleep(0.02)
            log.seek(0)
            tail = log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"quire serve in {checkout} never answered /health:\n{tail}")
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def measure(checkout: str, model: str | None, phases: bool) -> dict[str, float]:
    """One iteration's numbers for one checkout, each from a fresh process."""
    result = _run_llm(checkout, model, phases)
    result["generate_s"] = _run_generate(checkout, model)
    result["serve_s"] = _run_serve(checkout, model)
    return result


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def report(this: dict[str, float], baseline: dict[str, float] | None) -> str:
    header = f"{'':44s}{'s':>8s}"
    if baseline is not None:
        header += f"{'baseline s':>12s}{'ratio':>8s}"
    lines = [header]

    def row(key: str, label: str) -> None:
        if key not in this:
            return
        line = f"{label:44s}{this[key]:8.2f}"
        if baseline is not None and key in baseline:
            line += f"{baseline[key]:12.2f}{this[key] / baseline[key]:8.2f}"
        lines.append(line)

    for key, label in _TOTALS:
        row(key, label)
        if key == "llm_s":
            for phase, phase_label in _PHASES:
                row(phase, f"  {phase_label}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "startup",
        help="time to ready: LLM() by phase, quire generate, quire serve until /health",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="(default: the default model)")
    p.add_argument("--num-iters", type=int, default=3, help="runs of each; medians reported")
    p.add_argument(
        "--baseline", default=None, metavar="DIR", help="another checkout to compare with"
    )
    p.add_argument("--output-json", default="quire-bench-startup.json")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.num_iters < 1:
        raise ValueError("--num-iters must be >= 1.")
    if args.baseline is not None and not os.path.isdir(os.path.join(args.baseline, "quire")):
        raise ValueError(f"--baseline {args.baseline!r} is not a quire checkout.")
    model = None if args.model is None else os.path.abspath(args.model)
    runs: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    for i in range(args.num_iters):
        sides = ["this"] if args.baseline is None else ["this", "baseline"][:: 1 - 2 * (i % 2)]
        for side in sides:
            checkout = _THIS_CHECKOUT if side == "this" else args.baseline
            runs[side].append(measure(checkout, model, phases=side == "this"))
    this = _medians(runs["this"])
    baseline = _medians(runs["baseline"]) if runs["baseline"] else None
    print(f"startup of {args.model or 'the default model'}, median of {args.num_iters}:")
    print(report(this, baseline))
    result = {
        "model": args.model,
        "num_iters": args.num_iters,
        "this": this,
        "baseline": baseline,
        "ratios": None if baseline is None else {k: this[k] / baseline[k] for k in baseline},
        "runs": runs,
    }
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    return 0

"""`quire bench serve`: online serving benchmark against any OpenAI-compatible server, like
`vllm bench serve`.

Requests (random-token prompts, greedy, `ignore_eos`) stream from `/v1/completions`; they arrive
as a Poisson process at `--request-rate` requests/s (inf: all at once), capped at
`--max-concurrency` in flight. Per request:
  TTFT  time from sending to the first non-empty text chunk
  ITL   the gaps between consecutive text chunks
  TPOT  (E2E - TTFT) / (output tokens - 1), output tokens from the server's usage report
        (`stream_options.include_usage`) when it sends one, else the number of text chunks
  E2E   time from sending to the end of the stream
Goodput counts the requests that meet every SLO of `--goodput ttft:MS tpot:MS e2el:MS`.
Each rate gets its own prompts (seed + i for the i-th rate), so no run is served from the prefix
cache that an earlier one filled. `--models a,b,base` sends request i with the i-th of those
`model` names round-robin (LoRA adapters of a multi-LoRA server; `base` is --model, or the
server's first model). `--lora-ids 0,1,base` does the same for llama.cpp's server, which picks
adapters by each request's `lora` field (`[{"id": 0, "scale": 1.0}]`; start it with
`--lora-init-without-apply` so that an adapter not named is off).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

if TYPE_CHECKING:
    import httpx

_SLO_METRICS = ("ttft", "tpot", "e2el")
_LATENCY_METRICS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
_PERCENTILES = (50, 90, 99)
_MAX_TOKEN_ID = 10000


@dataclass
class ServeRequest:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first; 0 for a single-token output (as vLLM)."""
        if self.output_tokens < 2:
            return 0.0
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


# ---- the workload ----------------------------------------------------------------------------
def make_requests(
    tokenizer, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> list[ServeRequest]:
    """Random token ids decoded to text (special tokens skipped); the prompt length is the text's
    token count, which the server's usage report replaces when it sends one."""
    rng = random.Random(seed)
    max_id = min(_MAX_TOKEN_ID, len(tokenizer)) - 1
    requests = []
    for _ in range(num_prompts):
        ids = [rng.randint(0, max_id) for _ in range(rng.randint(*input_len))]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        requests.append(ServeRequest(text, prompt_len, rng.randint(*output_len)))
    return requests


# ---- the client ------------------------------------------------------------------------------
# httpx is imported by the functions that send requests, not at the top: `quire` builds every
# bench's parser when it starts, and httpx (which loads rich) would slow the start of every
# command, `quire serve` and `quire generate` included.
def completions_url(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1") + "/v1/completions"


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    request: ServeRequest,
    lora_id: int | None = None,
) -> RequestResult:
    """One streamed completion, timed chunk by chunk; `lora_id` names llama.cpp's adapter."""
    import httpx  # not at the top: see "the client"

    payload: dict = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if lora_id is not None:
        payload["lora"] = [{"id": lora_id, "scale": 1.0}]
    chunk_times: list[float] = []
    usage: dict | None = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {response.status_code}: {body[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"])[:200])
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    chunk_times.append(now)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if not chunk_times:
        return RequestResult(False, error="the stream had no text")
    output_tokens = (usage or {}).get("completion_tokens") or len(chunk_times)
    return RequestResult(
        success=True,
        prompt_len=(usage or {}).get("prompt_tokens") or request.prompt_len,
        output_tokens=output_tokens,
        ttft=chunk_times[0] - start,
        e2el=end - start,
        itl=[b - a for a, b in zip(chunk_times, chunk_times[1:])],
    )


async def _arrivals(num: int, request_rate: float, rng: random.Random) -> AsyncIterator[int]:
    """Request indices, spaced by exponential gaps of mean 1/rate (a Poisson process)."""
    for i in range(num):
        yield i
        if not math.isinf(request_rate) and i < num - 1:
            await asyncio.sleep(rng.expovariate(request_rate))


async def run_benchmark(
    base_url: str,
    model: str | Sequence[str],
    requests: Sequence[ServeRequest],
    request_rate: float,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    seed: int = 0,
    show_progress: bool = True,
    lora_ids: Sequence[int | None] = (None,),
) -> tuple[list[RequestResult], float]:
    """Sends every request on its arrival time, request i with `model`, or with model[i % len]
    for several names, and llama.cpp's adapter lora_ids[i % len] (None: no `lora` field);
    returns the results (in request order) and the wall time from the first send to the last
    response."""
    import httpx  # not at the top: see "the client"

    models = [model] if isinstance(model, str) else list(model)
    url = completions_url(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(
        total=len(requests), desc=f"rate {request_rate:g}", unit="req", disable=not show_progress
    )
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:

        async def send(request: ServeRequest, model: str, lora_id: int | None) -> RequestResult:
            if semaphore is None:
                result = await send_request(client, url, model, request, lora_id)
            else:
                async with semaphore:
                    result = await send_request(client, url, model, request, lora_id)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), request_rate, random.Random(seed)):
            model_i, lora_i = models[i % len(models)], lora_ids[i % len(lora_ids)]
            tasks.append(asyncio.create_task(send(requests[i], model_i, lora_i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def served_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models."""
    import httpx  # not at the top: see "the client"

    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30, headers=headers) as client:
            response = await client.get(url)
            response.raise_for_status()
            models = response.json().get("data") or []
    except httpx.HTTPError as e:
        raise ValueError(f"Cannot list the models at {url} ({e}): is the server up?") from e
    if not models:
        raise ValueError(f"{url} lists no model: pass --model.")
    return models[0]["id"]


# ---- statistics ------------------------------------------------------------------------------
def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in _SLO_METRICS or ms <= 0:
            raise ValueError(
                f"--goodput takes METRIC:MS with METRIC one of {', '.join(_SLO_METRICS)} and "
                f"MS > 0, e.g. ttft:500 tpot:50; got {spec!r}."
            )
        slos[name] = ms
    return slos


def latency_stats(name: str, seconds: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds, keyed like vLLM (mean_ttft_ms, p99_ttft_ms, ...);
    percentiles interpolate linearly (numpy's default). 0 for an empty list."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    if ms.size == 0:
        ms = np.zeros(1)
    stats = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms))}
    for p in _PERCENTILES[1:]:
        stats[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": result.ttft * 1e3, "tpot": result.tpot * 1e3, "e2el": result.e2el * 1e3}
    return result.success and all(values_ms[k] <= limit for k, limit in slos.items())


def compute_metrics(
    results: Sequence[RequestResult], duration: float, slos: dict[str, float] | None = None
) -> dict[str, float]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    metrics: dict[str, float] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if slos:
        metrics["request_goodput"] = sum(meets_slos(r, slos) for r in ok) / duration
    metrics |= latency_stats("ttft", [r.ttft for r in ok])
    metrics |= latency_stats("tpot", [r.tpot for r in ok if r.output_tokens > 1])
    metrics |= latency_stats("itl", [gap for r in ok for gap in r.itl])
    metrics |= latency_stats("e2el", [r.e2el for r in ok])
    return metrics


def format_metrics(metrics: dict[str, float], request_rate: float) -> str:
    rows = [
        ("Request rate (req/s)", f"{request_rate:g}"),
        ("Successful requests", f"{metrics['completed']:.0f}"),
        ("Failed requests", f"{metrics['failed']:.0f}"),
        ("Benchmark duration (s)", f"{metrics['duration_s']:.2f}"),
        ("Total input tokens", f"{metrics['total_input_tokens']:.0f}"),
        ("Total generated tokens", f"{metrics['total_output_tokens']:.0f}"),
        ("Request throughput (req/s)", f"{metrics['request_throughput']:.2f}"),
    ]
    if "request_goodput" in metrics:
        rows.append(("Request goodput (req/s)", f"{metrics['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics['total_token_throughput']:.2f}"),
    ]
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines += [f"{k + ':':<40}{v:>10}" for k, v in rows]
    for name, title in _LATENCY_METRICS.items():
        lines.append(f"{title:-^50}")
        upper = name.upper()
        for stat in ("mean", "median", "p90", "p99"):
            label = f"{stat.capitalize()} {upper} (ms):"
            lines.append(f"{label:<40}{metrics[f'{stat}_{name}_ms']:>10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def plot_runs(runs: Sequence[dict[str, float]], path: str) -> None:
    """Latency percentiles (median, p90, p99) of TTFT, TPOT, ITL and E2E against request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{run['request_rate']:g}" for run in runs]
    x = range(len(runs))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (name, title) in zip(axes.flat, _LATENCY_METRICS.items()):
        for stat in ("median", "p90", "p99"):
            ax.plot(x, [run[f"{stat}_{name}_ms"] for run in runs], marker="o", label=stat)
        ax.set_title(title)
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("request rate (req/s)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the command -----------------------------------------------------------------------------
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="online serving benchmark against an OpenAI-compatible server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument(
        "--model", default=None, help="model name to request (default: the server's first)"
    )
    p.add_argument(
        "--models",
        default=None,
        metavar="NAMES",
        help="model names sent round-robin, comma-separated, base for --model (e.g. the LoRA "
        "adapters a,b,base)",
    )
    p.add_argument(
        "--lora-ids",
        default=None,
        metavar="IDS",
        help="llama.cpp's server: adapter ids sent round-robin in each request's `lora` field, "
        "comma-separated, base for none (e.g. 0,1,2,3)",
    )
    p.add_argument(
        "--tokenizer", default=None, help="makes the prompts (default: quire's default model's)"
    )
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per request rate")
    p.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=[100, 1024],
        help="prompt tokens, drawn uniformly",
    )
    p.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=[100, 512],
        help="output tokens (max_tokens with ignore_eos), drawn uniformly",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests/s of the Poisson arrivals, inf = all at once; several values run one "
        "after another",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight (default: no limit)",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs, e.g. ttft:500 tpot:50",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="of the prompts, their lengths and the arrivals (the i-th rate: seed + i)",
    )
    p.add_argument(
        "--output-json",
        default=None,
        metavar="PATH",
        help="also write the report to this JSON file (default: none, the summary only)",
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="latency percentiles vs rate")
    p.set_defaults(func=main)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            raise ValueError(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX.")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}.")
    if any(not rate > 0 for rate in args.request_rate):
        raise ValueError("--request-rate values must be > 0 (inf: all at once).")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
    parse_lora_ids(args.lora_ids)


def parse_lora_ids(text: str | None) -> list[int | None]:
    """`--lora-ids`: "0,1,base" -> [0, 1, None]."""
    if text is None:
        return [None]
    ids: list[int | None] = []
    for name in text.split(","):
        if name == "base":
            ids.append(None)
        elif name.isdigit():
            ids.append(int(name))
        else:
            raise ValueError(
                f"--lora-ids takes adapter ids (0, 1, ...) or base, comma-separated; got {name!r}."
            )
    return ids


def main(args: argparse.Namespace) -> int:
    from quire.config import default_model_path
    from quire.model.tokenizer import load_tokenizer

    _check_args(args)
    slos = parse_goodput(args.goodput)
    model = args.model or asyncio.run(served_model(args.base_url, args.api_key))
    models = [model]
    if args.models is not None:
        models = [model if name == "base" else name for name in args.models.split(",")]
    lora_ids = parse_lora_ids(args.lora_ids)
    tokenizer = load_tokenizer(args.tokenizer or default_model_path())
    probes = max(len(models), len(lora_ids))  # one request per model name and adapter id
    probe_results, _ = asyncio.run(
        run_benchmark(
            args.base_url,
            models,
            [ServeRequest("Hello", 1, 2)] * probes,
            math.inf,
            None,
            args.api_key,
            show_progress=False,
            lora_ids=lora_ids,
        )
    )
    for i, result in enumerate(probe_results):
        if not result.success:
            name, lora_id = models[i % len(models)], lora_ids[i % len(lora_ids)]
            adapter = "" if lora_id is None else f", adapter id {lora_id}"
            raise ValueError(
                f"The server at {completions_url(args.base_url)} failed for model {name}"
                f"{adapter}: {result.error}"
            )

    runs = []
    for i, rate in enumerate(args.request_rate):
        # Fresh prompts per rate: a run must not hit the prefix cache an earlier run filled.
        seed = args.seed + i
        requests = make_requests(
            tokenizer, args.num_prompts, tuple(args.input_len), tuple(args.output_len), seed
        )
        results, duration = asyncio.run(
            run_benchmark(
                args.base_url,
                models,
                requests,
                rate,
                args.max_concurrency,
                args.api_key,
                seed,
                lora_ids=lora_ids,
            )
        )
        metrics = compute_metrics(results, duration, slos)
        print(format_metrics(metrics, rate))
        errors = sorted({r.error for r in results if not r.success})
        if errors:
            print(f"errors: {errors[:5]}", file=sys.stderr)
        runs.append({"request_rate": rate, "max_concurrency": args.max_concurrency} | metrics)

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "base_url": args.base_url,
        "model": model,
        "models": models,
        "lora_ids": lora_ids,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "goodput_slos_ms": slos,
        "runs": [{k: _json_number(v) for k, v in run.items()} for run in runs],
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.output_json}", file=sys.stderr)
    if args.plot:
        plot_runs(runs, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _json_number(value: object) -> object:
    """JSON has no infinity: an infinite request rate is written as the string "inf"."""
    return "inf" if isinstance(value, float) and math.isinf(value) else value

"""`quire bench pd-profile`: measures the parameters of the router's cost model on the running
instances, through their HTTP APIs and metrics, and writes the JSON file that
`quire router --policy cost_model --cost-profile FILE` loads.

  alpha, prefill base   a prompt of each of --prompt-lens sent to the prefill instance (one token,
                        KV leased), timed; a least-squares line through the medians
  transfer              the decode instance then pulls that KV (max_tokens 1), timed; the bytes
                        and pull seconds are the decode instance's kv_transfer metrics. Bandwidth
                        is the line of seconds against bytes; the base is what the hand-off
                        takes beyond its bytes (second hop, pull set-up, write)
  beta                  --batch-sizes streams at once on the decode instance, for each context
                        of --contexts; a step is the median gap between text chunks while all of
                        them decode. Fitted to beta0 + beta_seq * max(0, b - b*) + beta_ctx * b * c,
                        b* the measured batch size that fits best (where decode turns
                        compute-bound)
  gamma                 one stream decodes on the collocated instance (the decode instance if
                        none is given) while a --gamma-prompt-len prompt prefills there: the
                        time its gaps grew beyond their median, per prompt token

Each prompt is fresh (no prefix-cache hit). Every measurement is repeated --rounds times after
a warm-up; medians are kept.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import time
import uuid
from typing import Any

import numpy as np

from quire.router.cost_model import CostProfile

_salts = itertools.count(1)


def fresh_prompt(length: int) -> list[int]:
    """Token ids no earlier prompt of this process starts with."""
    salt = next(_salts) + os.getpid() * 1000
    return [(7919 * salt + 104729 * j) % 30000 + 100 for j in range(length)]


class Profiler:
    def __init__(
        self, prefill: str, decode: str, collocated: str | None, model: str, timeout_s: float
    ):
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.collocated = (collocated or decode).rstrip("/")
        self.model = model
        # httpx is imported here, not at the top: `quire` builds every bench's parser when it
        # starts, and httpx (which loads rich) would slow the start of every command.
        import httpx

        self.client = httpx.AsyncClient(timeout=timeout_s)

    async def load(self, url: str) -> dict[str, Any]:
        response = await self.client.get(f"{url}/load")
        response.raise_for_status()
        return response.json()

    async def complete(self, url: str, prompt: list[int], max_tokens: int, **extra) -> float:
        """Seconds for a whole (not streamed) greedy completion."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        start = time.perf_counter()
        response = await self.client.post(
            f"{url}/v1/completions", json={**body, "ignore_eos": True, **extra}
        )
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            raise ValueError(f"{url} answered {response.status_code}: {response.text[:300]}")
        return elapsed

    async def stream_times(
        self, url: str, prompt: list[int], max_tokens: int, times: list[float] | None = None
    ) -> list[float]:
        """perf_counter times of the text chunks of a streamed greedy completion (appended to
        `times` as they come, when given)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        times = [] if times is None else times
        async with self.client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise ValueError(f"{url} answered {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    times.append(time.perf_counter())
        return times

    async def transfer_counters(self) -> tuple[float, float]:
        """(bytes, seconds) the decode instance has pulled so far."""
        return kv_transfer_counters((await self.client.get(f"{self.decode}/metrics")).text)

    # ---- prefill and transfer ----
    async def prefill_and_transfer(self, lengths: list[int], rounds: int) -> list[dict]:
        endpoint = (await self.load(self.prefill)).get("kv_endpoint")
        if not endpoint:
            raise ValueError(
                f"{self.prefill} has no KV endpoint: start it with --disaggregation-mode prefill."
            )
        samples = []
        for length in lengths:
            for round_index in range(rounds + 1):
                prompt, transfer_id = fresh_prompt(length), f"pd-profile-{uuid.uuid4().hex}"
                prefill_s = await self.complete(
                    self.prefill,
                    prompt,
                    1,
                    kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id},
                )
                before = await self.transfer_counters()
                handoff_s = await self.complete(
                    self.decode,
                    prompt,
                    1,
                    kv_transfer_params={
                        "do_remote_prefill": True,
                        "transfer_id": transfer_id,
                        "remote_host": endpoint["host"],
                        "remote_port": endpoint["port"],
                    },
                )
                after = await self._counters_past(before)
                if round_index:  # round 0 warms up
                    samples.append(
                        {
                            "prompt_tokens": length,
                            "prefill_s": prefill_s,
                            "handoff_s": handoff_s,
                            "bytes": after[0] - before[0],
                            "transfer_s": after[1] - before[1],
                        }
                    )
        return samples

    async def _counters_past(self, before: tuple[float, float]) -> tuple[float, float]:
        """The transfer counters once they moved past `before` (the engine loop publishes them
        at its next step)."""
        deadline = time.monotonic() + 5.0
        while True:
            now = await self.transfer_counters()
            if now[0] > before[0] or time.monotonic() > deadline:
                if now[0] <= before[0]:
                    raise ValueError(
                        f"The decode instance {self.decode} counted no KV bytes pulled: is it "
                        "started with --disaggregation-mode decode?"
                    )
                return now
            await asyncio.sleep(0.02)

    # ---- decode steps ----
    async def decode_steps(
        self, batches: list[int], contexts: list[int], tokens: int, rounds: int
    ) -> list[dict]:
        samples = []
        for context in contexts:
            for batch in batches:
                steps = []
                for round_index in range(rounds + 1):
                    streams = await asyncio.gather(
                        *(
                            self.stream_times(self.decode, fresh_prompt(context), tokens)
                            for _ in range(batch)
                        )
                    )
                    if round_index:
                        steps.append(_together_gap(streams))
                samples.append(
                    {"batch": batch, "context": context, "step_s": statistics.median(steps)}
                )
        return samples

    # ---- interference ----
    async def interference(
        self, prompt_len: int, step_s: float, prefill_s: float, rounds: int
    ) -> list[dict]:
        """Per round: how much longer one stream's gaps grew while a prompt prefilled beside
        it, beyond the median gap before the prompt came."""
        lead = 8  # gaps timed before the prompt arrives
        max_tokens = lead + 2 * math.ceil(prefill_s / step_s) + 16  # outlasts the prefill
        samples = []
        for round_index in range(rounds + 1):
            times: list[float] = []
            stream = asyncio.create_task(
                self.stream_times(self.collocated, fresh_prompt(8), max_tokens, times)
            )
            while len(times) <= lead and not stream.done():
                await asyncio.sleep(0.002)
            sent = time.perf_counter()
            await self.complete(self.collocated, fresh_prompt(prompt_len), 1)
            done = time.perf_counter()
            await stream
            if times[-1] <= done:
                raise ValueError("The decode stream ended before the prompt was prefilled.")
            gaps = list(zip(times, times[1:]))
            baseline = statistics.median(b - a for a, b in gaps if b <= sent)
            excess = sum(b - a - baseline for a, b in gaps if b > sent and a < done)
            if round_index:
                samples.append(
                    {"prompt_tokens": prompt_len, "baseline_gap_s": baseline, "excess_s": excess}
                )
        return samples


def kv_transfer_counters(metrics: str) -> tuple[float, float]:
    """(bytes, seconds) of KV pulled, from an instance's /metrics text."""
    values = {"quire:kv_transfer_bytes_total": 0.0, "quire:kv_transfer_seconds_total": 0.0}
    for line in metrics.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.partition("{")[0]
        if name in values:
            values[name] = float(value)
    return values["quire:kv_transfer_bytes_total"], values["quire:kv_transfer_seconds_total"]


def _together_gap(streams: list[list[float]]) -> float:
    """The median gap between consecutive chunks of each stream while every stream decoded."""
    start = max(times[0] for times in streams)
    end = min(times[-1] for times in streams)
    gaps = [b - a for times in streams for a, b in zip(times, times[1:]) if a >= start and b <= end]
    if len(gaps) < 3:
        raise ValueError("Too few decode steps overlapped to time a batch: raise --decode-tokens.")
    return statistics.median(gaps)


# ---- fits ----------------------------------------------------------------------------------------
def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y)."""
    a = np.stack([np.ones(len(x)), np.asarray(x, dtype=np.float64)], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(a, np.asarray(y, dtype=np.float64), rcond=None)
    return float(intercept), float(slope)


def fit_prefill(samples: list[dict]) -> tuple[float, float]:
    """(base_s, alpha) from the medians per prompt length; ValueError if time did not grow."""
    lengths = sorted({s["prompt_tokens"] for s in samples})
    medians = [
        statistics.median(s["prefill_s"] for s in samples if s["prompt_tokens"] == n)
        for n in lengths
    ]
    base, alpha = fit_line(lengths, medians)
    if len(lengths) < 2 or alpha <= 0:
        raise ValueError(
            f"Prefill time did not grow with the prompt length ({dict(zip(lengths, medians))}): "
            "give --prompt-lens further apart (and longer)."
        )
    return max(base, 0.0), alpha


def fit_transfer(samples: list[dict]) -> tuple[float, float, float]:
    """(base_s, bytes_per_s, kv_bytes_per_token): the bandwidth from the pulls' seconds against
    their bytes (through the origin if the line's slope is not positive), the base from the
    hand-offs' time beyond their bytes."""
    moved = [s["bytes"] for s in samples]
    _, slope = fit_line(moved, [s["transfer_s"] for s in samples])
    if slope <= 0:
        slope = sum(s["transfer_s"] for s in samples) / sum(moved)
    bandwidth = 1.0 / slope
    base = statistics.median(s["handoff_s"] - s["bytes"] / bandwidth for s in samples)
    per_token = sum(moved) / sum(s["prompt_tokens"] for s in samples)
    return max(base, 0.0), bandwidth, per_token


def fit_decode(samples: list[dict]) -> tuple[float, float, float, float]:
    """(beta0, beta_seq, beta_ctx, b*) of step = beta0 + beta_seq * max(0, b - b*) +
    beta_ctx * b * c: non-negative least squares for each measured b* (and 0), the best kept.
    A beta_seq of 0 means decode stayed memory-bound over the measured batches: b* is the
    largest of them."""
    batch = np.asarray([s["batch"] for s in samples], dtype=np.float64)
    context = np.asarray([s["context"] for s in samples], dtype=np.float64)
    step = np.asarray([s["step_s"] for s in samples], dtype=np.float64)
    best = None
    for knee in sorted({0.0, *batch.tolist()}):
        columns = [np.ones_like(batch), np.maximum(0.0, batch - knee), batch * context]
        coef = _nonnegative_lstsq(np.stack(columns, axis=1), step)
        residual = float(np.sum((np.stack(columns, axis=1) @ coef - step) ** 2))
        if best is None or residual < best[0] - 1e-15:
            best = (residual, knee, coef)
    _, knee, (beta0, beta_seq, beta_ctx) = best
    if beta_seq == 0:
        knee = float(batch.max())
    if beta0 <= 0:
        raise ValueError(f"Decode steps fit no positive base time: {samples}")
    return float(beta0), float(beta_seq), float(beta_ctx), float(knee)


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: columns whose coefficient comes out negative
    are dropped and the rest refitted (three columns: the exhaustive search is cheap)."""
    n = a.shape[1]
    best, best_residual = np.zeros(n), float(np.sum(y**2))
    for keep in itertools.product((True, False), repeat=n):
        idx = [i for i in range(n) if keep[i]]
        if not idx:
            continue
        coef, *_ = np.linalg.lstsq(a[:, idx], y, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(n)
        full[idx] = coef
        residual = float(np.sum((a @ full - y) ** 2))
        if residual < best_residual:
            best, best_residual = full, residual
    return best


# ---- the command -------------------------------------------------------------------------------
async def profile_instances(args: argparse.Namespace) -> dict[str, Any]:
    import httpx  # not at the top: see Profiler.__init__

    profiler = Profiler(args.prefill, args.decode, args.collocated, args.model, args.timeout)
    try:
        loads = {
            url: await profiler.load(url)
            for url in (profiler.prefill, profiler.decode, profiler.collocated)
        }
        model = (
            args.model
            or (await profiler.client.get(f"{profiler.decode}/v1/models")).json()["data"][0]["id"]
        )
        profiler.model = model
        transfers = await profiler.prefill_and_transfer(args.prompt_lens, args.rounds)
        prefill_base, alpha = fit_prefill(transfers)
        transfer_base, bandwidth, per_token = fit_transfer(transfers)
        steps = await profiler.decode_steps(
            args.batch_sizes, args.contexts, args.decode_tokens, args.rounds
        )
        beta0, beta_seq, beta_ctx, knee = fit_decode(steps)
        gamma_prefill_s = prefill_base + alpha * args.gamma_prompt_len
        interference = await profiler.interference(
            args.gamma_prompt_len, beta0, gamma_prefill_s, args.rounds
        )
    except httpx.HTTPError as error:
        raise ValueError(f"An instance did not answer: {error!r}") from error
    finally:
        await profiler.client.aclose()
    gamma = max(0.0, statistics.median(s["excess_s"] for s in interference)) / (
        args.gamma_prompt_len
    )
    chunk = loads[profiler.collocated].get("max_num_batched_tokens")
    if not isinstance(chunk, int):
        raise ValueError(f"{profiler.collocated}/load does not say its max_num_batched_tokens.")
    profile = CostProfile(
        prefill_base_s=prefill_base,
        alpha_s_per_token=alpha,
        chunk_tokens=chunk,
        decode_base_s=beta0,
        decode_per_seq_s=beta_seq,
        decode_per_context_token_s=beta_ctx,
        compute_bound_batch=knee,
        gamma_s_per_prefill_token=gamma,
        transfer_base_s=transfer_base,
        transfer_bytes_per_s=bandwidth,
        kv_bytes_per_token=per_token,
    )
    return profile.to_dict() | {
        "measured": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "model": model,
            "prefill": profiler.prefill,
            "decode": profiler.decode,
            "collocated": profiler.collocated,
            "loadavg": loadavg(),
            "prefill_and_transfer": transfers,
            "decode_steps": steps,
            "interference": interference,
        }
    }


def loadavg() -> str | None:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pd-profile",
        help="measure the cost model's parameters on running prefill/decode instances",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill", required=True, metavar="URL", help="a prefill instance")
    p.add_argument("--decode", required=True, metavar="URL", help="a decode instance")
    p.add_argument(
        "--collocated",
        default=None,
        metavar="URL",
        help="a collocated instance, for the interference (default: the decode instance)",
    )
    p.add_argument("--model", default=None, help="model name (default: the decode instance's)")
    p.add_argument("--output", required=True, metavar="JSON", help="the profile to write")
    p.add_argument(
        "--prompt-lens",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help="prompt lengths timed on the prefill instance (two or more)",
    )
    p.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="decode batches timed on the decode instance",
    )
    p.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[32, 512],
        help="context lengths of the timed decode batches",
    )
    p.add_argument("--decode-tokens", type=int, default=24, help="per stream in a decode batch")
    p.add_argument(
        "--gamma-prompt-len",
        type=int,
        default=512,
        help="prompt tokens of the prefill run beside a decode to time the interference",
    )
    p.add_argument("--rounds", type=int, default=3, help="repeats of each measurement")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.set_defaults(func=main)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("prompt_lens", "batch_sizes", "contexts"):
        values = getattr(args, name)
        if any(v < 1 for v in values):
            raise ValueError(f"--{name.replace('_', '-')} values must be >= 1, got {values}.")
    if len(set(args.prompt_lens)) < 2:
        raise ValueError("--prompt-lens needs two different lengths at least (a line's slope).")
    for name in ("decode_tokens", "gamma_prompt_len", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1.")
    if args.decode_tokens < 6:
        raise ValueError("--decode-tokens must be >= 6 (a batch needs steps to time).")


def main(args: argparse.Namespace) -> int:
    _check_args(args)
    result = asyncio.run(profile_instances(args))
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    p = CostProfile.from_dict(result)
    print(
        f"prefill {p.prefill_base_s * 1e3:.1f} ms + {p.alpha_s_per_token * 1e3:.3f} ms/token; "
        f"decode step {p.decode_base_s * 1e3:.1f} ms + {p.decode_per_seq_s * 1e3:.2f} ms/seq "
        f"past batch {p.compute_bound_batch:g} + {p.decode_per_context_token_s * 1e6:.3f} "
        f"us/context token; interference {p.gamma_s_per_prefill_token * 1e3:.3f} ms/prefill "
        f"token; transfer {p.transfer_base_s * 1e3:.1f} ms + "
        f"{p.transfer_bytes_per_s / 2**20:.0f} MiB/s ({p.kv_bytes_per_token:.0f} B/token)",
        file=sys.stderr,
    )
    print(f"wrote {args.output}", file=sys.stderr)
    return 0

"""Batch-1 decode with `--quantization int8` against `none` (bf16) on one Hugging Face checkpoint,
both engines in one process, in interleaved ABBA rounds.

Each round times, on each engine, a request of 1 and of 17 greedy tokens after the same prompt;
decode ms/token = (t17 - t1) / 16, as wall time and as the process's CPU time (every thread;
on a host shared with other work the CPU time drifts less than the wall time). The speed-up is
the median over rounds of the per-round ratio none / int8.

    python scripts/bench_int8_decode.py --model qwen3-0.6b-random --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import time

from quire import LLM, SamplingParams
from quire.bench.models import resolve_model

QUANTIZATIONS = ("int8", "none")
KINDS = ("wall", "cpu")


def decode_ms(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """(wall, CPU) ms per generated token after the first."""
    times = {}
    for n in (1, 17):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times[n] = (time.perf_counter() - wall, time.process_time() - cpu)
    return tuple((times[17][i] - times[1][i]) / 16 * 1e3 for i in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b-random")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()
    path = resolve_model(args.model, None)
    engines = {
        q: LLM(path, quantization=q, dtype="bfloat16", num_kv_blocks=16) for q in QUANTIZATIONS
    }
    ms = {(q, kind): [] for q in QUANTIZATIONS for kind in KINDS}
    ratios = {kind: [] for kind in KINDS}
    for r in range(args.rounds):
        order = QUANTIZATIONS if r % 2 == 0 else QUANTIZATIONS[::-1]
        prompt = [(31 * r + 7 * j) % 30000 + 100 for j in range(args.prompt_len)]
        got = {q: decode_ms(engines[q], prompt) for q in order}
        for i, kind in enumerate(KINDS):
            for q in QUANTIZATIONS:
                ms[(q, kind)].append(got[q][i])
            ratios[kind].append(got["none"][i] / got["int8"][i])
        print(r, order, {q: [round(v, 1) for v in got[q]] for q in order}, flush=True)
    for kind in KINDS:
        medians = {q: round(statistics.median(ms[(q, kind)]), 1) for q in QUANTIZATIONS}
        rs = ratios[kind]
        print(
            f"{kind}: median ms/token {medians}; none / int8 median {statistics.median(rs):.3f} "
            f"({min(rs):.3f}-{max(rs):.3f})"
        )


if __name__ == "__main__":
    main()

"""Where a steady decode step's time goes on a GPU: the torch profiler over a few engine steps
at each batch size, then the GPU's idle fraction of the steps' wall time (one minus the union
of its kernels' intervals), kernels per step and the kernels that take the most time.

    python scripts/gpu_step_profile.py --model /tmp/quire-models --batch-sizes 1 64 --steps 20

`scripts/gpu_checks.sh profile` runs it on the benchmark model. On a CPU it runs too (kernels
are then the CPU ops the profiler sees, and the idle fraction means little): a check of the
script, not a measurement.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from quire import LLM, SamplingParams


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_batch(llm: LLM, batch: int, steps: int, prompt_len: int, device: str) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    ids = [f"profile-{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        prompt = [(31 * i + 7 * j) % 5000 + 10 for j in range(prompt_len)]
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    generated: dict[str, int] = {}
    while len(generated) < batch or min(generated.values()) < 4:  # prefilled, a few decodes
        for output in engine.step():
            generated[output.request_id] = len(output.outputs[0].token_ids)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    engine.abort_request(ids)
    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    kernels = [e for e in prof.events() if e.device_type == kind]
    if device != "cuda":  # the CPU ops at the top of the stack stand for kernels
        kernels = [e for e in kernels if e.cpu_parent is None]
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels])
    totals: dict[str, list[float]] = {}
    for e in kernels:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.end - e.time_range.start
        entry[1] += 1
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:8]
    return {
        "batch": batch,
        "step_us": wall_us / steps,
        "busy_us": busy / steps,
        "idle": 1 - busy / wall_us,
        "kernels_per_step": len(kernels) / steps,
        "top": [(name, t / steps, n / steps) for name, (t, n) in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder or GGUF file")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=20, help="profiled steps per batch size")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=max(args.batch_sizes))
    print(f"{args.model} on {args.device}; {args.steps} steady decode steps per batch size")
    for batch in args.batch_sizes:
        r = profile_batch(llm, batch, args.steps, args.prompt_len, args.device)
        print(
            f"batch {r['batch']:4d}: step {r['step_us']:8.1f} us, device busy {r['busy_us']:8.1f} "
            f"us, idle {r['idle']:6.1%}, {r['kernels_per_step']:.0f} kernels a step"
        )
        for name, us, count in r["top"]:
            print(f"    {us:8.1f} us {count:5.1f}x  {name[:90]}")


if __name__ == "__main__":
    main()

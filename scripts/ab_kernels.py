"""Times two builds of the CPU kernels against each other inside one process, interleaved.

    git worktree add /tmp/quire-old HEAD~1
    .venv/bin/python scripts/ab_kernels.py --old /tmp/quire-old/quire/kernels/cpu \\
        --batch-size 32 --prompt-len 700 --decode-steps 160
    .venv/bin/python scripts/ab_kernels.py --old /tmp/quire-old/quire/kernels/cpu \\
        --workload w1 --num-requests 32 --rounds 4

The shared hosts quire is measured on change speed by 10-50% within minutes, so two builds
timed in separate runs compare the neighbours more than the builds. Here both libraries are
loaded at once and the engine's calls go to one or the other:
- decode steps (the default): one generation of --batch-size seeded random prompts; the
  library changes every --block decode steps, and each decode step of the whole batch is timed;
- --workload w1|w2: the first --num-requests requests of the throughput workload, run --rounds
  times with prefix caching off, the libraries in the order ABBA ABBA...; each round's tokens are
  compared with the first round's (a change that keeps the bits keeps the tokens).
Only the kernels differ: the Python is this tree's, so the old tree's kernels must have the
entry points this tree calls.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import quire.kernels.cpu as cpu_kernels  # noqa: E402

_THIS_TREE = os.path.dirname(os.path.abspath(cpu_kernels.__file__))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the A side: a folder of kernel sources")
    p.add_argument("--new", default=_THIS_TREE, help="the B side (default: this tree's)")
    p.add_argument("--model", default=None, help="model path or qwen3-0.6b-random")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=700)
    p.add_argument("--decode-steps", type=int, default=160)
    p.add_argument("--block", type=int, default=4, help="decode steps per turn of a library")
    p.add_argument("--workload", choices=("w1", "w2"), default=None)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    return p.parse_args(argv)


class KernelSwitch:
    """Routes every quire module's `load_library()` to the library of the current side."""

    def __init__(self, old_dir: str, new_dir: str):
        self.libs = [cpu_kernels.build_library(old_dir), cpu_kernels.build_library(new_dir)]
        if None in self.libs:
            raise SystemExit("a kernel build failed (see the log above)")
        self.side = 0

        def current():
            return self.libs[self.side]

        current.cache_clear = lambda: None  # cpu_kernels.configure clears the real one's cache
        original = cpu_kernels.load_library
        for module in list(sys.modules.values()):
            if module.__name__.startswith("quire") and vars(module).get("load_library") is original:
                module.load_library = current


def make_llm(model: str | None, **kwargs):
    from quire import LLM
    from quire.bench.models import resolve_model

    return LLM(model=resolve_model(model), dtype="bfloat16", **kwargs)


def run_steps(args: argparse.Namespace, switch: KernelSwitch) -> None:
    from quire import SamplingParams

    llm = make_llm(args.model)
    engine = llm.engine
    rng = random.Random(0)
    max_id = min(9999, engine.model_config.vocab_size - 1)
    prompts = [
        [rng.randint(0, max_id) for _ in range(args.prompt_len)] for _ in range(args.batch_size)
    ]
    times: list[list[float]] = [[], []]
    execute = engine.core.executor.worker.runner.execute
    num_decodes = 0

    def timed_execute(scheduler_output):
        nonlocal num_decodes
        counts = scheduler_output.num_scheduled_tokens
        full_decode = len(counts) == args.batch_size and all(n == 1 for n in counts.values())
        switch.side = (num_decodes // args.block) % 2
        start = time.perf_counter()
        output = execute(scheduler_output)
        elapsed = time.perf_counter() - start
        if full_decode:
            num_decodes += 1
            times[switch.side].append(elapsed)
        return output

    engine.core.executor.worker.runner.execute = timed_execute
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.decode_steps)
    llm.generate(prompts, params, use_tqdm=False)
    old, new = (t[args.block :] for t in times)  # the first turn of each side warms it up
    if not old or not new:
        raise SystemExit("too few decode steps: raise --decode-steps")
    print(
        f"decode steps, batch {args.batch_size}, context {args.prompt_len}-"
        f"{args.prompt_len + args.decode_steps}: old {statistics.median(old) * 1e3:.2f} ms "
        f"(mean {statistics.mean(old) * 1e3:.2f}, {len(old)} steps), new "
        f"{statistics.median(new) * 1e3:.2f} ms (mean {statistics.mean(new) * 1e3:.2f}, "
        f"{len(new)} steps); new / old: median {statistics.median(new) / statistics.median(old):.3f}"
        f", mean {statistics.mean(new) / statistics.mean(old):.3f}"
    )


def run_workload(args: argparse.Namespace, switch: KernelSwitch) -> None:
    from quire import SamplingParams
    from quire.bench.throughput import WORKLOADS, make_requests

    workload = WORKLOADS[args.workload]
    llm = make_llm(args.model or workload.model, enable_prefix_caching=False)
    vocab_size = llm.engine.model_config.vocab_size
    requests = make_requests(
        args.num_requests, workload.input_len, workload.output_len, 0, vocab_size
    )
    prompts = [r.prompt_token_ids for r in requests]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in requests
    ]
    output_tokens = sum(r.output_len for r in requests)
    llm.generate([list(range(1, 17))], SamplingParams(max_tokens=4), use_tqdm=False)
    first_tokens = None
    elapsed: list[list[float]] = [[], []]
    for round_index in range(args.rounds):
        for side in (0, 1) if round_index % 2 == 0 else (1, 0):
            switch.side = side
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            elapsed[side].append(seconds)
            tokens = [o.outputs[0].token_ids for o in outputs]
            first_tokens = first_tokens or tokens
            print(
                f"round {round_index} {('old', 'new')[side]}: {seconds:.2f} s, "
                f"{output_tokens / seconds:.1f} out tok/s, tokens as round 0's: "
                f"{tokens == first_tokens}",
                flush=True,
            )
    old, new = (statistics.median(t) for t in elapsed)
    print(f"{args.workload}, {args.num_requests} requests: new / old time {new / old:.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    switch = KernelSwitch(os.path.abspath(args.old), os.path.abspath(args.new))
    if args.workload:
        run_workload(args, switch)
    else:
        run_steps(args, switch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

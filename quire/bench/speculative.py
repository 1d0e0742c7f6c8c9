"""`quire bench speculative`: decode tokens/s with `--speculative-config` against without it, the
two engines in one process, timed in ABBA order (A B B A ...) so a shared machine's drift weighs
on both alike; reports the median of the per-round ratios, their spread, and the acceptance rate
and mean accepted length.

Workloads (greedy, or with `--temperature` seeded sampling, which gives the same tokens with and
without n-gram speculation, and tokens of the same distribution with a draft model):

    copy    chat prompts that ask to repeat or lightly edit a given passage (the model's answer
            reuses it: what prompt lookup is for), one request at a time (batch 1); each answer
            ends at the model's end of turn, or at `--output-len` tokens (past its end of turn
            a small model starts an unrelated conversation of its own, which is not a copy)

    random  prompts of random token ids (nothing to look up), `--batch-size` requests at once,
            `ignore_eos`: each generates `--output-len` tokens; greedy, a small model soon
            repeats itself, which lookup finds: `--temperature 1` keeps its output from
            repeating too

A draft model for SmolLM2 (`"method": "draft_model"`): `python -m quire.bench.models --name
smollm2-draft-random` builds a random 2-layer one of its vocabulary; or the target itself as its
own draft.

Decode tokens/s counts the tokens after each request's first and the time after the batch's
first tokens, so prefill is left out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time

_PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the library by ten percent, to "
    "repair the roof of the community hall, and to hire two more staff for the after-school "
    "program. The vote was unanimous, and the new budget takes effect in January.",
    "To install the package, first make sure that Python 3.11 or newer is available. Create a "
    "virtual environment, activate it, and run the installer with the default options. When "
    "the installation finishes, open a new terminal and check the version number to confirm "
    "that everything works as expected.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and "
    "carbon dioxide into glucose and oxygen. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain the green pigment chlorophyll that absorbs "
    "the light energy the plant needs.",
    "Dear Ms. Lopez, thank you for your letter of March 3. We have checked your account and "
    "found that the payment was received on time. The late fee was charged by mistake and "
    "has now been removed. We apologize for the trouble and thank you for your patience.",
]
_ASKS = [
    "Repeat the following text exactly, word for word:",
    "Copy this text, changing nothing:",
    "Rewrite the following text with the same words, fixing nothing:",
    "Please repeat this passage verbatim:",
]


def copy_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    prompts = []
    for i in range(num_requests):
        ask, passage = _ASKS[i % len(_ASKS)], _PASSAGES[(i // len(_ASKS) + i) % len(_PASSAGES)]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{ask}\n\n{passage}"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def random_prompts(num_requests: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10000) for _ in range(prompt_len)] for _ in range(num_requests)]


def decode_rate(
    engine,
    prompts: list[list[int]],
    output_len: int,
    temperature: float,
    tag: str,
    ignore_eos: bool = True,
) -> float:
    """Decode tokens/s of these prompts run together."""
    from quire.sampling_params import SamplingParams

    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=temperature,
            seed=i if temperature > 0 else None,
            max_tokens=output_len,
            ignore_eos=ignore_eos,
        )
        engine.add_request(f"{tag}-{i}", prompt, params)
    seen = {f"{tag}-{i}": 0 for i in range(len(prompts))}
    start = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
        if start is None and min(seen.values()) > 0:
            start, first = time.perf_counter(), sum(seen.values())
    return (sum(seen.values()) - first) / (time.perf_counter() - start)


def spec_decoding_report(engine) -> dict | None:
    """The engine's speculation counters with the acceptance rate and mean accepted length;
    None when it does not speculate."""
    from dataclasses import asdict

    stats = engine.spec_decoding_stats
    if stats is None:
        return None
    return asdict(stats) | {
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
    }


def describe_spec_decoding(engine) -> None:
    """Prints the engine's acceptance rate and mean accepted length, if it speculates."""
    stats = engine.spec_decoding_stats
    if stats is not None:
        print(
            f"speculative decoding: acceptance rate {stats.acceptance_rate:.1%}, mean accepted "
            f"length {stats.mean_acceptance_length:.2f}, {stats.num_drafts} drafts, "
            f"{stats.num_draft_tokens} draft tokens"
        )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from quire.engine_args import EngineArgs

    p = subparsers.add_parser(
        "speculative",
        help="decode tokens/s with --speculative-config against without, ABBA in one run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload", choices=["copy", "random"], default="copy", help="see the description"
    )
    p.add_argument("--num-prompts", type=int, default=4, help="per round")
    p.add_argument("--batch-size", type=int, default=1, help="random: requests run together")
    p.add_argument("--prompt-len", type=int, default=256, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens per answer (copy: at most)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--rounds", type=int, default=4, help="A B B A ... rounds")
    p.add_argument(
        "--output-json",
        default=None,
        metavar="PATH",
        help="also write the report to this JSON file (default: none, the summary only)",
    )
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=main, dtype="bfloat16")


def main(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from quire.engine_args import EngineArgs
    from quire.entrypoints.llm import LLM

    if args.speculative_config is None:
        raise ValueError("give --speculative-config: the configuration to compare against none")
    for name in ("num_prompts", "batch_size", "prompt_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1.")
    config = EngineArgs.from_cli_args(args).create_engine_config()
    spec = LLM.from_engine_config(config).engine
    base = LLM.from_engine_config(replace(config, speculative_config=None)).engine
    if args.workload == "copy":
        prompts = copy_prompts(base.tokenizer, args.num_prompts)
        batches = [[p] for p in prompts]  # batch 1
    else:
        prompts = random_prompts(args.num_prompts * args.batch_size, args.prompt_len, args.seed)
        batches = [
            prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)
        ]

    def rate(engine, tag: str) -> float:
        rates = [
            decode_rate(
                engine,
                b,
                args.output_len,
                args.temperature,
                f"{tag}{i}",
                ignore_eos=args.workload == "random",
            )
            for i, b in enumerate(batches)
        ]
        return statistics.fmean(rates)

    rate(base, "warm"), rate(spec, "warm")
    ratios, rounds = [], []
    for r in range(args.rounds):
        order = (("base", base), ("spec", spec)) if r % 2 == 0 else (("spec", spec), ("base", base))
        result = {name: rate(engine, f"{name}{r}-") for name, engine in order}
        ratios.append(result["spec"] / result["base"])
        rounds.append(result)
        print(
            f"round {r + 1}: without {result['base']:.1f} tok/s, with {result['spec']:.1f} "
            f"tok/s -> {ratios[-1]:.2f}x",
            flush=True,
        )
    print(
        f"{args.workload} workload, batch {len(batches[0])}: speedup {statistics.median(ratios):.2f}x "
        f"(median of {len(ratios)} rounds, {min(ratios):.2f}-{max(ratios):.2f})"
    )
    describe_spec_decoding(spec)
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "workload": args.workload,
        "temperature": args.temperature,
        "speculative_config": args.speculative_config,
        "rounds": rounds,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "spec_decoding": spec_decoding_report(spec),
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0

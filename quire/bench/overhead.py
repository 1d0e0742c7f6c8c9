"""`quire bench overhead`: the engine's host time per step, phase by phase.

The model is one whose forward costs next to nothing: one layer of hidden size 64 with SmolLM2's
vocabulary (49152 tokens), random weights, built in a temporary folder with the default model's
tokenizer, or the one saved in the folder `--tokenizer` names (`--model` runs another instead). What a step then costs is the host's work around the forward: scheduling, preparing
the inputs, sampling, the stop rules, the outputs and their text.

At each batch size B, B requests with short prompts decode (greedy unless --temperature; as
LLM.generate makes them, with one output at the end, unless --stream), and two runs of steps
are timed after a few warm-up steps:
- decode: the steady state, every request decoding one token;
- mixed: the same, with a new request of --chunk-len prompt tokens (and one output token)
  added before each step, so that each step also computes a prompt chunk.

Each phase is the time spent in the callables PHASES names for it, less the time spent in
those of other phases called from inside them (so the phases never count a moment twice), in
microseconds per step; "step" is the wall time of `LLMEngine.step()` and "rest" what no phase
holds. "(gc)" is the time Python's garbage collector ran, inside the phases it interrupted: a
full collection walks every object alive, so its pauses grow with everything imported. On the C decode step (a CPU, bf16, greedy) the LM head and the argmax run inside the
forward's one C call: "forward" holds them and "sample" only what is left around it. Phases
are timed in this process: the engine core and the worker must run in it too.

On a shared machine the numbers swing from run to run: compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from quire.sampling_params import RequestOutputKind, SamplingParams

# Phase -> the callables ("module:Class.method") whose time it counts. When the engine's or
# the worker's code moves, re-point this table; nothing else names them.
PHASES: dict[str, list[str]] = {
    "schedule": ["quire.engine.scheduler:Scheduler.schedule"],
    "prepare": [  # the inputs: the worker's batch and the step's tensors
        "quire.worker.input_batch:InputBatch.update",
        "quire.worker.step_inputs:StepInputBuilder.build",
    ],
    "forward": [  # the fused C step's argmax_tokens holds the LM head and the argmax too
        "quire.worker.model_forward:ModelForward.forward",
        "quire.worker.model_forward:ModelForward.argmax_tokens",
    ],
    # its own time: the LM head's logits and the sampler (the forward inside it is "forward")
    "sample": ["quire.worker.model_runner:ModelRunner._run"],
    "update": ["quire.engine.scheduler:Scheduler.update"],  # with the stop rules
    # outputs and detokenizing: the core's outputs (EngineCore.step's own time: no speculation
    # or grammar here), then the front end's text, stop strings and RequestOutputs
    "outputs": [
        "quire.engine.core:EngineCore.step",
        "quire.engine.llm_engine:LLMEngine._process",
    ],
}
REST = "rest"  # the step's time in no phase
KINDS = ("decode", "mixed")
_WARMUP_STEPS = 4

# The null-forward model: quire.bench.models builds it with SmolLM2's tokenizer.
NULL_FORWARD_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)


class PhaseTimer:
    """Wraps the PHASES' callables, for as long as `timing` lasts, in timers that add each
    call's own time (its time less that of the timed calls inside it) to its phase; counts the
    garbage collector's pauses too (`gc_seconds`: inside whichever phase they interrupted)."""

    def __init__(self, phases: dict[str, list[str]]):
        self.phases = phases
        self.seconds = dict.fromkeys(phases, 0.0)
        self.gc_seconds = 0.0
        self._nested: list[float] = []  # per timed call in progress: time of the timed calls in it
        self._gc_start = 0.0

    def reset(self) -> None:
        for phase in self.seconds:
            self.seconds[phase] = 0.0
        self.gc_seconds = 0.0

    def _on_gc(self, event: str, info: dict[str, int]) -> None:
        if event == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_seconds += time.perf_counter() - self._gc_start

    def _wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        nested, seconds = self._nested, self.seconds

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            nested.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                seconds[phase] += elapsed - nested.pop()
                if nested:
                    nested[-1] += elapsed

        return timed

    @contextmanager
    def timing(self) -> Iterator[PhaseTimer]:
        patched: list[tuple[type, str, Any]] = []
        try:
            for phase, targets in self.phases.items():
                for target in targets:
                    owner, name = _resolve(target)
                    original = owner.__dict__[name]
                    setattr(owner, name, self._wrap(phase, original))
                    patched.append((owner, name, original))
            gc.callbacks.append(self._on_gc)
            yield self
        finally:
            if self._on_gc in gc.callbacks:
                gc.callbacks.remove(self._on_gc)
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)


def _resolve(target: str) -> tuple[type, str]:
    """("module:Class.method") -> (Class, "method"); ValueError naming what to re-point."""
    module_name, _, qualname = target.partition(":")
    class_name, _, name = qualname.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        owner = None
    if owner is None or not callable(owner.__dict__.get(name)):
        raise ValueError(f"bench overhead: {target} is gone: re-point PHASES to where it went.")
    return owner, name


@dataclass
class PhaseTimes:
    batch_size: int
    kind: str  # "decode" or "mixed"
    steps: int
    step_us: float  # mean wall time of a step
    phase_us: dict[str, float]  # mean per step, every phase and REST: they add up to step_us
    gc_us: float  # mean per step of the garbage collector's pauses, counted in the phases

    @property
    def per_request_step_us(self) -> float:
        return self.step_us / self.batch_size


def measure(
    engine,
    timer: PhaseTimer,
    batch_size: int,
    kind: str,
    num_steps: int,
    prompt_len: int,
    chunk_len: int,
    temperature: float,
    output_kind: RequestOutputKind,
    rng: random.Random,
) -> PhaseTimes:
    """Fills the engine with `batch_size` decoding requests, then times `num_steps` steps
    (after a few untimed ones) of `kind`; aborts every request at the end."""
    vocab = range(10, min(engine.model_config.vocab_size, 40000))
    decoding = SamplingParams(
        temperature=temperature, max_tokens=None, ignore_eos=True, output_kind=output_kind
    )
    prefill = SamplingParams(
        temperature=temperature, max_tokens=1, ignore_eos=True, output_kind=output_kind
    )
    ids = [f"{kind}-{batch_size}-{i}" for i in range(batch_size)]
    for request_id in ids:
        engine.add_request(request_id, [rng.choice(vocab) for _ in range(prompt_len)], decoding)
    while engine.core_stats().num_waiting:  # a prompt is computed in the step that admits it
        engine.step()
    chunks = itertools.count()

    def step() -> float:
        if kind == "mixed":
            prompt = [rng.choice(vocab) for _ in range(chunk_len)]
            engine.add_request(f"chunk-{batch_size}-{next(chunks)}", prompt, prefill)
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    for _ in range(_WARMUP_STEPS):
        step()
    timer.reset()
    times = [step() for _ in range(num_steps)]
    phase_s, gc_s = dict(timer.seconds), timer.gc_seconds
    engine.abort_request(ids)  # each mixed step's new request ended with its one token
    step_s = statistics.fmean(times)
    phase_us = {phase: s / num_steps * 1e6 for phase, s in phase_s.items()}
    phase_us[REST] = step_s * 1e6 - sum(phase_us.values())
    return PhaseTimes(batch_size, kind, num_steps, step_s * 1e6, phase_us, gc_s / num_steps * 1e6)


def report(results: list[PhaseTimes]) -> str:
    """A table: a row per batch size and kind, a column per phase, in µs per step, and the
    garbage collector's share of them."""
    columns = [*PHASES, REST]
    width = max(len(c) for c in columns) + 3
    lines = [
        f"{'batch':>6s} {'kind':7s}{'step':>10s}{'per req':>9s}"
        + "".join(f"{c:>{width}s}" for c in columns)
        + f"{'(gc)':>{width}s}"
    ]
    for r in results:
        lines.append(
            f"{r.batch_size:6d} {r.kind:7s}{r.step_us:10.0f}{r.per_request_step_us:9.1f}"
            + "".join(f"{r.phase_us[c]:{width}.0f}" for c in columns)
            + f"{r.gc_us:{width}.0f}"
        )
    return "\n".join(lines)


def build_null_forward_model(path: str, tokenizer_source: str | None = None) -> str:
    """Saves the null-forward model (NULL_FORWARD_SHAPE, random bf16 weights, the default
    model's tokenizer or the one saved at `tokenizer_source`) at `path`."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from quire.config import default_model_path
    from quire.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_source or default_model_path())
    if len(tokenizer) > NULL_FORWARD_SHAPE["vocab_size"]:
        raise ValueError(
            f"The tokenizer at {tokenizer_source} has {len(tokenizer)} tokens; the null-forward "
            f"model's vocabulary is {NULL_FORWARD_SHAPE['vocab_size']}: pass --tokenizer a "
            "folder holding SmolLM2's tokenizer (the default model's), or --model a model."
        )
    config = AutoConfig.for_model(
        "llama",
        architectures=["LlamaForCausalLM"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **NULL_FORWARD_SHAPE,
    )
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from quire.engine_args import EngineArgs

    p = subparsers.add_parser(
        "overhead",
        help="host time per step by phase, on a model whose forward costs next to nothing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 512], help="requests decoding"
    )
    p.add_argument("--steps", type=int, default=32, help="timed steps per batch size and kind")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of each request")
    p.add_argument(
        "--chunk-len", type=int, default=64, help="prompt tokens of each mixed step's new request"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument(
        "--stream",
        action="store_true",
        help="requests as a streaming server makes them: an output each step, the text decoded "
        "as tokens arrive (default: as LLM.generate makes them, one output at the end)",
    )
    p.add_argument(
        "--output-json",
        default=None,
        metavar="PATH",
        help="also write the report to this JSON file (default: none, the table only)",
    )
    EngineArgs.add_cli_args(p)
    # Room for the largest batch plus a mixed step's new request, in blocks and tokens; the
    # null-forward model's KV takes 4 KiB a block.
    p.set_defaults(
        func=main,
        dtype="bfloat16",
        max_num_seqs=513,
        max_num_batched_tokens=1024,
        kv_cache_memory=64 << 20,
    )


def _check(args: argparse.Namespace) -> None:
    for name in ("steps", "prompt_len", "chunk_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1.")
    if min(args.batch_sizes) < 1:
        raise ValueError("--batch-sizes must be >= 1.")
    largest = max(args.batch_sizes)
    if args.max_num_seqs < largest + 1:
        raise ValueError(
            f"--max-num-seqs {args.max_num_seqs} leaves no room for a batch of {largest} and a "
            f"mixed step's new request: raise it to {largest + 1}."
        )
    if args.max_num_batched_tokens < largest + args.chunk_len:
        raise ValueError(
            f"--max-num-batched-tokens {args.max_num_batched_tokens} cannot hold {largest} "
            f"decodes and a chunk of {args.chunk_len}: raise it to {largest + args.chunk_len}."
        )
    if args.distributed_executor_backend != "uni" or args.engine_core_process:
        raise ValueError(
            "bench overhead times the phases in its own process: leave "
            "--distributed-executor-backend uni and --engine-core-process off."
        )


def main(args: argparse.Namespace) -> int:
    from quire.engine_args import EngineArgs
    from quire.entrypoints.llm import LLM

    _check(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            path = os.path.join(tmp, "null-forward")
            args.model = build_null_forward_model(path, args.tokenizer)
            model_name = "null-forward (1 layer, hidden 64, vocabulary 49152)"
        else:
            model_name = args.model
        engine = LLM.from_engine_config(
            EngineArgs.from_cli_args(args).create_engine_config()
        ).engine
    largest = max(args.batch_sizes)
    tokens_per_request = args.prompt_len + 2 * (args.steps + _WARMUP_STEPS) + 2
    blocks = largest * -(-tokens_per_request // args.block_size) + 2 * args.chunk_len
    if engine.num_kv_blocks < blocks:
        raise ValueError(
            f"The KV pool holds {engine.num_kv_blocks} blocks; a batch of {largest} needs about "
            f"{blocks}: raise --kv-cache-memory or --num-kv-blocks."
        )
    output_kind = RequestOutputKind.CUMULATIVE if args.stream else RequestOutputKind.FINAL_ONLY
    timer = PhaseTimer(PHASES)
    rng = random.Random(args.seed)
    results = []
    with timer.timing():
        for batch_size in args.batch_sizes:
            for kind in KINDS:
                results.append(
                    measure(
                        engine,
                        timer,
                        batch_size,
                        kind,
                        args.steps,
                        args.prompt_len,
                        args.chunk_len,
                        args.temperature,
                        output_kind,
                        rng,
                    )
                )
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    sampling += ", streamed" if args.stream else ", outputs at the end"
    print(
        f"host time per step (µs, mean of {args.steps} steps): {model_name}, {sampling}, "
        f"{engine.config.device}, prompts of {args.prompt_len} tokens, mixed steps with a "
        f"prompt chunk of {args.chunk_len}; per req: the step over the batch size"
    )
    print(report(results))
    if args.output_json:
        result = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "model": model_name,
            "device": engine.config.device,
            "temperature": args.temperature,
            "stream": args.stream,
            "prompt_len": args.prompt_len,
            "chunk_len": args.chunk_len,
            "phases": PHASES,
            "results": [
                asdict(r) | {"per_request_step_us": r.per_request_step_us} for r in results
            ],
        }
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.output_json}", file=sys.stderr)
    engine.shutdown()
    return 0

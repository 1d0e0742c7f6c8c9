"""`quire bench latency`: prefill time for one prompt, and decode step time at batch 1 and batch B,
each against its roofline on this machine.

A decode step's floor is the bytes it moves (the weights once plus every request's K/V context)
over the memory bandwidth; a prefill's floor is its FLOPs over the bf16 matmul peak
(quire.bench.roofline). On a shared machine both swing from second to second (here 25-73 GB/s
of read bandwidth within one run), so each timed step or prefill is followed at once by a probe
of the machine (a read of 512 MB, a 2048^3 matmul), and the fraction of roofline reported is the
median over the measurements of floor / measured, each floor from its own probe: a ratio taken in
one moment, as the project's benchmarks take every comparison. 1.0 is the roofline. A decode
step's FLOPs at the matmul peak measured at the start are printed beside it: where a step is
compute-bound (large batches where FMAs are few, as on CPUs without AVX-512) that is its floor.

`--grammar-rounds N` then measures what structured outputs cost a decode step: N rounds, each a
decode without a grammar and then with a JSON-schema grammar on every request (GRAMMAR_SCHEMA,
long enough never to end within the steps), at batch 1 and batch B; the overhead is each round's
ratio of median step times, reported as the median over the rounds and their spread.

`--lora-mix a,b,base` (with `--enable-lora --lora-modules a=PATH b=PATH`) then times the decodes
again with request i running the i-th name of the mix round-robin (`base`: no adapter), and
reports each step time against the base model's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from quire.bench import roofline
from quire.bench.models import add_model_dir_arg, resolve_model
from quire.bench.perplexity import prose_perplexity
from quire.bench.speculative import describe_spec_decoding, spec_decoding_report
from quire.bench.throughput import parse_lora_mix
from quire.kernels import cpu as cpu_kernels
from quire.kernels import kv_format
from quire.kernels.cpu import gemv, qmatmul
from quire.model import gguf_loader, loader

_WARMUP_DECODE_STEPS = 2
# Objects, bounded strings and integers, enums, arrays: a grammar whose states vary as a real
# schema's do, with at least 40 items so that it cannot end within the timed steps.
GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["red", "green", "blue"]},
                        "maxItems": 3,
                    },
                },
                "required": ["name", "age", "tags"],
            },
        }
    },
    "required": ["people"],
}


@dataclass
class PrefillResult:
    prompt_len: int
    seconds: float  # median over the iterations
    flops: int
    matmul_tflops: float  # median of the probes taken right after each prefill
    roofline_seconds: float  # flops at that median peak
    roofline_fraction: float  # median over the iterations of (flops / its probe) / its time


@dataclass
class DecodeResult:
    batch_size: int
    steps: int
    step_seconds: float  # mean over the timed steps
    median_step_seconds: float
    mean_context_len: float
    bytes_per_step: float  # mean over the timed steps
    read_gbps: float  # median of the probes taken right after each step
    min_read_gbps: float
    max_read_gbps: float
    roofline_seconds: float  # per step, mean bytes at the median bandwidth
    roofline_fraction: float  # median over the steps of (bytes / its probe) / its time
    tokens_per_step: float  # mean generated tokens: the batch size, more under speculation
    flops_per_step: float  # mean over the timed steps: projections, LM head, attention

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_seconds


def _compute_floor(d: DecodeResult, hardware: roofline.Hardware) -> float:
    """A decode step's FLOPs at the machine's matmul peak: the floor where a step is
    compute-bound (large batches on a CPU without AVX-512, whose FMAs are few)."""
    return d.flops_per_step / (hardware.matmul_tflops * 1e12)


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(min(vocab_size, 10000)) for _ in range(length)]


def measure_prefill(
    engine, prompt_len: int, num_iters: int, probe: roofline.MatmulProbe, rng: random.Random
) -> PrefillResult:
    """Time from adding one request (a fresh random prompt, so nothing is cached) to its first
    token, after one warm-up; each timed prefill is followed by a matmul probe."""
    from quire.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    flops = roofline.prefill_flops(engine.model_config, prompt_len)
    times, peaks = [], []
    for i in range(num_iters + 1):
        prompt = _random_prompt(rng, prompt_len, engine.model_config.vocab_size)
        start = time.perf_counter()
        engine.add_request(f"prefill-{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
        peaks.append(probe.tflops())
    times, peaks = times[1:], peaks[1:]
    peak = statistics.median(peaks)
    fraction = statistics.median(
        roofline.roofline_fraction(flops / (p * 1e12), t) for p, t in zip(peaks, times)
    )
    return PrefillResult(
        prompt_len, statistics.median(times), flops, peak, flops / (peak * 1e12), fraction
    )


def measure_decode(
    engine,
    batch_size: int,
    prompt_len: int,
    num_steps: int,
    probe: roofline.BandwidthProbe,
    rng: random.Random,
    structured_outputs=None,
    weight_bytes: int | None = None,
    loras: list | None = None,
) -> DecodeResult:
    """Prefills `batch_size` requests, then times `num_steps` steps in which every request
    decodes one token (or, under speculation, what it verifies: `tokens_per_step` counts them,
    while the floor still counts one token per request), each followed by a bandwidth probe. A
    step's floor uses the requests' context lengths at that step and `weight_bytes` (default:
    every weight in the model's dtype). `structured_outputs` constrains every request; request
    i runs the adapter loras[i % len] (LoRARequests, None for the base model) if given."""
    from quire.sampling_params import SamplingParams

    mc, dtype = engine.model_config, engine.dtype
    kv_dtype = kv_format.cache_dtype(engine.config.kv_cache_dtype, dtype, c_decode=True)
    params = SamplingParams(
        temperature=0.0, max_tokens=None, ignore_eos=True, structured_outputs=structured_outputs
    )
    ids = [f"decode-{batch_size}-{i}" for i in range(batch_size)]
    num_output = dict.fromkeys(ids, 0)
    for i, request_id in enumerate(ids):
        lora = loras[i % len(loras)] if loras else None
        prompt = _random_prompt(rng, prompt_len, mc.vocab_size)
        engine.add_request(request_id, prompt, params, lora_request=lora)

    def step() -> None:
        outputs = engine.step()
        for out in outputs:
            num_output[out.request_id] = len(out.outputs[0].token_ids)

    while min(num_output.values()) == 0:
        step()
    for _ in range(_WARMUP_DECODE_STEPS):
        step()
    times, step_bytes, step_flops, contexts, bandwidths = [], [], [], [], []
    num_before = sum(num_output.values())
    for _ in range(num_steps):
        # Each request attends to its prompt plus every output token (the newest is computed now).
        context_lens = [prompt_len + n for n in num_output.values()]
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        bandwidths.append(probe.read_gbps())
        step_bytes.append(
            roofline.decode_step_bytes(mc, dtype, context_lens, weight_bytes, kv_dtype)
        )
        step_flops.append(roofline.decode_step_flops(mc, context_lens))
        contexts.append(statistics.fmean(context_lens))
    tokens_per_step = (sum(num_output.values()) - num_before) / num_steps
    engine.abort_request(ids)
    bandwidth = statistics.median(bandwidths)
    fraction = statistics.median(
        roofline.roofline_fraction(n / (b * 1e9), t)
        for n, b, t in zip(step_bytes, bandwidths, times)
    )
    bytes_per_step = statistics.fmean(step_bytes)
    return DecodeResult(
        batch_size,
        num_steps,
        statistics.fmean(times),
        statistics.median(times),
        statistics.fmean(contexts),
        bytes_per_step,
        bandwidth,
        min(bandwidths),
        max(bandwidths),
        bytes_per_step / (bandwidth * 1e9),
        fraction,
        tokens_per_step,
        statistics.fmean(step_flops),
    )


@dataclass
class GrammarOverhead:
    batch_size: int
    rounds: int
    step_seconds: float  # median over the rounds of each round's median step, no grammar
    grammar_step_seconds: float  # the same with the grammar
    overhead: float  # median over the rounds of (grammar / no grammar) - 1
    min_overhead: float
    max_overhead: float


def measure_grammar_overhead(
    engine,
    batch_size: int,
    prompt_len: int,
    num_steps: int,
    num_rounds: int,
    probe: roofline.BandwidthProbe,
    rng: random.Random,
) -> GrammarOverhead:
    """Interleaved rounds of decode steps without, then with, GRAMMAR_SCHEMA on every request."""
    from quire.sampling_params import StructuredOutputsParams

    grammar = StructuredOutputsParams(json=GRAMMAR_SCHEMA)
    plain, constrained = [], []
    for _ in range(num_rounds):
        for constraint, times in ((None, plain), (grammar, constrained)):
            result = measure_decode(
                engine, batch_size, prompt_len, num_steps, probe, rng, constraint
            )
            times.append(result.median_step_seconds)
    ratios = [g / p - 1.0 for p, g in zip(plain, constrained)]
    return GrammarOverhead(
        batch_size,
        num_rounds,
        statistics.median(plain),
        statistics.median(constrained),
        statistics.median(ratios),
        min(ratios),
        max(ratios),
    )


def _weight_bytes(config, mc, dtype: torch.dtype) -> int:
    """The weight bytes of a decode step: a GGUF file's kept blocks as stored (the loader's
    choice for this engine), `--quantization int8`'s blocks (Q8_0: 34 bytes per 32 weights), every
    other weight in `dtype`."""
    if config.quantization == "int8":
        block_bytes = qmatmul.GGUF_BLOCK_BYTES["Q8_0"]
        return roofline.decode_weight_bytes(mc, torch.int8) * block_bytes // qmatmul.QBLOCK
    if not config.is_gguf:
        return roofline.decode_weight_bytes(mc, dtype)
    kept = loader.kept_quantized_types(config, dtype)
    return gguf_loader.decode_weight_bytes(config.model, kept, dtype.itemsize)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from quire.engine_args import EngineArgs

    p = subparsers.add_parser(
        "latency",
        help="prefill and decode step time against the memory / compute roofline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompt-len", type=int, default=512, help="tokens of the timed prompt")
    p.add_argument("--batch-size", type=int, default=32, help="B of the batch-B decode")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch")
    p.add_argument("--num-iters", type=int, default=3, help="timed prefills")
    p.add_argument(
        "--grammar-rounds",
        type=int,
        default=0,
        help="rounds of decode without / with a JSON-schema grammar (0: skip)",
    )
    p.add_argument(
        "--lora-mix",
        default=None,
        metavar="NAMES",
        help="also time the decodes with these adapters of --lora-modules round-robin over the "
        "batch, comma-separated, base for none (e.g. a,b,base)",
    )
    p.add_argument(
        "--perplexity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the model's perplexity over a fixed English text (quire/bench/perplexity.py)",
    )
    p.add_argument(
        "--output-json",
        default=None,
        metavar="PATH",
        help="also write the report to this JSON file (default: none, the summary only)",
    )
    add_model_dir_arg(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=main, dtype="bfloat16")


def main(args: argparse.Namespace) -> int:
    from quire.engine_args import EngineArgs
    from quire.entrypoints.llm import LLM

    for name in ("prompt_len", "batch_size", "decode_steps", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1.")
    if args.grammar_rounds < 0:
        raise ValueError("--grammar-rounds must be >= 0.")
    args.model = resolve_model(args.model, args.model_dir)
    engine = LLM.from_engine_config(EngineArgs.from_cli_args(args).create_engine_config()).engine
    lora_mix = parse_lora_mix(args.lora_mix, engine)
    mc, dtype, device = engine.model_config, engine.dtype, engine.config.device
    hardware = roofline.measure_hardware(device, dtype)
    rng = random.Random(args.seed)
    prefill = measure_prefill(
        engine, args.prompt_len, args.num_iters, roofline.MatmulProbe(device, dtype), rng
    )
    bandwidth_probe = roofline.BandwidthProbe(device, huge_pages=engine.config.huge_pages)
    batch_sizes = sorted({1, args.batch_size})
    weight_bytes = _weight_bytes(engine.config, mc, dtype)
    decodes = [
        measure_decode(
            engine, b, args.prompt_len, args.decode_steps, bandwidth_probe, rng, None, weight_bytes
        )
        for b in batch_sizes
    ]
    lora_decodes = []
    if lora_mix:
        loras = [None if name == "base" else engine.get_lora(name) for name in lora_mix]
        lora_decodes = [
            measure_decode(
                engine,
                b,
                args.prompt_len,
                args.decode_steps,
                bandwidth_probe,
                rng,
                None,
                weight_bytes,
                loras,
            )
            for b in batch_sizes
        ]

    grammar = [
        measure_grammar_overhead(
            engine, b, args.prompt_len, args.decode_steps, args.grammar_rounds, bandwidth_probe, rng
        )
        for b in (batch_sizes if args.grammar_rounds else [])
    ]

    accuracy = prose_perplexity(engine) if args.perplexity else None
    kept = loader.kept_quantized_types(engine.config, dtype)
    if kept:
        kept &= gguf_loader.matrix_types(engine.config.model)
    weights = f"{weight_bytes / 1e9:.2f} GB read per step, {str(dtype).removeprefix('torch.')}"
    if kept:
        weights += f" with {'/'.join(sorted(kept))} blocks kept"
    elif engine.config.quantization == "int8":
        weights += " with int8 (Q8_0) blocks"
    print(
        f"model: {engine.config.model} ({roofline.num_params(mc) / 1e6:.0f}M params, "
        f"{weights}), KV cache {engine.config.kv_cache_dtype}, {device}, "
        f"{torch.get_num_threads()} threads\n"
        + (
            f"perplexity {accuracy[0]:.3f} over {accuracy[1]} tokens of a fixed English text\n"
            if accuracy
            else ""
        )
        + (
            f"quire's kernels: bf16 matmul {gemv.path()}, GGUF blocks {qmatmul.path()} "
            f"(prompt rows {qmatmul.prompt_path()}), "
            f"decode attention {cpu_kernels.decode_attention_path()}, "
            f"prefill attention {cpu_kernels.prefill_attention_path()}\n"
            if device == "cpu"
            else ""
        )
        + f"machine at the start: read {hardware.read_gbps:.1f} GB/s, copy "
        f"{hardware.copy_gbps:.1f} GB/s, matmul {hardware.matmul_tflops:.3f} TFLOP/s\n"
        f"prefill {prefill.prompt_len} tokens: {prefill.seconds * 1e3:.1f} ms (median), "
        f"{prefill.flops / 1e12:.3f} TFLOP; matmul {prefill.matmul_tflops:.3f} TFLOP/s "
        f"alongside, floor {prefill.roofline_seconds * 1e3:.1f} ms "
        f"-> {prefill.roofline_fraction:.1%} of the compute roofline"
    )
    for d in decodes:
        print(
            f"decode batch {d.batch_size} (context ~{d.mean_context_len:.0f}): "
            f"{d.step_seconds * 1e3:.2f} ms/step (median {d.median_step_seconds * 1e3:.2f}), "
            f"{d.tokens_per_s:.1f} tok/s, {d.bytes_per_step / 1e6:.1f} MB/step; read "
            f"{d.read_gbps:.1f} GB/s alongside ({d.min_read_gbps:.1f}-{d.max_read_gbps:.1f}), "
            f"floor {d.roofline_seconds * 1e3:.2f} ms "
            f"-> {d.roofline_fraction:.1%} of the memory roofline; "
            f"{d.flops_per_step / 1e9:.2f} GFLOP, compute floor "
            f"{_compute_floor(d, hardware) * 1e3:.2f} ms at the start's matmul peak "
            f"-> {_compute_floor(d, hardware) / d.median_step_seconds:.1%}"
        )
    for d, base in zip(lora_decodes, decodes):
        print(
            f"decode batch {d.batch_size} with LoRA mix {args.lora_mix}: "
            f"{d.step_seconds * 1e3:.2f} ms/step (median {d.median_step_seconds * 1e3:.2f}), "
            f"{d.tokens_per_s:.1f} tok/s, {d.tokens_per_s / base.tokens_per_s:.2f}x the base model"
        )
    for d in decodes if engine.spec_decoding_stats is not None else []:
        print(
            f"decode batch {d.batch_size}: {d.tokens_per_step / d.batch_size:.2f} tokens per request a step"
        )
    describe_spec_decoding(engine)
    for g in grammar:
        print(
            f"grammar batch {g.batch_size}: {g.step_seconds * 1e3:.2f} -> "
            f"{g.grammar_step_seconds * 1e3:.2f} ms/step, overhead {g.overhead:+.1%} (median of "
            f"{g.rounds} rounds, {g.min_overhead:+.1%} to {g.max_overhead:+.1%})"
        )
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "model": engine.config.model,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": engine.config.quantization,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "decode_weight_bytes": weight_bytes,
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "num_params": roofline.num_params(mc),
        "hardware": asdict(hardware),
        "prefill": asdict(prefill),
        "decode": [
            asdict(d)
            | {
                "tokens_per_s": d.tokens_per_s,
                "compute_floor_seconds": _compute_floor(d, hardware),
            }
            for d in decodes
        ],
        "grammar": [asdict(g) for g in grammar],
    }
    if lora_mix:
        report["lora_mix"] = lora_mix
        report["lora_decode"] = [asdict(d) | {"tokens_per_s": d.tokens_per_s} for d in lora_decodes]
    if accuracy:
        report["perplexity"] = {"value": accuracy[0], "tokens": accuracy[1]}
    spec = spec_decoding_report(engine)
    if spec is not None:
        report["spec_decoding"] = spec
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0

"""`quire bench throughput`: offline throughput on nano-vllm's workload, and the same workload
through transformers on the same weights in the same run (`--compare transformers`).

The workload: N requests of random prompt token ids (ids below 10,000), prompt and output
lengths uniform in the given ranges, greedy, `ignore_eos` (every request generates exactly its
output length), a fixed seed. A smaller `--num-requests` takes the first N requests of the same
seeded stream, so a scaled-down run is a prefix of the full one.

    W1: SmolLM2-135M (the default model), 256 requests, prompts 100-1024, outputs 100-512
    W2: a random Qwen3-0.6B-shaped model (quire.bench.models), 64 requests, prompts 100-512,
        outputs 64-256

`--lora-mix a,b,base` (with `--enable-lora --lora-modules a=PATH b=PATH`) runs the workload a
second time in the same run, request i with the i-th name of the mix round-robin (`base`: no
adapter), after the prefix cache is reset, and reports its output tok/s over the base model's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from quire.bench import roofline
from quire.bench.models import QWEN3_RANDOM, add_model_dir_arg, resolve_model
from quire.bench.speculative import describe_spec_decoding, spec_decoding_report
from quire.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

# nano-vllm's bench.py draws prompt token ids from [0, 10000].
_MAX_TOKEN_ID = 10000
_HF_MODES = ("generate", "continuous")


@dataclass(frozen=True)
class Workload:
    model: str | None  # None: the engine's default model
    num_requests: int
    input_len: tuple[int, int]  # inclusive range
    output_len: tuple[int, int]


WORKLOADS = {
    "w1": Workload(None, 256, (100, 1024), (100, 512)),
    "w2": Workload(QWEN3_RANDOM, 64, (100, 512), (64, 256)),
}


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class ThroughputResult:
    engine: str  # "quire", "transformers generate (batch 16)", "transformers continuous batching"
    requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, object]:
        return asdict(self) | {
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }


def make_requests(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    vocab_size: int,
) -> list[BenchRequest]:
    """The seeded workload; the first k requests are the same for every num_requests >= k."""
    rng = random.Random(seed)
    max_id = min(_MAX_TOKEN_ID, vocab_size - 1)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*input_len)
        prompt = [rng.randint(0, max_id) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, rng.randint(*output_len)))
    return requests


def _result(
    engine: str, requests: list[BenchRequest], output_tokens: int, elapsed: float
) -> ThroughputResult:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return ThroughputResult(engine, len(requests), prompt_tokens, output_tokens, elapsed)


def _check_output_tokens(engine: str, requests: list[BenchRequest], output_tokens: int) -> None:
    expected = sum(r.output_len for r in requests)
    if output_tokens != expected:
        raise RuntimeError(
            f"{engine} generated {output_tokens} output tokens, the workload asks for {expected}: "
            "is max_model_len too small for the longest request?"
        )


# ---- quire -----------------------------------------------------------------------------------
def run_quire(
    llm, requests: list[BenchRequest], lora_mix: list[str] | None = None
) -> ThroughputResult:
    """Times `LLM.generate` over the whole workload after a short warm-up; with `lora_mix`,
    request i runs the adapter named lora_mix[i % len] (`base`: none)."""
    from quire.sampling_params import SamplingParams

    loras = None
    engine = "quire"
    if lora_mix:
        adapters = [None if name == "base" else llm.engine.get_lora(name) for name in lora_mix]
        loras = [adapters[i % len(adapters)] for i in range(len(requests))]
        engine = f"quire, LoRA mix {','.join(lora_mix)}"
    warm_up = SamplingParams(max_tokens=4)
    for lora in dict.fromkeys(loras or [None]):
        llm.generate([list(range(1, 17))], warm_up, use_tqdm=False, lora_request=lora)
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, lora_request=loras)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    _check_output_tokens(engine, requests, output_tokens)
    return _result(engine, requests, output_tokens, elapsed)


def parse_lora_mix(text: str | None, engine) -> list[str] | None:
    """`--lora-mix a,b,base` as names, each an adapter the engine loaded or `base`; ValueError
    naming what to load otherwise."""
    if text is None:
        return None
    names = text.split(",")
    loaded = {r.lora_name for r in engine.list_loras()}
    unknown = [name for name in names if name != "base" and name not in loaded]
    if unknown or not all(names):
        raise ValueError(
            f"--lora-mix {text}: each name must be an adapter of --lora-modules "
            f"({', '.join(sorted(loaded)) or 'none loaded'}) or base; load "
            f"{', '.join(unknown) or 'the adapters'} with --enable-lora --lora-modules NAME=PATH."
        )
    return names


# ---- transformers ----------------------------------------------------------------------------
def load_hf_model(model_path: str, dtype: torch.dtype):
    """The same checkpoint through transformers (a GGUF file is dequantized, as quire does)."""
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(model_path)),
            gguf_file=os.path.basename(model_path),
            dtype=dtype,
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


def run_hf_generate(model, requests: list[BenchRequest], batch_size: int) -> ThroughputResult:
    """Static batching, `generate`'s best use: requests sorted by prompt length, batches padded on
    the left with an attention mask, greedy; a batch runs until its longest output is done
    (min_new_tokens = max_new_tokens, the `ignore_eos` equivalent), so only the tokens each
    request asked for count as output."""
    from transformers import GenerationConfig

    pad_id = 0
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_token_ids))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def generate(batch: list[BenchRequest]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [batch, width]
        attention_mask = torch.zeros_like(input_ids)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            input_ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, width - n :] = 1
        new_tokens = max(r.output_len for r in batch)
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
            eos_token_id=model.config.eos_token_id,
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=attention_mask.to(model.device),
                generation_config=config,
            )
        assert out.shape[1] == width + new_tokens

    generate([BenchRequest(list(range(1, 17)), 4)] * 2)  # warm-up
    start = time.perf_counter()
    for batch in tqdm(batches, desc="transformers generate", unit="batch"):
        generate([requests[i] for i in batch])
    elapsed = time.perf_counter() - start
    output_tokens = sum(r.output_len for r in requests)
    return _result(f"transformers generate (batch {batch_size})", requests, output_tokens, elapsed)


def run_hf_continuous(model, requests: list[BenchRequest]) -> ThroughputResult:
    """transformers' continuous batching (ContinuousBatchingManager), one request per workload
    request with its own max_new_tokens and EOS off (eos_token_id=-1), greedy. Its paged cache
    holds the whole workload at once (no preemption), and is not sized from free memory: a
    cache of most of the RAM takes seconds to set up and is never used."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    max_new = max(r.output_len for r in requests)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1)
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
        max_generated_length=max_new,
        num_requests=len(requests),
    )
    page = ContinuousBatchingConfig.page_size
    pages = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in requests)
    cb_config = ContinuousBatchingConfig(num_blocks=pages + 1)
    output_tokens = 0
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, workload_hints=hints
    ) as manager:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(
                r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len, eos_token_id=-1
            )
        bar = tqdm(total=len(requests), desc="transformers continuous batching", unit="req")
        while bar.n < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped early.")
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers continuous batching failed: {result.error}")
            if result.is_finished():
                output_tokens += len(result.generated_tokens)
                bar.update(1)
        elapsed = time.perf_counter() - start
        bar.close()
    engine = "transformers continuous batching"
    _check_output_tokens(engine, requests, output_tokens)
    return _result(engine, requests, output_tokens, elapsed)


def run_transformers(
    model_path: str,
    dtype: torch.dtype,
    device: str,
    requests: list[BenchRequest],
    modes: list[str],
    batch_size: int,
) -> list[ThroughputResult]:
    model = load_hf_model(model_path, dtype).to(device)
    results = []
    for mode in modes:
        if mode == "generate":
            results.append(run_hf_generate(model, requests, batch_size))
        else:
            results.append(run_hf_continuous(model, requests))
    return results


# ---- the command -----------------------------------------------------------------------------
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from quire.engine_args import EngineArgs

    p = subparsers.add_parser(
        "throughput",
        help="offline throughput on a random-prompt workload, optionally vs transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", default="w1", choices=sorted(WORKLOADS), help="preset (W1, W2)")
    p.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    p.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="prompt tokens, drawn uniformly (default: the workload's)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="output tokens, drawn uniformly (default: the workload's)",
    )
    p.add_argument(
        "--lora-mix",
        default=None,
        metavar="NAMES",
        help="also run the workload with these adapters of --lora-modules round-robin over the "
        "requests, comma-separated, base for none (e.g. a,b,base), and report it against the "
        "base model",
    )
    p.add_argument(
        "--compare",
        choices=["transformers"],
        default=None,
        help="run the same workload through transformers on the same weights",
    )
    p.add_argument(
        "--hf-mode",
        default="auto",
        choices=["auto", *_HF_MODES],
        help="transformers path: batched generate, continuous batching, or auto (both; the "
        "faster is the one compared)",
    )
    p.add_argument("--hf-batch-size", type=int, default=16, help="batch size of generate")
    p.add_argument(
        "--roofline",
        action="store_true",
        help="also measure this machine's bandwidth and matmul peak and print the workload's "
        "floor: the time no engine can beat here, and the fraction of it each engine reached",
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


def _check_args(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len"):
        bounds = getattr(args, name)
        if bounds is not None and not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {bounds}.")
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}.")
    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}.")


def _print_table(results: list[ThroughputResult]) -> None:
    width = max(36, *(len(r.engine) + 2 for r in results))
    header = (
        f"{'engine':<{width}}{'requests':>9}{'prompt tok':>12}{'output tok':>12}"
        f"{'time (s)':>10}{'out tok/s':>11}{'total tok/s':>12}"
    )
    print(header)
    for r in results:
        print(
            f"{r.engine:<{width}}{r.requests:>9}{r.prompt_tokens:>12}{r.output_tokens:>12}"
            f"{r.elapsed_s:>10.1f}{r.output_tokens_per_s:>11.1f}{r.total_tokens_per_s:>12.1f}"
        )


def _print_floor(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: str,
    requests: list[BenchRequest],
    results: list[ThroughputResult],
) -> dict[str, object]:
    """Prints the workload's roofline floor and each engine's fraction of it; returns them."""
    hardware = roofline.measure_hardware(device, dtype)
    prefill_s, decode_s = roofline.workload_floor_seconds(
        model_config,
        dtype,
        [len(r.prompt_token_ids) for r in requests],
        [r.output_len for r in requests],
        hardware,
    )
    floor = prefill_s + decode_s
    print(
        f"roofline floor {floor:.1f} s (prefill {prefill_s:.1f} s + decode {decode_s:.1f} s) at "
        f"read {hardware.read_gbps:.1f} GB/s, matmul {hardware.matmul_tflops:.3f} TFLOP/s; "
        + ", ".join(f"{r.engine} {floor / r.elapsed_s:.1%} of it" for r in results)
    )
    return {
        "read_gbps": hardware.read_gbps,
        "matmul_tflops": hardware.matmul_tflops,
        "floor_prefill_s": prefill_s,
        "floor_decode_s": decode_s,
        "fraction": {r.engine: floor / r.elapsed_s for r in results},
    }


def main(args: argparse.Namespace) -> int:
    from quire.engine_args import EngineArgs
    from quire.entrypoints.llm import LLM

    _check_args(args)
    workload = WORKLOADS[args.workload]
    args.model = resolve_model(args.model or workload.model, args.model_dir)
    num_requests = args.num_requests or workload.num_requests
    input_len = tuple(args.input_len or workload.input_len)
    output_len = tuple(args.output_len or workload.output_len)

    llm = LLM.from_engine_config(EngineArgs.from_cli_args(args).create_engine_config())
    engine = llm.engine
    lora_mix = parse_lora_mix(args.lora_mix, engine)
    requests = make_requests(
        num_requests, input_len, output_len, args.seed, engine.model_config.vocab_size
    )
    # Scaling is against the preset; other length ranges make a custom workload.
    preset = (input_len, output_len) == (workload.input_len, workload.output_len)
    name = args.workload if preset else "custom"
    scale = num_requests / workload.num_requests if preset else None
    print(
        f"workload {name}: {num_requests} requests"
        + (f" (scaled x{scale:.3g} from {workload.num_requests})" if scale not in (None, 1) else "")
        + f", prompts {input_len[0]}-{input_len[1]}, outputs {output_len[0]}-{output_len[1]}, "
        f"seed {args.seed}, {str(engine.dtype).removeprefix('torch.')}, {engine.config.device}, "
        f"{torch.get_num_threads()} threads\nmodel: {engine.config.model}",
        file=sys.stderr,
    )
    results = [run_quire(llm, requests)]
    if lora_mix:
        engine.reset_prefix_cache()  # the mix's base requests must not hit the first run's blocks
        results.append(run_quire(llm, requests, lora_mix))
    spec_decoding = spec_decoding_report(engine)
    describe_spec_decoding(engine)
    model_path, dtype, device = engine.config.model, engine.dtype, engine.config.device
    model_config = engine.model_config
    del llm, engine
    gc.collect()

    hf_results: list[ThroughputResult] = []
    if args.compare == "transformers":
        modes = list(_HF_MODES) if args.hf_mode == "auto" else [args.hf_mode]
        hf_results = run_transformers(
            model_path, dtype, device, requests, modes, args.hf_batch_size
        )
        results += hf_results
    _print_table(results)

    report: dict[str, object] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": device,
        },
        "workload": {
            "name": name,
            "model": model_path,
            "dtype": str(dtype).removeprefix("torch."),
            "num_requests": num_requests,
            "scale": scale,
            "input_len": list(input_len),
            "output_len": list(output_len),
            "seed": args.seed,
            "lora_mix": lora_mix,
        },
        "results": [r.to_dict() for r in results],
    }
    if lora_mix:
        ratio = results[1].output_tokens_per_s / results[0].output_tokens_per_s
        report["ratio_lora_mix_over_base"] = ratio
        print(f"LoRA mix / base model: {ratio:.2f}x output tokens/s")
    if spec_decoding is not None:
        report["spec_decoding"] = spec_decoding
    if args.roofline:
        report["roofline"] = _print_floor(model_config, dtype, device, requests, results)
    if hf_results:
        best = max(hf_results, key=lambda r: r.output_tokens_per_s)
        ratio = results[0].output_tokens_per_s / best.output_tokens_per_s
        report["transformers_best"] = best.engine
        report["ratio_quire_over_transformers"] = ratio
        print(f"quire / transformers ({best.engine}, the faster): {ratio:.2f}x output tokens/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0

"""The `quire` command: generate (one-shot generation); more subcommands register below."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from quire.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig knobs, shared by every subcommand that runs a model."""
    defaults = EngineConfig.__dataclass_fields__
    parser.add_argument(
        "--model",
        default=None,
        help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=defaults["block_size"].default)
    parser.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"].default)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults["max_num_batched_tokens"].default
    )
    parser.add_argument(
        "--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false"
    )
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument(
        "--kv-cache-memory", type=int, default=None, help="bytes for the KV pool on CPU"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4 '
        '(or "auto"), "prompt_lookup_min": 2, "prompt_lookup_max": 4}\'',
    )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        speculative_config=args.speculative_config,
    )


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate completions for one or more prompts")
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts batch together)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from quire.entrypoints.llm import LLM
    from quire.sampling_params import SamplingParams

    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed if args.temperature > 0 else None,
    )
    llm = LLM.from_engine_config(engine_config_from_args(args))
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for prompt, output in zip(args.prompt, outputs):
        for completion in output.outputs:
            num_tokens += len(completion.token_ids)
            print(f"--- prompt: {prompt!r}  [{completion.finish_reason}]")
            print(completion.text)
    print(
        f"--- {len(outputs)} prompts, {num_tokens} tokens in {elapsed:.2f} s "
        f"({num_tokens / elapsed:.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from quire.bench import latency, serve, speculative, throughput

    p = subparsers.add_parser("bench", help="benchmarks: throughput, latency, serve, speculative")
    benches = p.add_subparsers(dest="bench_command", required=True)
    for module in (throughput, latency, serve, speculative):
        module.add_parser(benches)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` (default: $QUIRE_API_KEY if set, else open)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: --model as given)",
    )
    p.add_argument("--disable-log-requests", action="store_true", help="no line per request")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    add_engine_args(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import os

    from quire.entrypoints.api_server import serve

    # The per-request and stats lines are INFO: shown unless --disable-log-requests/-stats.
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("quire").setLevel(logging.INFO)
    serve(
        engine_config_from_args(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("QUIRE_API_KEY"),
        served_model_name=args.served_model_name or args.model,
        log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats,
    )
    return 0


def _add_chat(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat with the model in the terminal")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="per reply")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    add_engine_args(p)
    p.set_defaults(func=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from quire.entrypoints.chat_cli import run_chat_from_args

    return run_chat_from_args(args, engine_config_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quire", description="quire: LLM inference and serving")
    parser.add_argument("--log-level", default="WARNING")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_chat(subparsers)
    _add_bench(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

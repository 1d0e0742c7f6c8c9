"""What a quantized KV cache costs in accuracy on a real model: perplexity from `prompt_logprobs`
over fixed texts, and greedy agreement with the bf16 cache, for each `--kv-cache-dtype`; with
`--speed`, its batch-1 decode step at a long context instead.

    python scripts/bench_kv_cache_dtype.py [--model PATH] [--dtypes auto int8 fp8 fp8_e5m2]
    python scripts/bench_kv_cache_dtype.py --speed [--prompt-len 4096] [--rounds 40]
    python scripts/bench_kv_cache_dtype.py --kernel [--shape smollm2|qwen3] [--layers 30]
    python scripts/bench_kv_cache_dtype.py --prefill [--prompt-len 4096] [--chunk 256]

`--speed`: one engine per dtype in one process, each prefilled with the same random prompt, then
rounds of one decode step on each engine in turn (order reversed every round, ABBA), so every
engine's steps share the host's moments; per dtype the median step, and per quantized dtype the
median over rounds of its step time over the bf16 (auto) engine's.

`--kernel`: the decode attention kernel alone, batch 1 at --prompt-len, on caches of the same
random K/V (SmolLM2's or Qwen3-0.6B's heads) for bf16 and each quantized dtype, --layers of them
called in turn (30: the KV does not stay in cache, as in a step; 1-4: hot), rounds interleaved
as above; per dtype the median time a layer and the median ratio to bf16's.

`--prefill`: a prompt chunk after a cached prefix: per dtype an engine with prefix caching
caches a --prompt-len prompt, then each round every engine in turn (ABBA) runs that prompt plus
--chunk new tokens (one token generated) and times it: the chunk's prefill reads the whole
context from the cache (in codes, for a quantized one), as a follow-up turn of a long chat does.

Texts: quire/bench/perplexity.py's prose (~200 tokens) and the first 2,048 tokens of
docs/ARCHITECTURE.md (a long context, where every token's keys are read by every later one).
Greedy agreement: 8 prompts x 64 generated tokens; reported as the share of positions generated
before a request's first token that differs from the bf16 cache's, and how many requests agree
to the end. Also the KV pool's tokens for a 256 MiB budget.
"""

from __future__ import annotations

import argparse
import os

from quire import LLM, SamplingParams
from quire.bench.perplexity import PROSE, perplexity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain how a refrigerator works in simple terms.",
    "List three benefits of regular exercise:",
    "Once upon a time, in a small village by the mountains,",
    "Translate to French: The weather is nice today.",
    "What is the difference between a list and a tuple in Python?",
]


def engines_by_dtype(args: argparse.Namespace, **settings) -> dict:
    """An engine per --dtypes entry (its KV cache dtype), 256 MiB of KV cache each."""
    return {
        name: LLM(args.model, kv_cache_dtype=name, kv_cache_memory=256 << 20, **settings).engine
        for name in args.dtypes
    }


def interleaved(names: list[str], rounds: int, run) -> dict[str, list[float]]:
    """`run(name, round)`'s seconds for every name each round, the order reversed every other
    round (ABBA), so that every name's runs share the host's moments."""
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(run(name, r))
    return times


def ratio_summary(times: list[float], base: list[float]) -> str:
    """The median and quartiles over rounds of each round's time over the base's."""
    import statistics

    ratios = [a / b for a, b in zip(times, base)]
    low, _, high = statistics.quantiles(ratios, n=4)
    return f"median of rounds {statistics.median(ratios):.3f}x (quartiles {low:.3f}-{high:.3f})"


def decode_speed(args: argparse.Namespace) -> None:
    import random
    import statistics
    import time

    engines = engines_by_dtype(args, max_model_len=args.prompt_len + args.rounds + 64)
    vocab = next(iter(engines.values())).model_config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.rounds + 16, ignore_eos=True)
    for engine in engines.values():
        engine.add_request("decode", prompt, params)
        for _ in range(4):  # the prefill (chunks), then warm-up decodes
            engine.step()

    def step(name: str, _: int) -> float:
        start = time.perf_counter()
        engines[name].step()
        return time.perf_counter() - start

    times = interleaved(list(engines), args.rounds, step)
    base = times[args.dtypes[0]]
    for name, t in times.items():
        print(
            f"{name:9s} decode step at context ~{args.prompt_len}: median "
            f"{statistics.median(t) * 1e3:.2f} ms (fastest {min(t) * 1e3:.2f}); "
            f"/ {args.dtypes[0]}: {ratio_summary(t, base)}, fastest steps "
            f"{min(t) / min(base):.3f}x",
            flush=True,
        )


def prefill_speed(args: argparse.Namespace) -> None:
    import random
    import statistics
    import time

    engines = engines_by_dtype(
        args,
        max_model_len=args.prompt_len + args.chunk + 16,
        max_num_batched_tokens=max(2048, args.chunk),
        enable_prefix_caching=True,
    )
    vocab = next(iter(engines.values())).model_config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(engine, request_id: str, prompt: list[int]) -> float:
        start = time.perf_counter()
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    for engine in engines.values():
        run(engine, "prefix", prefix)
    chunks = [[rng.randrange(10, vocab) for _ in range(args.chunk)] for _ in range(args.rounds)]
    times = interleaved(
        list(engines), args.rounds, lambda name, r: run(engines[name], f"r{r}", prefix + chunks[r])
    )
    base = times[args.dtypes[0]]
    for name, t in times.items():
        print(
            f"{name:9s} {args.chunk}-token chunk after a cached {args.prompt_len}: median "
            f"{statistics.median(t) * 1e3:.1f} ms; / {args.dtypes[0]}: {ratio_summary(t, base)}",
            flush=True,
        )


KERNEL_SHAPES = {"smollm2": (9, 3, 64), "qwen3": (16, 8, 128)}  # heads, KV heads, head_dim


def kernel_speed(args: argparse.Namespace) -> None:
    import statistics
    import time

    import torch

    from quire.kernels import cpu as cpu_kernels
    from quire.kernels import kv_format
    from quire.worker.kv_cache import KVCache

    heads, kv_heads, head_dim = KERNEL_SHAPES[args.shape]
    block, length = 16, args.prompt_len
    num_blocks = (length + block - 1) // block
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=gen).view(1, num_blocks).int()
    slots = (tables[0, :, None] * block + torch.arange(block)).flatten()[:length]
    k, v = (torch.randn(length, kv_heads, head_dim, generator=gen).bfloat16() for _ in "kv")
    q = torch.randn(1, heads, head_dim, generator=gen).bfloat16()
    lens = torch.tensor([length], dtype=torch.int32)
    caches = {}
    for name in ["auto", *(n for n in args.dtypes if n != "auto")]:
        dtype = kv_format.cache_dtype(kv_format.check_kv_cache_dtype(name), torch.bfloat16, True)
        cache = KVCache.allocate(args.layers, num_blocks, block, kv_heads, head_dim, dtype, "cpu")
        for k_cache, v_cache in cache.layers:
            if kv_format.is_quantized(dtype):
                cpu_kernels.store_kv(k, v, k_cache, v_cache, slots)
            else:
                k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots] = k, v
        caches[name] = cache

    def layers(name: str, _: int) -> float:
        start = time.perf_counter()
        for k_cache, v_cache in caches[name].layers:
            cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
        return (time.perf_counter() - start) / args.layers

    times = interleaved(list(caches), args.rounds, layers)
    for name, t in times.items():
        print(
            f"{name:9s} {args.shape} kernel at context {length}, {args.layers} layers, "
            f"{torch.get_num_threads()} threads: median {statistics.median(t) * 1e6:.1f} us a "
            f"layer; / bf16: {ratio_summary(t, times['auto'])}",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: quire's default model")
    parser.add_argument("--dtypes", nargs="+", default=["auto", "int8", "fp8", "fp8_e5m2"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speed", action="store_true", help="decode step time instead")
    parser.add_argument("--kernel", action="store_true", help="the decode kernel's time instead")
    parser.add_argument("--prefill", action="store_true", help="a chunk's prefill time instead")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--shape", choices=list(KERNEL_SHAPES), default="smollm2")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    if args.speed:
        decode_speed(args)
        return 0
    if args.kernel:
        kernel_speed(args)
        return 0
    if args.prefill:
        prefill_speed(args)
        return 0

    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md")) as f:
        architecture = f.read()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    reference = None
    for name in args.dtypes:
        llm = LLM(args.model, kv_cache_dtype=name, kv_cache_memory=256 << 20, max_model_len=4096)
        tokenizer = llm.get_tokenizer()
        texts = {
            "prose": tokenizer.encode(PROSE),
            "architecture-2048": tokenizer.encode(architecture)[:2048],
        }
        ppl = {key: perplexity(llm.engine, ids) for key, ids in texts.items()}
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        if reference is None:
            reference = outputs
        agreed = [
            next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o))
            for o, r in zip(outputs, reference)
        ]
        pool = llm.engine.num_kv_blocks * llm.engine.config.block_size
        print(
            f"{name:9s} pool {pool} tokens | perplexity "
            + ", ".join(f"{k} {v:.3f}" for k, v in ppl.items())
            + f" | greedy agreement {sum(agreed) / (len(outputs) * args.max_tokens):.1%} of "
            f"positions before the first difference, {sum(a == args.max_tokens for a in agreed)}"
            f"/{len(outputs)} requests identical",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

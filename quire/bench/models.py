"""Benchmark models: random-weight checkpoints shaped like Qwen3-0.6B (workload W2), like
SmolLM2-135M with 8 query and 2 KV heads (`smollm2-8h-random`: a shape two ranks can split, for
tensor parallelism), and a 2-layer model of SmolLM2's width and vocabulary
(`smollm2-draft-random`: a draft model for `quire bench speculative`, as SmolLM2 has no smaller
sibling).

    python -m quire.bench.models [--name smollm2-8h-random] [--model-dir DIR]

It also builds LoRA adapters for the multi-LoRA benchmarks: `--lora-adapters N` saves N PEFT
adapters of rank 16 on all seven modules (q, k, v, o, gate, up, down), random and non-zero
(`init_lora_weights=False`, seeds 0..N-1), for the base model `--base` (default: the default
model) in DIR/lora-0 .. DIR/lora-{N-1}, and prints the `--lora-modules` arguments that name them:

    python -m quire.bench.models --lora-adapters 8 --model-dir /tmp/adapters
    quire bench throughput --workload w1 --num-requests 8 --enable-lora --max-loras 8 \
        --lora-modules lora-0=/tmp/adapters/lora-0 ... --lora-mix lora-0,...,lora-7

The weights are random (seeded), saved in bfloat16 with SmolLM2's tokenizer, so the checkpoint
needs no download: it measures speed, not quality. Built once, then reused from the cache folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time

import torch

from quire import envs

logger = logging.getLogger(__name__)

QWEN3_RANDOM = "qwen3-0.6b-random"
SMOLLM2_8H_RANDOM = "smollm2-8h-random"
SMOLLM2_DRAFT_RANDOM = "smollm2-draft-random"
CACHE_DIR = os.path.join(envs.XDG_CACHE_HOME, "quire")
DEFAULT_MODEL_DIR = os.path.join(CACHE_DIR, QWEN3_RANDOM)

# Qwen3-0.6B's architecture (config.json of Qwen/Qwen3-0.6B).
QWEN3_0_6B_SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)

# SmolLM2-135M's shape (hidden 576, 30 layers, intermediate 1536, tied) with 8 query heads of
# 64 and 2 KV heads instead of 9 and 3, so that 1, 2, 4 and 8 ranks split it.
SMOLLM2_8H_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)

# SmolLM2-135M's width (its GGUF's metadata) with 2 of its 30 layers.
SMOLLM2_DRAFT_SHAPE = SMOLLM2_8H_SHAPE | dict(
    num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3
)

# name -> (architecture, model_type, shape)
RANDOM_MODELS = {
    QWEN3_RANDOM: ("Qwen3ForCausalLM", "qwen3", QWEN3_0_6B_SHAPE),
    SMOLLM2_8H_RANDOM: ("LlamaForCausalLM", "llama", SMOLLM2_8H_SHAPE),
    SMOLLM2_DRAFT_RANDOM: ("LlamaForCausalLM", "llama", SMOLLM2_DRAFT_SHAPE),
}


def build_qwen3_random(
    model_dir: str = DEFAULT_MODEL_DIR, seed: int = 0, tokenizer_source: str | None = None
) -> str:
    """The W2 checkpoint (scripts/gpu_checks.sh builds it with a saved tokenizer)."""
    return build_random_model(QWEN3_RANDOM, model_dir, seed, tokenizer_source)


def build_random_model(
    name: str, model_dir: str, seed: int = 0, tokenizer_source: str | None = None
) -> str:
    """The random checkpoint folder `name` (RANDOM_MODELS), built on first use. Built in a
    temporary folder next to `model_dir` and renamed into place, so an interrupted build is never
    reused. The tokenizer is the default model's, or the one saved at `tokenizer_source`."""
    model_dir = os.path.expanduser(model_dir)
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir
    from transformers import AutoConfig, AutoModelForCausalLM

    from quire.config import default_model_path
    from quire.model.tokenizer import load_tokenizer

    start = time.perf_counter()
    parent = os.path.dirname(os.path.abspath(model_dir))
    os.makedirs(parent, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_source or default_model_path())
    architecture, model_type, shape = RANDOM_MODELS[name]
    config = AutoConfig.for_model(
        model_type,
        architectures=[architecture],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        build_dir = os.path.join(tmp, "model")
        model.save_pretrained(build_dir)
        tokenizer.save_pretrained(build_dir)
        if os.path.isdir(model_dir):  # a leftover without config.json
            shutil.rmtree(model_dir)
        os.rename(build_dir, model_dir)
    num_params = sum(p.numel() for p in model.parameters())
    logger.warning(
        "Built %s (%.0fM random params, bfloat16) at %s in %.0f s",
        name,
        num_params / 1e6,
        model_dir,
        time.perf_counter() - start,
    )
    return model_dir


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapters(
    out_dir: str, count: int, base: str | None = None, rank: int = 16
) -> list[str]:
    """`count` PEFT adapters of `rank` on every module of LORA_MODULES with random (non-zero)
    A and B for checkpoint `base` (a folder or .gguf; default: the default model), seeded 0..,
    saved at out_dir/lora-I; returns their folders. Only the base's shape is read: the adapter's
    weights do not depend on the base's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from quire.config import default_model_path
    from quire.model.gguf_loader import load_gguf_config
    from quire.model.model_config import read_hf_config

    base = base or default_model_path()
    cfg = load_gguf_config(base) if base.endswith(".gguf") else read_hf_config(base)
    config = AutoConfig.for_model(**cfg)
    folders = []
    for seed in range(count):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        torch.manual_seed(seed)
        lora = LoraConfig(r=rank, target_modules=list(LORA_MODULES), init_lora_weights=False)
        folder = os.path.join(out_dir, f"lora-{seed}")
        get_peft_model(model, lora).save_pretrained(folder)
        folders.append(folder)
    return folders


def resolve_model(model: str | None, model_dir: str | None = None) -> str | None:
    """`--model qwen3-0.6b-random` (or another RANDOM_MODELS name) names a random checkpoint,
    built at `model_dir` (default ~/.cache/quire/NAME) if absent; any other value is a path,
    and None the engine's default model."""
    if model in RANDOM_MODELS:
        return build_random_model(model, model_dir or os.path.join(CACHE_DIR, model))
    return model


def add_model_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir",
        default=None,
        help=f"where `--model {'|'.join(RANDOM_MODELS)}` is cached (built on first use; "
        f"default {CACHE_DIR}/NAME)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_dir_arg(parser)
    parser.add_argument("--name", choices=tuple(RANDOM_MODELS), default=QWEN3_RANDOM)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        metavar="N",
        help="build N rank-16 LoRA adapters for --base in --model-dir instead of a model",
    )
    parser.add_argument("--base", default=None, help="the adapters' base (default: default model)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.lora_adapters:
        if args.model_dir is None:
            parser.error("--lora-adapters needs --model-dir, the folder to save them in")
        folders = build_lora_adapters(args.model_dir, args.lora_adapters, args.base)
        print(" ".join(f"{os.path.basename(f)}={f}" for f in folders))
        return 0
    model_dir = args.model_dir or os.path.join(CACHE_DIR, args.name)
    print(build_random_model(args.name, model_dir, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark models: a random-weight checkpoint shaped like Qwen3-0.6B (workload W2), and a
random 2-layer draft model of SmolLM2's vocabulary (`quire bench speculative`).

    python -m quire.bench.models [--model-dir ~/.cache/quire/qwen3-0.6b-random]
    python -m quire.bench.models --draft      # ~/.cache/quire/smollm2-draft-random

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
DEFAULT_MODEL_DIR = os.path.join(envs.XDG_CACHE_HOME, "quire", QWEN3_RANDOM)
SMOLLM2_DRAFT_RANDOM = "smollm2-draft-random"
DEFAULT_DRAFT_DIR = os.path.join(envs.XDG_CACHE_HOME, "quire", SMOLLM2_DRAFT_RANDOM)

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


def build_qwen3_random(
    model_dir: str = DEFAULT_MODEL_DIR, seed: int = 0, tokenizer_source: str | None = None
) -> str:
    """The random Qwen3-0.6B-shaped checkpoint folder, built on first use. The tokenizer is the
    default model's, or the one saved at `tokenizer_source` (a folder)."""
    from transformers import Qwen3Config

    return _build_random(
        model_dir,
        QWEN3_RANDOM,
        lambda tokenizer: Qwen3Config(
            architectures=["Qwen3ForCausalLM"],
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **QWEN3_0_6B_SHAPE,
        ),
        seed,
        tokenizer_source,
    )


def build_smollm2_draft_random(model_dir: str = DEFAULT_DRAFT_DIR, seed: int = 0) -> str:
    """A random 2-layer model of SmolLM2-135M's width and tokenizer: a draft model for
    `quire bench speculative` (SmolLM2 has no smaller sibling). Built on first use."""
    from transformers import LlamaConfig

    return _build_random(
        model_dir,
        SMOLLM2_DRAFT_RANDOM,
        lambda tokenizer: LlamaConfig(
            architectures=["LlamaForCausalLM"],
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **SMOLLM2_DRAFT_SHAPE,
        ),
        seed,
        None,
    )


def _build_random(
    model_dir: str, name: str, make_config, seed: int, tokenizer_source: str | None
) -> str:
    """A random bf16 checkpoint of `make_config(tokenizer)` at `model_dir`, unless one is there.
    Built in a temporary folder next to it and renamed into place, so an interrupted build is
    never reused."""
    model_dir = os.path.expanduser(model_dir)
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir
    from transformers import AutoModelForCausalLM

    from quire.config import default_model_path
    from quire.model.tokenizer import load_tokenizer

    start = time.perf_counter()
    parent = os.path.dirname(os.path.abspath(model_dir))
    os.makedirs(parent, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_source or default_model_path())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(tokenizer), dtype=torch.bfloat16)
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


# SmolLM2-135M's width (its GGUF's metadata) with 2 of its 30 layers.
SMOLLM2_DRAFT_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)


def resolve_model(model: str | None, model_dir: str = DEFAULT_MODEL_DIR) -> str | None:
    """`--model qwen3-0.6b-random` names the random checkpoint (built at `model_dir` if absent);
    any other value is a path, and None the engine's default model."""
    if model == QWEN3_RANDOM:
        return build_qwen3_random(model_dir)
    return model


def add_model_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir",
        default=DEFAULT_MODEL_DIR,
        help=f"where `--model {QWEN3_RANDOM}` is cached (built on first use)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_dir_arg(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--draft",
        action="store_true",
        help=f"build {SMOLLM2_DRAFT_RANDOM} (a 2-layer SmolLM2-vocabulary draft model) instead, "
        f"at --model-dir if given, else {DEFAULT_DRAFT_DIR}",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.draft:
        model_dir = DEFAULT_DRAFT_DIR if args.model_dir == DEFAULT_MODEL_DIR else args.model_dir
        print(build_smollm2_draft_random(model_dir, args.seed))
    else:
        print(build_qwen3_random(args.model_dir, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

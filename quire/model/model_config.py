"""ModelConfig: the architecture facts quire needs, read from a Hugging Face config or GGUF metadata."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from quire.model.gguf_header import iter_gguf_scalars


@dataclass
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    attention_bias: bool = False
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=architecture_of(cfg),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            rope=_rope_config(cfg),
            attention_bias=cfg.get("attention_bias", False),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class ModelShape:
    """The facts the engine's arguments are checked against before anything loads, read from
    config.json or the GGUF header alone (gguf_header.py: tens of ms, where the full parse of
    the default model takes seconds)."""

    name: str  # the file or folder name, for messages
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int

    @classmethod
    def read(cls, model: str) -> ModelShape:
        """The shape of `model`, a Hugging Face folder or a .gguf file."""
        if model.endswith(".gguf"):
            metadata = dict(iter_gguf_scalars(model))
            prefix = f"{metadata.get('general.architecture')}."
            if prefix + "attention.head_count" not in metadata:
                raise ValueError(
                    f"{model!r} has no {prefix}attention.head_count in its GGUF metadata."
                )
            q = metadata[prefix + "attention.head_count"]
            kv = metadata.get(prefix + "attention.head_count_kv", q)  # absent without GQA
            context = metadata.get(prefix + "context_length", 2048)
        else:
            from quire.model.registry import get_model_class  # model classes import this file

            cfg = read_hf_config(model)
            get_model_class(architecture_of(cfg))  # unsupported: said before any other field
            q = cfg["num_attention_heads"]
            kv = cfg.get("num_key_value_heads") or q
            context = cfg.get("max_position_embeddings", 2048)  # as ModelConfig reads it
        return cls(os.path.basename(model.rstrip("/")), q, kv, context)

    def check_tensor_parallel_size(self, tp: int) -> None:
        """Raises ValueError, naming the sizes that work, when `tp` ranks cannot split the heads:
        query heads divide by it, and KV heads by it or it by them (each then on several
        ranks)."""
        q, kv = self.num_attention_heads, self.num_key_value_heads
        sizes = [n for n in range(1, q + 1) if q % n == 0 and (kv % n == 0 or n % kv == 0)]
        if tp not in sizes:
            raise ValueError(
                f"tensor_parallel_size {tp} cannot split {self.name}'s {q} query heads and {kv} "
                f"KV heads; sizes that work: {', '.join(map(str, sizes))}."
            )

    def check_max_model_len(self, max_model_len: int) -> None:
        if max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"({self.max_position_embeddings}); pass a smaller max_model_len."
            )


def architecture_of(cfg: dict[str, Any]) -> str:
    """The model class name a config asks for (its first `architectures` entry)."""
    architectures = cfg.get("architectures") or []
    if not architectures:
        raise ValueError(
            "The model config has no 'architectures' entry; cannot pick a model class."
        )
    return architectures[0]


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """config.json of a Hugging Face folder, with generation_config.json's EOS ids merged in."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{model_dir!r} has no config.json: a Hugging Face model folder needs config.json, "
            "*.safetensors and tokenizer files."
        )
    with open(path) as f:
        cfg = json.load(f)
    generation_config = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_config):
        with open(generation_config) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return cfg


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older configs have rope_theta + rope_scaling.
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: default, linear, llama3."
        )
    return RopeConfig(
        theta=params.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        factor=params.get("factor", 1.0),
        low_freq_factor=params.get("low_freq_factor", 1.0),
        high_freq_factor=params.get("high_freq_factor", 4.0),
        original_max_position=params.get("original_max_position_embeddings", 8192),
    )

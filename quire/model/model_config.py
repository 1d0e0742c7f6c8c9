"""ModelConfig: the architecture facts quire needs, read from a Hugging Face config or GGUF metadata."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

from quire.layers.rotary import RopeConfig


class LoadConfig(Protocol):
    """What model/ reads of the engine's configuration (config.py's ModelSettings, and the
    EngineConfig it is resolved from, have it all).
    The config sits above model/, as it checks the arguments against the checkpoint
    (ModelShape), so model/ states the fields it reads rather than importing it."""

    model: str
    device: str
    quantization: str  # "auto" | "none" | "int8"
    pack_weights: bool
    gemv: bool

    @property
    def is_gguf(self) -> bool: ...


class ModelFileError(ValueError):
    """A model file quire cannot use: the message is one line naming the file and what is wrong
    with it (truncated, not the format it claims, a missing or ill-typed key or tensor)."""


# config keys every model needs, and those it may give (with the type each must have)
_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_BOOLS = ("tie_word_embeddings", "attention_bias")


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
        """Raises ValueError naming the first key that is missing, of the wrong type, or at
        odds with the others."""
        _check_keys(cfg)
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
    config.json or the GGUF header (gguf_loader.open_gguf: tens of ms, and the read the load
    then uses)."""

    name: str  # the file or folder name, for messages
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    num_hidden_layers: int

    @classmethod
    def read(cls, model: str) -> ModelShape:
        """The shape of `model`, a Hugging Face folder or a .gguf file."""
        if model.endswith(".gguf"):
            from quire.model.gguf_loader import open_gguf  # gguf_loader imports this file

            metadata = open_gguf(model).metadata
            prefix = f"{metadata.get('general.architecture')}."
            if prefix + "attention.head_count" not in metadata:
                raise ValueError(
                    f"{model!r} has no {prefix}attention.head_count in its GGUF metadata."
                )
            q = metadata[prefix + "attention.head_count"]
            kv = metadata.get(prefix + "attention.head_count_kv", q)  # absent without GQA
            context = metadata.get(prefix + "context_length", 2048)
            layers = metadata[prefix + "block_count"]
        else:
            from quire.model.registry import get_model_class  # model classes import this file

            cfg = read_hf_config(model)
            get_model_class(architecture_of(cfg))  # unsupported: said before any other field
            q = cfg["num_attention_heads"]
            kv = cfg.get("num_key_value_heads") or q
            context = cfg.get("max_position_embeddings", 2048)  # as ModelConfig reads it
            layers = cfg["num_hidden_layers"]
        return cls(os.path.basename(model.rstrip("/")), q, kv, context, layers)

    def tensor_parallel_sizes(self) -> list[int]:
        """The rank counts that split the heads: query heads divide by it, and KV heads by it or
        it by them (each KV head then on several ranks)."""
        q, kv = self.num_attention_heads, self.num_key_value_heads
        return [n for n in range(1, q + 1) if q % n == 0 and (kv % n == 0 or n % kv == 0)]

    def check_tensor_parallel_size(self, tp: int) -> None:
        """Raises ValueError, naming the sizes that work, when `tp` ranks cannot split the
        heads."""
        q, kv = self.num_attention_heads, self.num_key_value_heads
        sizes = self.tensor_parallel_sizes()
        if tp not in sizes:
            raise ValueError(
                f"tensor_parallel_size {tp} cannot split {self.name}'s {q} query heads and {kv} "
                f"KV heads; sizes that work: {', '.join(map(str, sizes))}."
            )

    def layer_partition(self, pp: int, partition: tuple[int, ...] | None) -> tuple[int, ...]:
        """The layers of each of `pp` pipeline stages: `partition` checked, or an even split
        (vLLM's: the stages before the last take the remainder, the last has the LM head).
        Raises ValueError naming what works for a split this model cannot take."""
        n = self.num_hidden_layers
        if pp > n:
            raise ValueError(
                f"pipeline_parallel_size {pp} exceeds {self.name}'s {n} layers (a stage holds "
                f"at least one): use pipeline_parallel_size 1..{n}."
            )
        if partition is None:
            sizes = [n // pp] * pp
            for i in range(2, n % pp + 2):
                sizes[-i] += 1
            return tuple(sizes)
        if len(partition) != pp or sum(partition) != n or min(partition) < 1:
            raise ValueError(
                f"pp_layer_partition {','.join(map(str, partition))} must give each of the "
                f"{pp} stages at least one layer and sum to {self.name}'s {n} layers, e.g. "
                f"{','.join(map(str, self.layer_partition(pp, None)))}."
            )
        return partition

    def check_max_model_len(self, max_model_len: int) -> None:
        if max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"({self.max_position_embeddings}); pass a smaller max_model_len."
            )


def load_model_config(config: LoadConfig) -> ModelConfig:
    """The checkpoint's ModelConfig. Raises FileNotFoundError, or ModelFileError naming the file
    and what is wrong with it."""
    from quire.model.gguf_loader import load_gguf_config  # gguf_loader imports this file
    from quire.model.registry import get_model_class  # model classes import this file

    cfg = load_gguf_config(config.model) if config.is_gguf else read_hf_config(config.model)
    try:
        get_model_class(architecture_of(cfg))  # unsupported: fail before reading other fields
        return ModelConfig.from_dict(cfg)
    except ModelFileError:
        raise
    except ValueError as error:
        raise ModelFileError(f"{_config_file(config.model)}: {error}") from None


def _config_file(model: str) -> str:
    """The file a checkpoint's config is read from."""
    return model if model.endswith(".gguf") else os.path.join(model, "config.json")


def _check_keys(cfg: dict[str, Any]) -> None:
    for key in _REQUIRED_INTS:
        if key not in cfg:
            raise ValueError(f"{key} is missing (a positive integer)")
    for key in (*_REQUIRED_INTS, *_OPTIONAL_INTS):
        value = cfg.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{key} must be a positive integer, not {value!r}")
    for key in _OPTIONAL_BOOLS:
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ValueError(f"{key} must be true or false, not {cfg[key]!r}")
    eps = cfg.get("rms_norm_eps")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, int | float) or eps <= 0):
        raise ValueError(f"rms_norm_eps must be a positive number, not {eps!r}")
    eos = cfg.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(type(i) is int and i >= 0 for i in eos_ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, not {eos!r}")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or 0
    if kv_heads and heads % kv_heads:
        raise ValueError(
            f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        raise ValueError(
            f"hidden_size ({cfg['hidden_size']}) is not a multiple of num_attention_heads "
            f"({heads}) and no head_dim is given"
        )


def architecture_of(cfg: dict[str, Any]) -> str:
    """The model class name a config asks for (its first `architectures` entry)."""
    architectures = cfg.get("architectures") or []
    if not architectures:
        raise ValueError(
            "The model config has no 'architectures' entry; cannot pick a model class."
        )
    if not isinstance(architectures, list) or not isinstance(architectures[0], str):
        raise ValueError(f"architectures must be a list of class names, not {architectures!r}")
    return architectures[0]


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """config.json of a Hugging Face folder, with generation_config.json's EOS ids merged in."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{model_dir!r} has no config.json: a Hugging Face model folder needs config.json, "
            "*.safetensors and tokenizer files."
        )
    cfg = _read_json(path)
    generation_config = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_config):
        eos = _read_json(generation_config).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return cfg


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from a file; ModelFileError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelFileError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: a JSON object is needed, not a {type(value).__name__}")
    return value


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older configs have rope_theta + rope_scaling.
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise ValueError(f"{key} must be an object, not {cfg[key]!r}")
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: default, linear, llama3."
        )
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ValueError(f"rope_theta must be a positive number, not {theta!r}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=params.get("factor", 1.0),
        low_freq_factor=params.get("low_freq_factor", 1.0),
        high_freq_factor=params.get("high_freq_factor", 4.0),
        original_max_position=params.get("original_max_position_embeddings", 8192),
    )

"""LoRA adapters read into one form: per decoder layer, per target module (q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj), A [r, in], B [out, r] and the scale.

Two formats:
- a Hugging Face PEFT folder: adapter_config.json (r, lora_alpha, target_modules, rank_pattern /
  alpha_pattern, use_rslora) and adapter_model.safetensors; scale alpha / r, or alpha / sqrt(r)
  with rslora, per module after the patterns.
- a GGUF LoRA file (llama.cpp's convert_lora_to_gguf.py): general.type = adapter,
  adapter.lora.alpha, tensors blk.N.<kind>.weight.lora_a / .lora_b in llama.cpp's names (q and
  k rows permuted for the llama architecture, undone here); scale alpha / r, or 1 without alpha,
  as llama.cpp.

Everything is checked against the base model's ModelConfig before an adapter is used, and any
problem raises LoRAAdapterError naming the file and the field or tensor: a rank above
max_lora_rank, a missing or malformed folder or file, a module the base model lacks, shapes of
another model, an adapter that changes the vocabulary (embed_tokens / lm_head).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import SafetensorError, safe_open

from quire.layers.lora_linear import LoRAWeights
from quire.model.gguf_file import read_gguf
from quire.model.gguf_loader import ARCHITECTURES, LAYER_NAMES, ROTARY_PERMUTED, unpermute_rotary
from quire.model.model_config import ModelConfig, ModelFileError

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_VOCABULARY_MODULES = ("embed_tokens", "lm_head")
_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")

_PEFT_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_GGUF_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


class LoRAAdapterError(ValueError):
    """An adapter quire cannot use; the message names the file, the field or tensor, and what
    to change."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    layers: list[dict[str, LoRAWeights]]  # per decoder layer: module -> its adapter (absent: none)

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max(w.rank for layer in self.layers for w in layer.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each module an adapter may target."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def load_adapter(name: str, path: str, config: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at `path` (a PEFT folder or a .gguf file), checked against the base model
    `config` and `max_lora_rank`. Raises LoRAAdapterError."""
    if os.path.isdir(path):
        layers = _read_peft(path, config)
    elif os.path.isfile(path):
        layers = _read_gguf(path, config)
    else:
        raise LoRAAdapterError(
            f"{path}: no such adapter: lora_path names a PEFT folder (adapter_config.json + "
            "adapter_model.safetensors) or a GGUF LoRA file."
        )
    adapter = LoRAAdapter(name, path, layers)
    if not any(adapter.layers):
        raise LoRAAdapterError(f"{path}: the adapter has no LoRA matrices.")
    if adapter.rank > max_lora_rank:
        raise LoRAAdapterError(
            f"{path}: rank {adapter.rank} is above max_lora_rank {max_lora_rank}: pass a "
            f"max_lora_rank of at least {adapter.rank}."
        )
    return adapter


def _read_peft(folder: str, config: ModelConfig) -> list[dict[str, LoRAWeights]]:
    config_path = os.path.join(folder, "adapter_config.json")
    cfg = _peft_config(config_path)
    weights_path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise LoRAAdapterError(
            f"{folder}: has no adapter_model.safetensors (PEFT's save_pretrained writes it; "
            "an adapter_model.bin is not read)."
        )
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for tensor_name in f.keys():
                match = _PEFT_TENSOR.fullmatch(tensor_name)
                if match is None:
                    raise _unknown_tensor(weights_path, tensor_name)
                layer, module, which = int(match[1]), match[2], match[3]
                _check_module(weights_path, tensor_name, module)
                pairs.setdefault((layer, module), {})[which.lower()] = f.get_tensor(tensor_name)
    except SafetensorError as error:
        raise LoRAAdapterError(f"{weights_path}: not a safetensors file ({error}).") from None
    layers: list[dict[str, LoRAWeights]] = [{} for _ in range(config.num_hidden_layers)]
    for (layer, module), pair in sorted(pairs.items()):
        parent = "self_attn" if module in _ATTENTION_MODULES else "mlp"
        full_name = f"model.layers.{layer}.{parent}.{module}"
        rank = _pattern(cfg["rank_pattern"], full_name, cfg["r"])
        alpha = _pattern(cfg["alpha_pattern"], full_name, cfg["lora_alpha"])
        a, b = _pair(weights_path, full_name, pair)
        if a.shape[0] != rank:
            raise LoRAAdapterError(
                f"{weights_path}: {full_name}'s lora_A has rank {a.shape[0]}, and "
                f"adapter_config.json's r / rank_pattern give it {rank}."
            )
        scale = alpha / math.sqrt(rank) if cfg["use_rslora"] else alpha / rank
        _place(weights_path, layers, config, layer, module, a, b, scale)
    return layers


def _peft_config(path: str) -> dict[str, Any]:
    """adapter_config.json's fields quire reads, checked."""
    if not os.path.isfile(path):
        raise LoRAAdapterError(
            f"{path}: not found: a PEFT adapter folder holds adapter_config.json and "
            "adapter_model.safetensors."
        )
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LoRAAdapterError(f"{path}: not valid JSON ({error}).") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{path}: a JSON object is needed, not {type(cfg).__name__}.")

    def fail(field: str, what: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"{path}: {field} {what}, not {cfg.get(field)!r}.")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise fail("peft_type", "must be LORA (quire runs LoRA adapters)")
    if type(cfg.get("r")) is not int or cfg["r"] < 1:
        raise fail("r", "must be a positive integer")
    if not _positive_number(cfg.get("lora_alpha")):
        raise fail("lora_alpha", "must be a positive number")
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise fail("use_rslora", "must be true or false")
    if cfg.get("use_dora"):
        raise fail("use_dora", "must be false (DoRA adapters are not supported)")
    if cfg.get("bias", "none") != "none":
        raise fail("bias", "must be none (quire adds no adapter biases)")
    for field, valid in (
        ("rank_pattern", lambda v: type(v) is int and v > 0),
        ("alpha_pattern", _positive_number),
    ):
        patterns = cfg.get(field) or {}
        if not isinstance(patterns, dict) or not all(valid(v) for v in patterns.values()):
            raise fail(field, "must map module patterns to positive numbers")
        cfg[field] = patterns
    for module in cfg.get("modules_to_save") or []:
        if module in _VOCABULARY_MODULES:
            raise _vocabulary_error(path, f"modules_to_save lists {module}")
        raise fail("modules_to_save", "must be empty (quire applies LoRA matrices only)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for module in targets:
            _check_module(path, "target_modules", str(module).rpartition(".")[2])
    cfg.setdefault("use_rslora", False)
    return cfg


def _positive_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0


def _pattern(patterns: dict[str, Any], full_name: str, default: Any) -> Any:
    """PEFT's rule: the first pattern matching the module's name, or its dotted tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", full_name):
            return value
    return default


def _read_gguf(path: str, config: ModelConfig) -> list[dict[str, LoRAWeights]]:
    try:
        file = read_gguf(path)
    except ModelFileError as error:
        raise LoRAAdapterError(str(error)) from None
    metadata = file.metadata
    if metadata.get("general.type") != "adapter":
        raise LoRAAdapterError(
            f"{path}: general.type is {metadata.get('general.type')!r}, not 'adapter': this GGUF "
            "file is not a LoRA adapter."
        )
    if metadata.get("adapter.type", "lora") != "lora":
        raise LoRAAdapterError(f"{path}: adapter.type is {metadata['adapter.type']!r}, not 'lora'.")
    architecture = metadata.get("general.architecture")
    if ARCHITECTURES.get(architecture) != config.architecture:
        raise LoRAAdapterError(
            f"{path}: general.architecture is {architecture!r}: an adapter for another model "
            f"than the base ({config.architecture})."
        )
    alpha = metadata.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha < 0:
        raise LoRAAdapterError(f"{path}: adapter.lora.alpha must be a number >= 0, not {alpha!r}.")
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in file.tensors:
        match = _GGUF_TENSOR.fullmatch(tensor.name)
        if match is None or match[2] not in LAYER_NAMES:
            raise _unknown_tensor(path, tensor.name)
        layer, kind, which = int(match[1]), match[2], match[3]
        module = LAYER_NAMES[kind].rpartition(".")[2]
        _check_module(path, tensor.name, module)
        values = dequantize(tensor.data, tensor.tensor_type)
        if which == "b" and architecture in ROTARY_PERMUTED and kind in heads:
            values = unpermute_rotary(tensor.name, values, heads[kind])
        pairs.setdefault((layer, module), {})[which] = torch.from_numpy(
            np.array(values, np.float32)
        )
    layers: list[dict[str, LoRAWeights]] = [{} for _ in range(config.num_hidden_layers)]
    for (layer, module), pair in sorted(pairs.items()):
        name = f"blk.{layer} {module}"
        a, b = _pair(path, name, pair)
        scale = alpha / a.shape[0] if alpha else 1.0
        _place(path, layers, config, layer, module, a, b, scale)
    return layers


def _check_module(path: str, where: str, module: str) -> None:
    if module in _VOCABULARY_MODULES:
        raise _vocabulary_error(path, f"{where} targets {module}")
    if module not in MODULES:
        raise LoRAAdapterError(
            f"{path}: {where} targets {module!r}, a module the base model lacks; adapters "
            f"may target {', '.join(MODULES)}."
        )


def _vocabulary_error(path: str, what: str) -> LoRAAdapterError:
    return LoRAAdapterError(
        f"{path}: {what}: an adapter that changes the vocabulary (embeddings or LM head) is not "
        "supported; train it without embed_tokens / lm_head."
    )


def _unknown_tensor(path: str, name: str) -> LoRAAdapterError:
    if any(module in name for module in _VOCABULARY_MODULES) or name.startswith(
        ("token_embd", "output.")
    ):
        return _vocabulary_error(path, f"tensor {name!r}")
    return LoRAAdapterError(
        f"{path}: tensor {name!r} is not a LoRA matrix of a decoder layer's {', '.join(MODULES)}."
    )


def _pair(path: str, name: str, pair: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in] and B [out, r] of one module (`pair`: "a", "b"), float32, of one rank."""
    for key in "ab":
        if key not in pair:
            raise LoRAAdapterError(f"{path}: {name} has no lora_{key} tensor.")
    a, b = pair["a"].float(), pair["b"].float()
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise LoRAAdapterError(
            f"{path}: {name}'s lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} are not "
            "[r, in] and [out, r] of one rank r."
        )
    return a, b


def _place(
    path: str,
    layers: list[dict[str, LoRAWeights]],
    config: ModelConfig,
    layer: int,
    module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
) -> None:
    """Checks one module's A and B against the base model's shapes and stores them."""
    if layer >= config.num_hidden_layers:
        raise LoRAAdapterError(
            f"{path}: the adapter has layer {layer}, and the base model "
            f"{config.num_hidden_layers} layers: an adapter for another model."
        )
    out_features, in_features = module_shapes(config)[module]
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise LoRAAdapterError(
            f"{path}: layer {layer} {module} maps {a.shape[1]} features to {b.shape[0]}, the "
            f"base model's {in_features} to {out_features} (hidden_size {config.hidden_size}): "
            "an adapter for another model."
        )
    layers[layer][module] = LoRAWeights(a.contiguous(), b.contiguous(), float(scale))

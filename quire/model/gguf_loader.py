"""Reading a GGUF checkpoint: a Hugging Face-style config and weights under HF names, float32 or,
for the block types the int8 kernel takes, kept in their blocks (`QuantizedWeight`).

llama.cpp stores a model under its own names (`blk.N.attn_q.weight`) and, for the `llama`
architecture only, with the rows of q_proj and k_proj permuted so that each rotary pair sits side by
side. Both are undone here, so the weights drop into the same model code as a safetensors checkpoint.
"""

import functools
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from quire.layers.quantized_linear import QuantizedWeight
from quire.model.gguf_file import GGUFFile, read_gguf
from quire.model.model_config import ModelFileError

logger = logging.getLogger(__name__)

# general.architecture -> the Hugging Face class whose parameter names the weights are given under
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# llama.cpp's converter permutes q/k rows for these architectures only (LlamaModel.permute)
ROTARY_PERMUTED = {"llama"}

# Hugging Face's default when a checkpoint states no rope base (llama.cpp's too)
_DEFAULT_ROPE_THETA = 10000.0

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def load_gguf_config(path: str) -> dict:
    """A Hugging Face-style config dict from the GGUF file's metadata.

    Raises FileNotFoundError for a missing file, and ModelFileError for a broken one, an
    architecture quire does not load, or a missing or ill-typed key.
    """
    return _config_from_reader(open_gguf(path))


def iter_gguf_weights(
    path: str,
    keep_quantized: frozenset[str] = frozenset(),
    wanted: Callable[[str], bool] = lambda name: True,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF parameter name, tensor in HF shape) for every `wanted` tensor in the file (the others
    are not read), in file order: a
    `QuantizedWeight` (its blocks, copied out of the file) for a matrix whose GGUF type is in
    `keep_quantized`, else float32.

    Tensors are dequantized one at a time from the memory-mapped file, so peak memory is about one
    dequantized tensor. A tied checkpoint has no `lm_head.weight`; the model ties it to the embedding.
    The file and its architecture are checked on the call, before the first tensor is asked for.
    With `keep_quantized`, each other quantized type found is logged once as dequantized.
    """
    reader = open_gguf(path)
    return _iter_weights(reader, _config_from_reader(reader), keep_quantized, wanted)


_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def matrix_types(path: str) -> frozenset[str]:
    """The block types of this file's matrices (its norms' F32 left out)."""
    return frozenset(t.tensor_type.name for t in open_gguf(path).tensors if t.data.ndim == 2)


def decode_weight_bytes(path: str, keep_quantized: frozenset[str], itemsize: int) -> int:
    """The weight bytes a decode step reads from this file's matmuls and LM head (the embedding
    when tied): a matrix of a type in `keep_quantized` in its blocks, any other at `itemsize`
    bytes a weight (dequantized)."""
    reader = open_gguf(path)
    names = {tensor.name for tensor in reader.tensors}
    total = 0
    for tensor in reader.tensors:
        if tensor.data.ndim != 2 or (
            tensor.name == "token_embd.weight" and "output.weight" in names
        ):
            continue
        kept = tensor.tensor_type.name in keep_quantized
        total += int(tensor.n_bytes) if kept else int(tensor.n_elements) * itemsize
    return total


def _iter_weights(
    reader: GGUFFile, config: dict, keep_quantized: frozenset[str], wanted: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    permuted = config["model_type"] in ROTARY_PERMUTED
    heads_for = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    dequantized: set[str] = set()
    for tensor in reader.tensors:
        name, gguf_kind = _hf_name(tensor.name)
        if not wanted(name):
            continue
        qtype = tensor.tensor_type.name
        if qtype in keep_quantized and tensor.data.ndim == 2:
            # [rows, bytes per row]: whole blocks, so rows permute as the dequantized ones do
            raw = tensor.data
            if permuted and gguf_kind in heads_for:
                raw = unpermute_rotary(name, raw, heads_for[gguf_kind])
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists ne0 (K) first
            yield name, QuantizedWeight(np.array(raw, np.uint8), qtype, shape)
            continue
        if keep_quantized and qtype not in _FLOAT_TYPES and qtype not in dequantized:
            dequantized.add(qtype)
            logger.warning(
                "%s weights are dequantized at load: the int8 kernel takes %s",
                qtype,
                ", ".join(sorted(keep_quantized)),
            )
        # the reader gives the data in torch order already: [rows, bytes per row] for blocks
        if tensor.data.ndim == 2 and qtype not in _FLOAT_TYPES:  # blocks: the one dequantizer
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))
            weights = QuantizedWeight(tensor.data, qtype, shape).dequantize().numpy()
        else:
            weights = dequantize(tensor.data, tensor.tensor_type)
        if permuted and gguf_kind in heads_for:
            weights = unpermute_rotary(name, weights, heads_for[gguf_kind])
        # an unquantized tensor is still a read-only view of the memory map: copy only that one
        yield name, torch.from_numpy(np.require(weights, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
    _parsed.cache_clear()  # every weight is loaded: the file's memory map can go


def open_gguf(path: str) -> GGUFFile:
    """The file, read. The engine reads the config, the tokenizer, then the weights: one read of
    the header serves all three (the file's identity is its path, size and modification time)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = os.stat(path)
    return _parsed(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _parsed(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return read_gguf(path)


def _config_from_reader(reader: GGUFFile) -> dict:
    architecture = reader.metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise ModelFileError(
            f"{reader.path}: GGUF architecture {architecture!r} is not supported; quire loads "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )

    def arch_field(key: str, default: Any = None, kind: type = int) -> Any:
        return _field(reader, f"{architecture}.{key}", default, kind)

    hidden_size = arch_field("embedding_length", _REQUIRED)
    num_attention_heads = arch_field("attention.head_count", _REQUIRED)
    head_dim = arch_field("attention.key_length") or arch_field("rope.dimension_count")
    vocab_size = arch_field("vocab_size") or len(
        _field(reader, "tokenizer.ggml.tokens", _REQUIRED, list)
    )
    tensor_names = {tensor.name for tensor in reader.tensors}
    return {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture,
        "hidden_size": hidden_size,
        "intermediate_size": arch_field("feed_forward_length", _REQUIRED),
        "num_hidden_layers": arch_field("block_count", _REQUIRED),
        "num_attention_heads": num_attention_heads,
        # llama.cpp omits the KV head count when it equals the head count (no GQA)
        "num_key_value_heads": arch_field("attention.head_count_kv", num_attention_heads),
        "head_dim": head_dim or hidden_size // num_attention_heads,
        "rms_norm_eps": arch_field("attention.layer_norm_rms_epsilon", _REQUIRED, float),
        "rope_theta": arch_field("rope.freq_base", _DEFAULT_ROPE_THETA, float),
        "max_position_embeddings": arch_field("context_length", _REQUIRED),
        "vocab_size": vocab_size,
        # llama.cpp writes output.weight only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": reader.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": reader.metadata.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }


_REQUIRED = object()  # a _field default: the key must be there


def _field(reader: GGUFFile, key: str, default: Any = None, kind: type = int) -> Any:
    """The metadata value of `key`, checked to be a positive `kind` (an int, a float (ints too)
    or a list); `default` where it is absent (ModelFileError if that is _REQUIRED)."""
    if key not in reader.metadata:
        if default is _REQUIRED:
            raise ModelFileError(f"{reader.path}: the GGUF metadata has no {key}")
        return default
    value = reader.metadata[key]
    allowed = (int, float) if kind is float else (kind,)
    if (
        isinstance(value, bool)
        or not isinstance(value, allowed)
        or (kind is not list and value <= 0)
    ):
        article = {int: "a positive integer", float: "a positive number", list: "a list"}[kind]
        raise ModelFileError(
            f"{reader.path}: the GGUF metadata's {key} must be {article}, not {value!r}"
        )
    return value


def _hf_name(gguf_name: str) -> tuple[str, str]:
    """(HF parameter name, llama.cpp tensor kind) for a GGUF tensor name."""
    if match := _LAYER_TENSOR.fullmatch(gguf_name):
        layer, kind, suffix = match.groups()
        if kind in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[kind]}.{suffix}", kind
    elif match := _GLOBAL_TENSOR.fullmatch(gguf_name):
        kind, suffix = match.groups()
        if kind in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[kind]}.{suffix}", kind
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name in quire's loader.")


def unpermute_rotary(name: str, weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, from halves-interleaved back to HF's rotate-half order.

    llama.cpp reshapes each head's rows as [2, head_dim // 2] and swaps the axes; this swaps them
    back. Works on a weight [num_heads * head_dim, hidden] and on a bias [num_heads * head_dim].
    Raises ValueError when the rows do not split into `num_heads` heads (of an even size).
    """
    if weights.shape[0] % (2 * num_heads):
        raise ValueError(
            f"Checkpoint tensor {name!r} has {weights.shape[0]} rows, which do not split into "
            f"{num_heads} heads of an even size"
        )
    half_head_dim = weights.shape[0] // num_heads // 2
    # [num_heads, head_dim // 2, 2, ...] -> [num_heads, 2, head_dim // 2, ...]
    per_head = weights.reshape(num_heads, half_head_dim, 2, *weights.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weights.shape)

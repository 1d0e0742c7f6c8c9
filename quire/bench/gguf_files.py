"""GGUF files for the quantized-weight benchmarks and tests, written with the `gguf` package:
a GGUF file re-quantized to another block type (SmolLM2's real weights as Q8_0 or Q4_0), and a
random-weight model of a given shape (Qwen3-0.6B's) with SmolLM2's tokenizer, in one block type.

    python -m quire.bench.gguf_files requantize SRC DST --type Q8_0
    python -m quire.bench.gguf_files random DST --type Q4_0 [--shape qwen3-0.6b]

Every matrix (token_embd included) takes the type; norms stay float32. The random model's
vocabulary is padded with control tokens to its embedding's rows, so that llama.cpp loads it.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from quire.bench.kquants import K_TYPES, quantize_k
from quire.bench.models import QWEN3_0_6B_SHAPE

logger = logging.getLogger(__name__)

SHAPES = {"qwen3-0.6b": ("qwen3", QWEN3_0_6B_SHAPE)}
_CONTROL_TOKEN = 3  # llama.cpp's token type CONTROL


def _copy_fields(
    reader: GGUFReader, writer: GGUFWriter, prefix: str = "", skip: tuple[str, ...] = ()
) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in skip:
            continue
        if not name.startswith(prefix):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type)


def _matrix(values: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, dict]:
    """The tensor as the writer takes it: a matrix in `qtype`, a vector in float32. A K-quant
    needs rows of whole super-blocks of 256: other matrices fall back to Q8_0 (as llama.cpp
    falls back to a legacy type for them)."""
    if values.ndim == 2 and qtype.name in K_TYPES:  # the gguf package cannot write these
        if values.shape[1] % 256:
            qtype = GGMLQuantizationType.Q8_0
        else:
            return quantize_k(values, qtype.name), {"raw_dtype": qtype}
    if values.ndim == 2:
        return quantize(values.astype(np.float32), qtype), {"raw_dtype": qtype}
    return values.astype(np.float32), {}


def requantize(src: str, dst: str, qtype: str) -> str:
    """`src` with every matrix dequantized and quantized again to `qtype`, written at `dst`
    (kept when it exists)."""
    if os.path.exists(dst):
        return dst
    start = time.perf_counter()
    reader = GGUFReader(src)
    architecture = reader.get_field("general.architecture").contents()
    writer = GGUFWriter(dst + ".tmp", architecture)
    _copy_fields(reader, writer)
    layers = reader.get_field(f"{architecture}.block_count").contents()
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        target = GGMLQuantizationType[_tensor_type(qtype, tensor.name, layers)]
        data, kwargs = _matrix(values, target)
        writer.add_tensor(tensor.name, data, **kwargs)
    _write(writer)
    os.replace(dst + ".tmp", dst)
    logger.warning("Wrote %s (%s) in %.0f s", dst, qtype, time.perf_counter() - start)
    return dst


def write_random(
    dst: str, qtype: str, shape: str | tuple[str, dict] = "qwen3-0.6b", seed: int = 0
) -> str:
    """A random-weight model at `dst` (kept when it exists): `shape` a name in SHAPES or an
    (architecture, config dict) pair, matrices in `qtype` (Q4_K_M: llama.cpp's mix of Q4_K and
    Q6_K), the default model's tokenizer padded to the vocabulary size."""
    if os.path.exists(dst):
        return dst
    from quire.config import default_model_path

    start = time.perf_counter()
    architecture, cfg = SHAPES[shape] if isinstance(shape, str) else shape
    tokenizer = GGUFReader(default_model_path())
    writer = GGUFWriter(dst + ".tmp", architecture)
    padded = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    _copy_fields(tokenizer, writer, "tokenizer.", skip=padded)
    tokens = tokenizer.get_field("tokenizer.ggml.tokens").contents()
    pad = cfg["vocab_size"] - len(tokens)
    writer.add_token_list(tokens + [f"<|quire_pad_{i}|>" for i in range(pad)])
    token_types = tokenizer.get_field("tokenizer.ggml.token_type").contents()
    writer.add_token_types(token_types + [_CONTROL_TOKEN] * pad)
    hidden, heads, kv_heads = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    head_dim, inter = cfg["head_dim"], cfg["intermediate_size"]
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    gen = np.random.default_rng(seed)
    layers = cfg["num_hidden_layers"]

    def add(name: str, *dims: int) -> None:
        values = (
            np.ones(dims, np.float32)
            if len(dims) == 1
            else gen.standard_normal(dims, np.float32) * 0.02
        )
        data, kwargs = _matrix(values, GGMLQuantizationType[_tensor_type(qtype, name, layers)])
        writer.add_tensor(name, data, **kwargs)

    add("token_embd.weight", cfg["vocab_size"], hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        if architecture == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", head_dim)
            add(f"blk.{i}.attn_k_norm.weight", head_dim)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
    add("output_norm.weight", hidden)
    if not cfg.get("tie_word_embeddings", True):
        add("output.weight", cfg["vocab_size"], hidden)
    _write(writer)
    os.replace(dst + ".tmp", dst)
    logger.warning("Wrote %s (%s, random) in %.0f s", dst, qtype, time.perf_counter() - start)
    return dst


def _tensor_type(qtype: str, name: str, layers: int) -> str:
    """A tensor's type in a file of `qtype`: the type itself, or for Q4_K_M llama.cpp's mix:
    Q4_K, with Q6_K for the LM head and for attn_v and ffn_down in the layers it gives more bits
    (the first and last eighth, and every third between)."""
    if qtype != "Q4_K_M":
        return qtype
    if name == "output.weight":
        return "Q6_K"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        i = int(parts[1])
        more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


def _write(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    req = sub.add_parser("requantize", help="a GGUF file's matrices in another block type")
    req.add_argument("src")
    req.add_argument("dst")
    rnd = sub.add_parser("random", help="a random-weight model in one block type")
    rnd.add_argument("dst")
    rnd.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    for p in (req, rnd):
        p.add_argument(
            "--type", default="Q8_0", help="Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, BF16, ..."
        )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.command == "requantize":
        print(requantize(args.src, args.dst, args.type))
    else:
        print(write_random(args.dst, args.type, args.shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

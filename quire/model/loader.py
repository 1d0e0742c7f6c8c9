"""Builds the model for a checkpoint and fills its weights: HF safetensors folders and GGUF files."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import time
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from quire.kernels.cpu import qmatmul
from quire.layers.linear import PackedLinear, pack_linear_layers, packed_linear_supported
from quire.layers.lora_linear import add_lora_layers
from quire.layers.quantized_linear import (
    KERNEL_TYPES,
    QuantizedLinear,
    QuantizedWeight,
    int8_linear_layers,
    quantize_linear_layers,
)
from quire.layers.rotary import RotaryEmbedding
from quire.model.gguf_loader import iter_gguf_weights
from quire.model.model_config import LoadConfig, ModelConfig, ModelFileError
from quire.model.registry import get_model_class

logger = logging.getLogger(__name__)


def iter_safetensors_weights(
    model_dir: str, wanted: Callable[[str], bool] = lambda name: True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder's files that is `wanted` (the others are
    not read)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir!r} has no *.safetensors weight files.")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def kept_quantized_types(config: LoadConfig, dtype: torch.dtype) -> frozenset[str]:
    """The GGUF block types loaded as they are, for the int8 kernel (layers/quantized_linear.py):
    all it takes for a GGUF file run in bf16 on CPU with the C kernels (any rank count) and
    `quantization` auto; none otherwise (every weight dequantized to `dtype`, as before)."""
    if not config.is_gguf or config.quantization == "none":
        return frozenset()
    reasons = []
    if torch.device(config.device).type != "cpu" or dtype != torch.bfloat16:
        reasons.append(f"it runs bf16 on CPU, not {dtype} on {config.device}")
    if not qmatmul.available():
        reasons.append("the C kernels are off or do not build here")
    if reasons:
        logger.info("GGUF weights dequantized: the int8 kernel %s", "; ".join(reasons))
        return frozenset()
    return KERNEL_TYPES


def check_int8(config: LoadConfig, dtype: torch.dtype) -> None:
    """`--quantization int8` runs on the int8 kernel: bf16 activations on CPU, the C kernels on.
    Raises ValueError saying what to change otherwise."""
    if torch.device(config.device).type != "cpu" or dtype != torch.bfloat16:
        raise ValueError(
            f"quantization int8 runs bf16 on CPU, not {dtype} on {config.device}: "
            "use --dtype bfloat16 --device cpu, or quantization none."
        )
    if not qmatmul.available():
        raise ValueError(
            "quantization int8 needs quire's C kernels, which are off or do not build here: "
            "use quantization none."
        )


def quantize_int8(model: nn.Module) -> int:
    """Every linear's weight quantized to int8 blocks; a tied LM head gets its own from the
    embedding table (which stays as it is, read a row per token). Returns how many."""
    count = int8_linear_layers(model)
    if _tied_head(model) and model.embed_tokens.weight.shape[1] % qmatmul.QBLOCK == 0:
        model.lm_head = QuantizedLinear(QuantizedWeight.from_float(model.embed_tokens.weight), None)
        count += 1
    return count


def _tied_head(model: nn.Module) -> bool:
    """Whether the model's LM head is the embedding table (on the stage that has the head)."""
    return model.is_last_stage and model.lm_head is None


def quantize_weights(model: nn.Module) -> int:
    """Every linear given GGUF blocks becomes a QuantizedLinear; a tied LM head takes the
    embedding's blocks. Returns how many."""
    count = quantize_linear_layers(model)
    embedding = getattr(model.embed_tokens, "quantized", None)
    if _tied_head(model) and embedding is not None and embedding.qtype in KERNEL_TYPES:
        model.lm_head = QuantizedLinear(embedding, None)
        count += 1
    return count


def pack_weights(model: nn.Module, use_gemv: bool) -> None:
    """Packs every matmul weight for oneDNN and (`use_gemv`) the GEMV kernel
    (quire/layers/linear.py). A tied LM head gets its own packed copy: the embedding lookup keeps
    the plain table."""
    pack_linear_layers(model, use_gemv=use_gemv)
    if _tied_head(model):
        model.lm_head = PackedLinear(model.embed_tokens.weight, None, use_gemv=use_gemv)


def load_model(
    config: LoadConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    max_position: int,
    *,
    max_loras: int = 0,
    max_lora_rank: int = 0,
    layers: range | None = None,
) -> nn.Module:
    """The model with its weights; with `max_loras` > 0 every linear an adapter may target
    holds that many adapter slots of rank `max_lora_rank` (layers/lora_linear.py). `layers`: a
    pipeline stage's (default: all); only its tensors are read."""
    start = time.perf_counter()
    model_class = get_model_class(model_config.architecture)
    # Built without initializing weights (the checkpoint overwrites them), then materialized.
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(model_config, max_position, layers)
    # what to_empty does, but torch.empty_like on the meta device imports sympy (0.5 s)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=config.device))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_cache()
    if config.quantization == "int8":
        check_int8(config, dtype)
    keep_quantized = kept_quantized_types(config, dtype)
    weights = (
        iter_gguf_weights(config.model, keep_quantized, model.holds)
        if config.is_gguf
        else iter_safetensors_weights(config.model, model.holds)
    )
    with torch.no_grad():
        try:
            model.load_weights(weights)
        except ModelFileError:
            raise
        except ValueError as error:  # a tensor missing, of no place in the model, or misshapen
            raise ModelFileError(f"{config.model}: {error}") from None
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    if max_loras:  # before packing: the packed or quantized base goes inside the wrapper
        count = add_lora_layers(model, max_loras, max_lora_rank, dtype)
        logger.info(
            "%d linears take adapters: %d slots of rank %d in %s",
            count,
            max_loras,
            max_lora_rank,
            str(dtype).removeprefix("torch."),
        )
    if keep_quantized:
        logger.info("%d linear layers kept in GGUF blocks", quantize_weights(model))
    if config.quantization == "int8":
        logger.info("%d linear layers quantized to int8", quantize_int8(model))
    if config.pack_weights and packed_linear_supported(config.device, dtype):
        pack_weights(model, use_gemv=config.gemv)
    if not model.is_first_stage and model.lm_head is not None:
        model.embed_tokens = None  # held for a tied head that now has its own copy
    logger.info(
        "Loaded %s (%.1fM params, %s) in %.1f s",
        model_config.architecture,
        num_params / 1e6,
        str(dtype).removeprefix("torch."),
        time.perf_counter() - start,
    )
    return model

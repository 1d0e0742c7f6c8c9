"""Maps a checkpoint's `architectures` name to the model class that runs it."""

from __future__ import annotations

from torch import nn

from quire.model.llama import LlamaForCausalLM
from quire.model.qwen2 import Qwen2ForCausalLM
from quire.model.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported. "
            f"Supported architectures: {', '.join(sorted(MODEL_REGISTRY))}."
        ) from None

"""Llama-family decoder: embed, N x (attention + SiLU-gated MLP, pre-norm residual), norm, head.

Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm) are this model with one switch each; see qwen2.py and
qwen3.py. Projections are fused (q|k|v, gate|up); `load_weights` maps checkpoint names onto them.

A pipeline stage builds a contiguous range of the layers (`layers`): the first stage also the
embedding, the last the final norm and the LM head (and the embedding table when the head is
tied to it); the other layers are empty placeholders, so parameter names stay the checkpoint's.
A stage's forward takes the previous stage's hidden states and residual, and gives its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from quire.distributed.parallel_state import tp_size
from quire.kernels.cpu import qmatmul
from quire.layers.activation import silu_and_mul
from quire.layers.attention import Attention
from quire.layers.linear import PackedLinear
from quire.layers.norm import RMSNorm
from quire.layers.parallel_linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    load_full,
)
from quire.layers.quantized_linear import QuantizedLinear, QuantizedWeight, shard_of
from quire.layers.rotary import RotaryEmbedding
from quire.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits
from quire.model.model_config import ModelConfig

logger = logging.getLogger(__name__)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate_up_proj, QuantizedLinear):  # prompt rows in one pass on AMX
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(
            layer_idx,
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            qkv_bias=qkv_bias,
            qk_norm_eps=config.rms_norm_eps if qk_norm else None,
        )
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,  # None before the first layer: hidden is the embedding
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's output and the residual stream
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotary, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: no weights, never called."""


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    # the linears an adapter may target, under each decoder layer -> the checkpoint modules
    # each fuses, in its rows' order (layers/lora_linear.py)
    lora_targets = {
        "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "self_attn.o_proj": ("o_proj",),
        "mlp.gate_up_proj": ("gate_proj", "up_proj"),
        "mlp.down_proj": ("down_proj",),
    }

    def __init__(self, config: ModelConfig, max_position: int, layers: range | None = None):
        """`layers`: the pipeline stage's (default: all of them, one stage)."""
        super().__init__()
        self.config = config
        self.layer_range = layers or range(config.num_hidden_layers)
        self.is_first_stage = self.layer_range.start == 0
        self.is_last_stage = self.layer_range.stop == config.num_hidden_layers
        self.rotary = RotaryEmbedding(config.head_dim, max_position, config.rope)
        tied_head = self.is_last_stage and config.tie_word_embeddings
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            if self.is_first_stage or tied_head
            else None
        )
        start = self.layer_range.start
        self.layers = nn.ModuleList(
            DecoderLayer(config, i - start, self.qkv_bias, self.qk_norm)  # the stage's KV index
            if i in self.layer_range
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None
        if config.tie_word_embeddings or not self.is_last_stage:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    @property
    def attention_layers(self) -> list[Attention]:
        return [self.layers[i].self_attn for i in self.layer_range]

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this stage."""
        name = name.removeprefix("model.")
        if name.startswith("layers."):
            return int(name.split(".", 2)[1]) in self.layer_range
        if name.startswith("embed_tokens."):
            return self.embed_tokens is not None
        return self.is_last_stage  # the final norm and the LM head

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor | None = None,  # the previous stage's [num_tokens, hidden_size]
        residual: torch.Tensor | None = None,  # and its residual stream, same shape
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last stage: [num_tokens, hidden_size] after the final norm; any other: this
        stage's hidden states and residual, for the next."""
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, hidden.dtype)
        for i in self.layer_range:
            hidden, residual = self.layers[i](rotary, hidden, residual)
        if not self.is_last_stage:
            return hidden, residual
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # -> [n, vocab] float32
        if self.lm_head is None:  # tied to the embedding table
            logits = torch.nn.functional.linear(hidden, self.embed_tokens.weight).float()
        elif isinstance(self.lm_head, PackedLinear | QuantizedLinear):
            logits = self.lm_head(hidden, out_dtype=torch.float32)
        else:
            logits = self.lm_head(hidden).float()
        return gather_logits(logits, self.config.vocab_size)  # this rank's range -> all

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copies checkpoint tensors (Hugging Face names, full size) into the fused parameters,
        each parallel layer taking this rank's shard (its `weight_loader`). A QuantizedWeight
        for a linear's weight is kept beside it, in `quantized_shards` (for
        quantized_linear.quantize_linear_layers); for the embedding it is dequantized into the
        table and kept as `quantized`, for a tied LM head. Raises ValueError naming what is
        missing or unexpected, so a wrong checkpoint fails loudly."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        split: list[str] = []  # kept types whose split over the ranks cuts blocks
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if (
                "rotary_emb.inv_freq" in name
                or (name == "lm_head.weight" and self.lm_head is None)
                or not self.holds(name)
            ):
                continue
            target, shard_id = name, None
            for shard, (fused, shard_key) in _SHARDS.items():
                if f".{shard}." in name:
                    target, shard_id = name.replace(shard, fused), shard_key
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"Checkpoint tensor {name!r} has no place in {self.config.architecture}."
                )
            module = modules[target.rpartition(".")[0]]
            loader = getattr(module, "weight_loader", None)
            try:
                if isinstance(tensor, QuantizedWeight):
                    # the shape checked as the loader checks it, on a tensor of no storage
                    check = torch.empty(tensor.shape, device="meta")
                    _load(loader, torch.empty_like(param, device="meta"), check, shard_id)
                    part = shard_of(module, tensor, shard_id)
                    if isinstance(module, nn.Linear) and part is not None:
                        module.__dict__.setdefault("quantized_shards", {})[shard_id] = part
                        loaded.add(name)
                        continue
                    if part is None:
                        split.append(name)
                    else:
                        module.quantized = part
                    tensor = tensor.dequantize()
                _load(loader, param, tensor, shard_id)
            except ValueError as error:
                raise ValueError(f"Checkpoint tensor {name!r} {error}.") from None
            loaded.add(name)
        if split:
            logger.warning(
                "%d matrices (%s, ...) are dequantized: their input features split over %d "
                "ranks do not fall on %d-weight block boundaries (a tensor_parallel_size that "
                "divides them into multiples of %d keeps them in their blocks)",
                len(split),
                split[0],
                tp_size(),
                qmatmul.QBLOCK,
                qmatmul.QBLOCK,
            )
        expected = set().union(*(_checkpoint_name(n) for n in params))
        missing = expected - loaded
        if missing:
            raise ValueError(f"Checkpoint is missing tensors: {sorted(missing)[:8]}")


def _load(loader, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | int | None) -> None:
    """`tensor` into `param` by the module's weight loader (or whole)."""
    if loader is None:
        load_full(param.data, tensor)
    elif shard_id is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard_id)


# checkpoint projection -> (fused parameter, its shard in the fused layer's weight_loader)
_SHARDS: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _checkpoint_name(param_name: str) -> set[str]:
    """The checkpoint names that fill a (possibly fused) parameter."""
    names = {
        param_name.replace(fused, shard)
        for shard, (fused, _) in _SHARDS.items()
        if f".{fused}." in param_name
    }
    return names or {param_name}

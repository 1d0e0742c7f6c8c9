"""Llama-family decoder: embed, N x (attention + SiLU-gated MLP, pre-norm residual), norm, head.

Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm) are this model with one switch each; see qwen2.py and
qwen3.py. Projections are fused (q|k|v, gate|up); `load_weights` maps checkpoint names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from quire.attention.backend import AttentionMetadata
from quire.layers.activation import silu_and_mul
from quire.layers.attention import Attention
from quire.layers.linear import PackedLinear, pack_linear_layers
from quire.layers.norm import RMSNorm
from quire.layers.rotary import RotaryEmbedding
from quire.model.cpu_decode import CpuDecodePath
from quire.model.model_config import ModelConfig


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(
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
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's output and the residual stream
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotary, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: ModelConfig, max_position: int):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, max_position, config.rope)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.qkv_bias, self.qk_norm)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cpu_decode: CpuDecodePath | None = None  # set by pack_weights where it runs

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if self.cpu_decode is not None and self.cpu_decode.takes(metadata, input_ids.shape[0]):
            return self.cpu_decode.forward(input_ids, positions, metadata)
        hidden = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rotary, hidden, residual, metadata)
        return self.norm(hidden, residual)[0]

    def argmax_tokens(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
    ) -> list[int] | None:
        """`compute_logits(forward(...)).argmax(-1)` for a decode-only step, in one C call on a
        CPU (cpu_decode.py); None where that path does not take the step."""
        if self.cpu_decode is None or not self.cpu_decode.takes_argmax(
            metadata, input_ids.shape[0]
        ):
            return None
        return self.cpu_decode.argmax_tokens(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # -> [n, vocab] float32
        if self.lm_head is None:  # tied to the embedding table
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight).float()
        if isinstance(self.lm_head, PackedLinear):
            return self.lm_head(hidden, out_dtype=torch.float32)
        return self.lm_head(hidden).float()

    def pack_weights(self, use_gemv: bool) -> None:
        """Packs every matmul weight for oneDNN and (`use_gemv`) the GEMV kernel (see
        quire/layers/linear.py) and turns on the one-call-per-layer decode path where it runs. A
        tied LM head gets its own packed copy: the embedding lookup keeps the plain table."""
        pack_linear_layers(self, use_gemv=use_gemv)
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.embed_tokens.weight, None, use_gemv=use_gemv)
        if CpuDecodePath.supported(self):
            self.cpu_decode = CpuDecodePath(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (Hugging Face names) into the fused parameters. Raises
        ValueError naming what is missing or unexpected, so a wrong checkpoint fails loudly."""
        params = dict(self.named_parameters())
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shards = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, offset, size = name, 0, None
            for shard, (fused, shard_offset, shard_size) in shards.items():
                if f".{shard}." in name:
                    target = name.replace(shard, fused)
                    offset, size = shard_offset, shard_size
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"Checkpoint tensor {name!r} has no place in {cfg.architecture}.")
            dest = param.data if size is None else param.data.narrow(0, offset, size)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}."
                )
            dest.copy_(tensor)
            loaded.add(name)
        expected = set().union(*(_checkpoint_name(n, shards) for n in params))
        missing = expected - loaded
        if missing:
            raise ValueError(f"Checkpoint is missing tensors: {sorted(missing)[:8]}")


def _checkpoint_name(param_name: str, shards: dict[str, tuple[str, int, int]]) -> set[str]:
    """The checkpoint names that fill a (possibly fused) parameter."""
    names = {
        param_name.replace(fused, shard)
        for shard, (fused, _, _) in shards.items()
        if f".{fused}." in param_name
    }
    return names or {param_name}

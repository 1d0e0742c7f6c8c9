"""Decode-only steps on CPU, the whole model up to the LM head in one C call.

A batch-1 decode step of SmolLM2-135M reads ~270 MB of weights: ~6 ms at this machine's bandwidth.
Run as modules, the same step issues ~20 torch ops and C calls per layer, and their dispatch
costs ~5 ms on its own (and ~6 ms of a 28 ms step at batch 16). `CpuDecodePath` runs the step as
one call of quire/kernels/cpu/decode_layer.c instead (`decode_step_bf16`: the embedding rows, the
rotary tables, every layer, the final norm), over the GEMV-packed weights the layers'
PackedLinear modules already hold (see quire/layers/linear.py). Even the few torch ops left
around the layers cost ~50-100 us each here: the weights streaming through leave the
interpreter's data cold in the caches at every step.

It takes a step when the model is bf16 on a CPU with AVX-512 BF16, every projection has a GEMV
copy, and the step is decode only, with at most `gemv.max_rows()` decode sequences (every
decode-only step, except on CPUs with AMX; a replay after a preemption gives one per token).
Results: the module path's, computed in the same order with the same rounding.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from quire.attention.backend import AttentionMetadata
from quire.kernels import cpu as cpu_kernels
from quire.kernels.cpu import gemv, pointwise
from quire.layers.linear import PackedLinear

if TYPE_CHECKING:
    from quire.model.llama import DecoderLayer, LlamaForCausalLM

_ptr = ctypes.c_void_p


_LAYER_POINTERS = "input_norm post_norm q_norm k_norm qkv qkv_bias o gate_up down k_cache v_cache"
_LAYER_INTS = (
    "hidden_size num_heads num_kv_heads head_dim intermediate_size block_size "
    "qkv_k_block o_k_block gate_up_k_block down_k_block"
)
_STEP_POINTERS = "cos sin slots block_tables seq_lens silu x qkv q attn gate_up act"
_MODEL_POINTERS = "layers embedding cos_cache sin_cache final_norm"


class _DecodeLayer(ctypes.Structure):  # DecodeLayer in decode_layer.c, field for field
    _fields_ = (
        [(name, _ptr) for name in _LAYER_POINTERS.split()]
        + [(name, ctypes.c_int32) for name in _LAYER_INTS.split()]
        + [(name, ctypes.c_float) for name in ("eps", "qk_eps", "scale")]
    )


class _DecodeStep(ctypes.Structure):  # DecodeStep in decode_layer.c, field for field
    _fields_ = [(name, _ptr) for name in _STEP_POINTERS.split()] + [
        (name, ctypes.c_int32) for name in ("num_seqs", "max_blocks", "num_threads")
    ]


class _DecodeModel(ctypes.Structure):  # DecodeModel in decode_layer.c, field for field
    _fields_ = (
        [(name, _ptr) for name in _MODEL_POINTERS.split()]
        + [(name, ctypes.c_int32) for name in ("num_layers", "vocab_size", "max_position")]
        + [("final_eps", ctypes.c_float)]
    )


def _data(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous `dtype` tensor, converted only when it is not one already."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _fits(metadata: AttentionMetadata, num_tokens: int) -> bool:
    return metadata.num_decodes == metadata.num_seqs == num_tokens <= gemv.max_rows()


def _projections(layer: DecoderLayer) -> list[PackedLinear]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


class CpuDecodePath:
    """Runs `LlamaForCausalLM.forward` for decode-only steps; see the module docstring."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self._layers = (_DecodeLayer * 0)()
        self._model = _DecodeModel()
        self._cache_ptr = 0  # the first layer's K cache the structs were built over
        cfg = model.config
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        # Scratch row widths; the rows grow to the widest step seen, shared by a step's layers.
        self._scratch_widths = {
            "hidden": cfg.hidden_size,
            "residual": cfg.hidden_size,
            "cos": cfg.head_dim,
            "sin": cfg.head_dim,
            "x": cfg.hidden_size,
            "qkv": q_size + 2 * kv_size,
            "q": q_size,
            "attn": q_size,
            "gate_up": 2 * cfg.intermediate_size,
            "act": cfg.intermediate_size,
        }
        self._scratch: dict[str, torch.Tensor] = {}
        self._step = _DecodeStep()  # over the scratch rows; rebuilt when they grow

    @staticmethod
    def supported(model: LlamaForCausalLM) -> bool:
        """Whether the model can run this path: bf16 on CPU, every projection GEMV-packed, and
        an attention shape the paged-decode kernel takes."""
        cfg = model.config
        return (
            model.embed_tokens.weight.device.type == "cpu"
            and model.embed_tokens.weight.dtype == torch.bfloat16
            and all(
                isinstance(p, PackedLinear) and p.gemv_weight is not None
                for layer in model.layers
                for p in _projections(layer)
            )
            and cpu_kernels.supports_paged_decode(
                torch.bfloat16, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            )
        )

    def takes(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step runs here: decode only (one token per sequence), at most
        `gemv.max_rows()` sequences."""
        return _fits(metadata, num_tokens)

    def _build_layers(self) -> None:
        model, cfg = self.model, self.model.config
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = attn.k_cache, attn.v_cache
            if k_cache.dtype != torch.bfloat16 or not (
                k_cache.is_contiguous() and v_cache.is_contiguous()
            ):
                raise ValueError("CpuDecodePath: the KV cache must be contiguous bf16")
            layers.append(
                _DecodeLayer(
                    input_norm=_data(layer.input_layernorm.weight),
                    post_norm=_data(layer.post_attention_layernorm.weight),
                    q_norm=_data(None if attn.q_norm is None else attn.q_norm.weight),
                    k_norm=_data(None if attn.k_norm is None else attn.k_norm.weight),
                    qkv=_data(attn.qkv_proj.gemv_weight),
                    qkv_bias=_data(attn.qkv_proj.bias),
                    o=_data(attn.o_proj.gemv_weight),
                    gate_up=_data(mlp.gate_up_proj.gemv_weight),
                    down=_data(mlp.down_proj.gemv_weight),
                    k_cache=_data(k_cache),
                    v_cache=_data(v_cache),
                    hidden_size=cfg.hidden_size,
                    num_heads=attn.num_heads,
                    num_kv_heads=attn.num_kv_heads,
                    head_dim=attn.head_dim,
                    intermediate_size=cfg.intermediate_size,
                    block_size=k_cache.shape[1],
                    qkv_k_block=attn.qkv_proj.gemv_k_block,
                    o_k_block=attn.o_proj.gemv_k_block,
                    gate_up_k_block=mlp.gate_up_proj.gemv_k_block,
                    down_k_block=mlp.down_proj.gemv_k_block,
                    eps=layer.input_layernorm.eps,
                    qk_eps=0.0 if attn.q_norm is None else attn.q_norm.eps,
                    scale=attn.scale,
                )
            )
        self._layers = (_DecodeLayer * len(layers))(*layers)
        rotary, embedding = model.rotary, model.embed_tokens.weight
        if not all(
            t.dtype == torch.float32 and t.is_contiguous()
            for t in (rotary.cos_cache, rotary.sin_cache)
        ):
            raise ValueError("CpuDecodePath: the rotary tables must be contiguous float32")
        if not embedding.is_contiguous():
            raise ValueError("CpuDecodePath: the embedding table must be contiguous")
        self._model = _DecodeModel(
            layers=ctypes.addressof(self._layers),
            embedding=_data(embedding),
            cos_cache=_data(rotary.cos_cache),
            sin_cache=_data(rotary.sin_cache),
            final_norm=_data(model.norm.weight),
            num_layers=len(layers),
            vocab_size=embedding.shape[0],
            max_position=rotary.cos_cache.shape[0],
            final_eps=model.norm.eps,
        )
        self._cache_ptr = model.layers[0].self_attn.k_cache.data_ptr()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,  # [num_seqs]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_seqs, hidden_size], after the final norm
        model = self.model
        num_seqs = input_ids.shape[0]
        if not _fits(metadata, num_seqs):
            raise ValueError(
                f"CpuDecodePath runs decode-only steps of 1..{gemv.max_rows()} sequences, "
                f"got {num_seqs} tokens for {metadata.num_seqs} sequences"
            )
        if self._cache_ptr != model.layers[0].self_attn.k_cache.data_ptr():
            self._build_layers()  # first step, or the KV cache was reallocated
        slots = _as(metadata.slot_mapping, torch.int64)
        block_tables = _as(metadata.block_tables, torch.int32)
        seq_lens = _as(metadata.seq_lens, torch.int32)
        token_ids = _as(input_ids, torch.int64)
        positions = _as(positions, torch.int64)
        if not self._scratch or self._scratch["x"].shape[0] < num_seqs:
            self._scratch = {
                name: torch.empty(num_seqs, width, dtype=torch.bfloat16)
                for name, width in self._scratch_widths.items()
            }
            self._step = _DecodeStep(
                silu=_data(pointwise.silu_table()),
                **{
                    name: _data(self._scratch[name])
                    for name in _STEP_POINTERS.split()
                    if name in self._scratch
                },
            )
        step = self._step  # the scratch pointers set above; the step's own fields here
        step.slots = slots.data_ptr()
        step.block_tables = block_tables.data_ptr()
        step.seq_lens = seq_lens.data_ptr()
        step.num_seqs = num_seqs
        step.max_blocks = block_tables.shape[1]
        step.num_threads = torch.get_num_threads()
        scratch = self._scratch
        out = torch.empty(num_seqs, model.config.hidden_size, dtype=torch.bfloat16)
        status = cpu_kernels.load_library().decode_step_bf16(
            ctypes.byref(self._model),
            ctypes.byref(step),
            token_ids.data_ptr(),
            positions.data_ptr(),
            scratch["hidden"].data_ptr(),
            scratch["residual"].data_ptr(),
            out.data_ptr(),
        )
        if status == -4:
            raise ValueError(
                f"CpuDecodePath: a token id outside the vocabulary ({self._model.vocab_size}) "
                f"or a position outside the rotary tables ({self._model.max_position})"
            )
        if status != 0:
            raise RuntimeError(f"decode_step_bf16 failed (status {status})")
        return out

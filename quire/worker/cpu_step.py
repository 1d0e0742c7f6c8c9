"""Decode-only steps on CPU, the whole model up to the LM head in one C call: with
worker/cuda_graph.py, one of the two ways the worker runs a step faster than module by module.

A batch-1 decode step of SmolLM2-135M reads ~270 MB of weights: ~6 ms at this machine's bandwidth.
Run as modules, the same step issues ~20 torch ops and C calls per layer, and their dispatch
costs ~5 ms on its own (and ~6 ms of a 28 ms step at batch 16). `CpuStepRunner` runs the step as
one call of quire/kernels/cpu/decode_layer.c instead (`decode_step_bf16`: the embedding rows, the
rotary tables, every layer, the final norm), over the GEMV-packed weights the layers'
PackedLinear modules already hold (see quire/layers/linear.py), named once in `StepWeights`, and
the worker's KVCache. Even the few torch ops left
around the layers cost ~50-100 us each here: the weights streaming through leave the
interpreter's data cold in the caches at every step.

It takes a step when the model is bf16 on a CPU with AVX-512 BF16, every projection has a GEMV
copy or is kept in GGUF blocks (QuantizedLinear: qmatmul.c), and the step is decode only (a
replay after a preemption gives one per token). Results: the module path's, computed in the same order with the same rounding.

A model loaded with adapter slots (multi-LoRA) takes it too: a LoRALinear's base is the
projection, and its stacked slots go beside it. In a step whose requests run adapters (the
worker's `lora_context`), each row's slot goes to the C step, which adds every row's delta after
q|k|v, o, gate|up and down with lora.c, the kernel CpuLoRAOps runs for the modules.

Under tensor parallelism each rank runs the step over its shards, and the C code runs the
collectives the modules would between them (the all-reduces after the embedding, o_proj and
down_proj; the argmax across the ranks' vocabulary ranges) over the group's shared memory, in
the protocol the Python all-reduce runs (quire/distributed/shm_all_reduce.py). Without shared
memory (gloo alone) the path is off.

A pipeline stage (tensor parallelism off) runs its range of the layers the same way: a stage
other than the first starts from the hidden states and residual the previous stage sent
(`forward_stage`), one other than the last hands its own back for the next stage instead of the
final norm's output.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from quire.attention.backend import AttentionMetadata
from quire.distributed.parallel_state import shm_group, tp_size
from quire.distributed.shm_all_reduce import ShmAllReduce
from quire.kernels import cpu as cpu_kernels
from quire.kernels import kv_format
from quire.kernels.cpu import pointwise
from quire.layers.linear import PackedLinear
from quire.layers.lora_linear import LoRALinear, get_lora_context
from quire.layers.quantized_linear import QuantizedLinear
from quire.lora.ops import CpuLoRAOps
from quire.worker.kv_cache import KVCache

_ptr = ctypes.c_void_p


class _LoRASlots(ctypes.Structure):  # LoRASlots in decode_layer.c
    _fields_ = [(name, _ptr) for name in ("a", "b", "slot_used", "out_slices")] + [
        (name, ctypes.c_int32) for name in ("modules", "max_rank")
    ]


class _Projection(ctypes.Structure):  # Projection in decode_layer.c
    _fields_ = [
        ("weight", _ptr),
        ("bias", _ptr),
        ("format", ctypes.c_int32),
        ("k_block", ctypes.c_int32),
        ("lora", _LoRASlots),
    ]


_LAYER_POINTERS = "input_norm post_norm q_norm k_norm k_cache v_cache"
_LAYER_PROJECTIONS = "qkv o gate_up down"
_LAYER_INTS = "hidden_size num_heads num_kv_heads head_dim intermediate_size block_size kv_kind"
_STEP_POINTERS = "cos sin slots block_tables seq_lens lora_slots silu x qkv q attn gate_up act"
_MODEL_POINTERS = "layers embedding cos_cache sin_cache final_norm"
_MODEL_INTS = "num_layers vocab_size vocab_start vocab_rows max_position first_stage last_stage"
_ARGMAX_ROW_BYTES = 16  # RowBest in shm_all_reduce.c: what a rank publishes per row


class _DecodeLayer(ctypes.Structure):  # DecodeLayer in decode_layer.c, field for field
    _fields_ = (
        [(name, _ptr) for name in _LAYER_POINTERS.split()]
        + [(name, _Projection) for name in _LAYER_PROJECTIONS.split()]
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
        + [("lm_head", _Projection), ("group", _ptr)]
        + [(name, ctypes.c_int32) for name in _MODEL_INTS.split()]
        + [("final_eps", ctypes.c_float)]
    )


def _data(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous `dtype` tensor, converted only when it is not one already."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _kv_readable(kv_cache: KVCache) -> bool:
    """A cache the C step reads: bf16, or quantized (kernels/kv_format.py)."""
    return kv_cache.dtype == torch.bfloat16 or kv_format.is_quantized(kv_cache.dtype)


def _fits(metadata: AttentionMetadata, num_tokens: int) -> bool:
    return metadata.num_decodes == metadata.num_seqs == num_tokens


@dataclass
class LayerWeights:
    """What the C step reads of one decoder layer."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None  # Qwen3's per-head q/k norms
    k_norm: torch.Tensor | None
    qkv: nn.Module  # PackedLinear with a GEMV copy, when the path runs (or a LoRALinear on one)
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    qk_eps: float
    scale: float

    @property
    def projections(self) -> list[nn.Module]:
        return [self.qkv, self.o, self.gate_up, self.down]


@dataclass
class StepWeights:
    """Every tensor the C step reads, named once: the only place that knows where they sit in
    the Llama-family module tree (quire/model/llama.py)."""

    layers: list[LayerWeights]  # the pipeline stage's (all of them with one stage)
    # [vocab_rows, hidden]: this rank's rows (all with one rank); None on a pipeline stage that
    # neither embeds nor holds the tied LM head
    embedding: torch.Tensor | None
    vocab_start: int  # the first of them
    vocab_size: int  # the whole vocabulary's
    cos_cache: torch.Tensor  # [max_position, head_dim] float32
    sin_cache: torch.Tensor
    final_norm: torch.Tensor | None  # None on a pipeline stage other than the last
    final_eps: float
    lm_head: nn.Module | None  # PackedLinear over the same rows; None when tied and not packed
    hidden_size: int
    intermediate_size: int  # this rank's share
    first_stage: bool  # runs the embedding
    last_stage: bool  # ends in the final norm and the LM head

    @classmethod
    def from_model(cls, model: nn.Module) -> StepWeights:
        layers = []
        for layer in (model.layers[i] for i in model.layer_range):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                    k_norm=None if attn.k_norm is None else attn.k_norm.weight,
                    qkv=attn.qkv_proj,
                    o=attn.o_proj,
                    gate_up=mlp.gate_up_proj,
                    down=mlp.down_proj,
                    num_heads=attn.num_heads,
                    num_kv_heads=attn.num_kv_heads,
                    head_dim=attn.head_dim,
                    eps=layer.input_layernorm.eps,
                    qk_eps=0.0 if attn.q_norm is None else attn.q_norm.eps,
                    scale=attn.scale,
                )
            )
        embed, norm = model.embed_tokens, model.norm
        return cls(
            layers=layers,
            embedding=None if embed is None else embed.weight,
            vocab_start=0 if embed is None else embed.vocab_start,
            vocab_size=model.config.vocab_size,
            cos_cache=model.rotary.cos_cache,
            sin_cache=model.rotary.sin_cache,
            final_norm=None if norm is None else norm.weight,
            final_eps=model.config.rms_norm_eps if norm is None else norm.eps,
            lm_head=model.lm_head,
            hidden_size=model.config.hidden_size,
            intermediate_size=layers[0].gate_up.out_features // 2,
            first_stage=model.is_first_stage,
            last_stage=model.is_last_stage,
        )


def _base(linear: nn.Module | None) -> nn.Module | None:
    """The linear that computes x W^T: a LoRALinear's base, any other linear itself."""
    return linear.base if isinstance(linear, LoRALinear) else linear


def _c_projection(linear: nn.Module | None) -> bool:
    """Whether the C step runs this linear: GEMV-packed bf16, or kept in GGUF blocks (with or
    without adapter slots beside it)."""
    base = _base(linear)
    return isinstance(base, QuantizedLinear) or (
        isinstance(base, PackedLinear) and base.gemv_weight is not None
    )


def _lora_slots(linear: nn.Module, out_slices: list[torch.Tensor]) -> _LoRASlots:
    """A LoRALinear's slots as the C step reads them (nothing for another linear). Its
    [modules, 2] int32 out_slices tensor goes on `out_slices`, which keeps it alive."""
    if not isinstance(linear, LoRALinear):
        return _LoRASlots()
    assert linear.lora_a.dtype == linear.lora_b.dtype == torch.bfloat16
    assert linear.lora_a.is_contiguous() and linear.lora_b.is_contiguous()
    out_slices.append(torch.tensor(linear.out_slices, dtype=torch.int32))
    used = (ctypes.c_uint8 * len(linear.slot_used)).from_buffer(linear.slot_used)
    return _LoRASlots(
        a=_data(linear.lora_a),
        b=_data(linear.lora_b),
        slot_used=ctypes.addressof(used),
        out_slices=_data(out_slices[-1]),
        modules=len(linear.module_names),
        max_rank=linear.max_rank,
    )


def _projection(linear: nn.Module, out_slices: list[torch.Tensor]) -> _Projection:
    base = _base(linear)
    lora = _lora_slots(linear, out_slices)
    if isinstance(base, QuantizedLinear):
        return _Projection(
            weight=_data(base.packed), bias=_data(base.bias), format=base.format, lora=lora
        )
    return _Projection(
        weight=_data(base.gemv_weight),
        bias=_data(base.bias),
        format=0,
        k_block=base.gemv_k_block,
        lora=lora,
    )


def _collectives_in_c(weights: StepWeights) -> bool:
    """Whether the C step can run this rank's collectives: the group has a shared-memory file,
    and no row-parallel projection has a bias to add after its all-reduce."""
    return shm_group() is not None and all(
        getattr(_base(p), "row_bias", None) is None
        for layer in weights.layers
        for p in (layer.o, layer.down)
    )


class CpuStepRunner:
    """Runs the model's forward for decode-only steps; see the module docstring."""

    def __init__(self, weights: StepWeights, kv_cache: KVCache, group: ShmAllReduce | None = None):
        if not _kv_readable(kv_cache) or not all(
            k.is_contiguous() and v.is_contiguous() for k, v in kv_cache.layers
        ):
            raise ValueError("CpuStepRunner: the KV cache must be contiguous bf16 or quantized")
        if not all(t.dtype == torch.float32 for t in (weights.cos_cache, weights.sin_cache)):
            raise ValueError("CpuStepRunner: the rotary tables must be float32")
        self.weights = weights
        self.vocab_rows = 0 if weights.embedding is None else weights.embedding.shape[0]
        # The group's file (tensor parallelism): what it holds for the C collectives, and the
        # widest step whose hidden rows (and argmax rows) fit a slot.
        self._group = None
        self._max_group_rows = sys.maxsize
        if group is not None:
            self._group = cpu_kernels.ShmGroup(
                group.address, group.slot_bytes, group.rank, group.world_size
            )
            row_bytes = max(2 * weights.hidden_size, _ARGMAX_ROW_BYTES)
            self._max_group_rows = group.slot_bytes // row_bytes
        first = weights.layers[0]
        q_size = first.num_heads * first.head_dim
        kv_size = first.num_kv_heads * first.head_dim
        # Scratch row widths; the rows grow to the widest step seen, shared by a step's layers.
        self._scratch_widths = {
            "hidden": weights.hidden_size,
            "residual": weights.hidden_size,
            "cos": first.head_dim,
            "sin": first.head_dim,
            "x": weights.hidden_size,
            "qkv": q_size + 2 * kv_size,
            "q": q_size,
            "attn": q_size,
            "gate_up": 2 * weights.intermediate_size,
            "act": weights.intermediate_size,
        }
        self._scratch: dict[str, torch.Tensor] = {}
        self._step = _DecodeStep()  # over the scratch rows; rebuilt when they grow
        # argmax_tokens' and lm_head_argmax's outputs, grown to the most rows seen.
        self._hidden_out = torch.empty(0, weights.hidden_size, dtype=torch.bfloat16)
        self._logits = torch.empty(0, 0)
        self._argmax_ids = np.zeros(0, np.int64)  # numpy: tolist() without a torch op
        lm_head = weights.lm_head
        self.has_lm_head = (
            weights.last_stage
            and _c_projection(lm_head)
            and lm_head.out_features == self.vocab_rows
        )
        # A head in GGUF blocks writes the logits for its argmax; a GEMV-packed one none (it
        # goes through them a block of columns at a time, in cache).
        self._logits_width = self.vocab_rows if isinstance(_base(lm_head), QuantizedLinear) else 0
        self._out_slices: list[torch.Tensor] = []  # the LoRA slots' column ranges, kept alive
        self._layers = self._layer_structs(weights, kv_cache)
        self._model = self._model_struct(weights)

    @classmethod
    def for_model(cls, model: nn.Module, kv_cache: KVCache) -> CpuStepRunner | None:
        """The C step of `model` over `kv_cache` (and this rank's tensor-parallel group), or
        None where it does not run (`supported`)."""
        weights = StepWeights.from_model(model)
        if not cls.supported(weights, kv_cache):
            return None
        return cls(weights, kv_cache, shm_group() if tp_size() > 1 else None)

    @staticmethod
    def supported(weights: StepWeights, kv_cache: KVCache) -> bool:
        """Whether the path runs: bf16 on CPU (a bf16 or quantized KV cache), every projection
        GEMV-packed or in GGUF blocks, an attention shape the paged-decode kernel takes, and
        with several ranks a shared-memory group and no bias on the row-parallel projections
        (the C step adds none after the all-reduce)."""
        first = weights.layers[0]
        return (
            first.input_norm.device.type == "cpu"
            and first.input_norm.dtype == torch.bfloat16
            and (weights.embedding is None or weights.embedding.dtype == torch.bfloat16)
            and _kv_readable(kv_cache)
            and all(_c_projection(p) for layer in weights.layers for p in layer.projections)
            and cpu_kernels.supports_paged_decode(
                torch.bfloat16, first.num_heads, first.num_kv_heads, first.head_dim
            )
            and (tp_size() == 1 or _collectives_in_c(weights))
        )

    def takes(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step runs here: decode only (one token per sequence; under tensor
        parallelism, at most as many sequences as a slot of the group's file holds)."""
        return self._step_fits(metadata, num_tokens)

    def _step_fits(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        return _fits(metadata, num_tokens) and num_tokens <= self._max_group_rows

    def takes_argmax(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        """Whether `argmax_tokens` runs this step: `takes`, and an LM head the GEMV or the int8
        kernel holds."""
        return self.has_lm_head and self.takes(metadata, num_tokens)

    def _layer_structs(self, weights: StepWeights, kv_cache: KVCache) -> ctypes.Array:
        structs = []
        for layer, (k_cache, v_cache) in zip(weights.layers, kv_cache.layers):
            structs.append(
                _DecodeLayer(
                    input_norm=_data(layer.input_norm),
                    post_norm=_data(layer.post_norm),
                    q_norm=_data(layer.q_norm),
                    k_norm=_data(layer.k_norm),
                    qkv=_projection(layer.qkv, self._out_slices),
                    o=_projection(layer.o, self._out_slices),
                    gate_up=_projection(layer.gate_up, self._out_slices),
                    down=_projection(layer.down, self._out_slices),
                    k_cache=_data(k_cache),
                    v_cache=_data(v_cache),
                    hidden_size=weights.hidden_size,
                    num_heads=layer.num_heads,
                    num_kv_heads=layer.num_kv_heads,
                    head_dim=layer.head_dim,
                    intermediate_size=weights.intermediate_size,
                    block_size=kv_cache.block_size,
                    kv_kind=kv_format.kind(kv_cache.dtype)
                    if kv_format.is_quantized(kv_cache.dtype)
                    else 0,
                    eps=layer.eps,
                    qk_eps=layer.qk_eps,
                    scale=layer.scale,
                )
            )
        return (_DecodeLayer * len(structs))(*structs)

    def _model_struct(self, weights: StepWeights) -> _DecodeModel:
        for name in ("embedding", "cos_cache", "sin_cache"):
            tensor = getattr(weights, name)
            if tensor is not None and not tensor.is_contiguous():
                raise ValueError(f"CpuStepRunner: {name} must be contiguous")
        lm_head = weights.lm_head if self.has_lm_head else None
        return _DecodeModel(
            layers=ctypes.addressof(self._layers),
            embedding=_data(weights.embedding),
            cos_cache=_data(weights.cos_cache),
            sin_cache=_data(weights.sin_cache),
            final_norm=_data(weights.final_norm),
            lm_head=_Projection() if lm_head is None else _projection(lm_head, []),
            group=None if self._group is None else ctypes.addressof(self._group),
            num_layers=len(self._layers),
            vocab_size=weights.vocab_size,
            vocab_start=weights.vocab_start,
            vocab_rows=self.vocab_rows,
            max_position=weights.cos_cache.shape[0],
            first_stage=weights.first_stage,
            last_stage=weights.last_stage,
            final_eps=weights.final_eps,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,  # [num_seqs]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_seqs, hidden_size], after the final norm
        out = torch.empty(input_ids.shape[0], self.weights.hidden_size, dtype=torch.bfloat16)
        self._run(input_ids, positions, metadata, out)
        return out

    def receive(self, received: torch.Tensor) -> None:
        """A pipeline stage other than the first: the previous stage's hidden states and
        residual ([2, num_seqs, hidden_size]), where this step's `forward`, `argmax_tokens` or
        `forward_to_next_stage` starts from."""
        num_seqs = received.shape[1]
        self._grow_scratch(num_seqs)
        self._scratch["hidden"][:num_seqs].copy_(received[0])
        self._scratch["residual"][:num_seqs].copy_(received[1])

    def forward_to_next_stage(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,  # [num_seqs]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [2, num_seqs, hidden_size]: the hidden states and the residual
        """A pipeline stage other than the last: its layers, and what the next stage takes."""
        num_seqs = input_ids.shape[0]
        self._grow_scratch(num_seqs)
        self._run(input_ids, positions, metadata, self._scratch["x"])  # out: unused
        return torch.stack(
            (self._scratch["hidden"][:num_seqs], self._scratch["residual"][:num_seqs])
        )

    def argmax_tokens(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,  # [num_seqs]
        metadata: AttentionMetadata,
    ) -> list[int]:  # each sequence's argmax token
        """`forward`, `compute_logits` and the greedy argmax in one C call, into buffers kept
        from step to step: what the runner would compute for rows that take the argmax, without
        the torch ops around the LM head (each costs 10-25 us with the caches cold from the
        weights, ~3% of a batch-1 step together)."""
        num_seqs = input_ids.shape[0]
        self._grow_argmax_buffers(num_seqs)
        self._run(input_ids, positions, metadata, self._hidden_out, self._logits, self._argmax_ids)
        return self._argmax_ids[:num_seqs].tolist()

    def _grow_scratch(self, num_seqs: int) -> None:
        """Scratch rows for `num_seqs` sequences (new ones, unfilled, when it grows)."""
        if self._scratch and self._scratch["x"].shape[0] >= num_seqs:
            return
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

    def takes_lm_head_argmax(self, num_rows: int) -> bool:
        """Whether `lm_head_argmax` takes these rows: an LM head the GEMV or the int8 kernel
        holds (under tensor parallelism, at most as many rows as a slot of the group's file)."""
        return self.has_lm_head and 0 < num_rows <= self._max_group_rows

    def lm_head_argmax(
        self,
        hidden: torch.Tensor,  # [num_rows, hidden_size] bf16, after the final norm
    ) -> list[int]:  # each row's argmax token
        """`compute_logits` and the greedy argmax of any step's rows (a prompt chunk's last
        row, decodes beside it) in one C call, the LM head and argmax `argmax_tokens` runs,
        into the same buffers: no [rows, vocab] float32 tensor per step (above 32 MiB the
        allocator maps fresh pages for each one, and faults them all in as they fill)."""
        num_rows = hidden.shape[0]
        assert self.takes_lm_head_argmax(num_rows)
        hidden = _as(hidden, torch.bfloat16)
        self._grow_argmax_buffers(num_rows)
        status = cpu_kernels.load_library().lm_head_argmax_bf16(
            ctypes.byref(self._model),
            hidden.data_ptr(),
            num_rows,
            self._logits.data_ptr(),
            self._argmax_ids.ctypes.data,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"lm_head_argmax_bf16 failed (status {status})")
        return self._argmax_ids[:num_rows].tolist()

    def _grow_argmax_buffers(self, num_rows: int) -> None:
        """The argmax paths' outputs, grown to the most rows seen."""
        if self._argmax_ids.shape[0] < num_rows:
            self._logits = torch.empty(num_rows, self._logits_width, dtype=torch.float32)
            self._argmax_ids = np.zeros(num_rows, np.int64)
            self._hidden_out = torch.empty(
                num_rows, self._scratch_widths["x"], dtype=torch.bfloat16
            )

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor,  # [>= num_seqs, hidden_size] bf16: the final norm's output
        logits: torch.Tensor | None = None,  # [>= num_seqs, vocab] float32 (a GGUF-block head)
        argmax_ids: np.ndarray | None = None,  # [>= num_seqs] int64
    ) -> None:
        """The C step into `out`; with `logits` and `argmax_ids`, the LM head and the argmax
        too."""
        num_seqs = input_ids.shape[0]
        if not self._step_fits(metadata, num_seqs):
            bound = "" if self._group is None else f" of at most {self._max_group_rows} sequences"
            raise ValueError(
                f"CpuStepRunner runs decode-only steps{bound}, "
                f"got {num_seqs} tokens for {metadata.num_seqs} sequences"
            )
        slots = _as(metadata.slot_mapping, torch.int64)
        block_tables = _as(metadata.block_tables, torch.int32)
        seq_lens = _as(metadata.seq_lens, torch.int32)
        token_ids = _as(input_ids, torch.int64)
        positions = _as(positions, torch.int64)
        self._grow_scratch(num_seqs)
        step = self._step  # the scratch pointers set above; the step's own fields here
        step.slots = slots.data_ptr()
        step.block_tables = block_tables.data_ptr()
        step.seq_lens = seq_lens.data_ptr()
        lora = get_lora_context()  # the step's adapter rows, if any
        assert lora is None or isinstance(lora.ops, CpuLoRAOps)  # the kernel the C step runs
        step.lora_slots = None if lora is None else lora.mapping.token_slots.data_ptr()
        step.num_seqs = num_seqs
        step.max_blocks = block_tables.shape[1]
        step.num_threads = torch.get_num_threads()
        scratch = self._scratch
        lib = cpu_kernels.load_library()
        args = [
            ctypes.byref(self._model),
            ctypes.byref(step),
            token_ids.data_ptr(),
            positions.data_ptr(),
            scratch["hidden"].data_ptr(),
            scratch["residual"].data_ptr(),
            out.data_ptr(),
        ]
        if argmax_ids is None:
            status = lib.decode_step_bf16(*args)
        else:
            status = lib.decode_step_argmax_bf16(*args, logits.data_ptr(), argmax_ids.ctypes.data)
        if status == -4:
            raise ValueError(
                f"CpuStepRunner: a token id outside the vocabulary ({self._model.vocab_size}) "
                f"or a position outside the rotary tables ({self._model.max_position})"
            )
        if status == -6:
            raise ValueError(
                f"CpuStepRunner: {num_seqs} rows do not fit the tensor-parallel group's "
                "shared-memory slots"
            )
        if status != 0:
            raise RuntimeError(f"decode_step_bf16 failed (status {status})")

"""LoRA-aware linears: a base linear plus, per token row, the delta of that row's adapter.

`add_lora_layers` wraps the linears a model names in `lora_targets` (q|k|v, o, gate|up, down)
in a `LoRALinear` before the weights are packed or kept quantized, so the packing passes replace
the base inside the wrapper and any base (nn.Linear shards, PackedLinear, QuantizedLinear)
takes adapters. Each LoRALinear holds `max_loras` slots of stacked weights: A, the fused
modules' ranks one under the other [max_loras, modules * max_rank, in], and B transposed
[max_loras, max_rank, out] (each rank's row contiguous over the outputs), zero-padded to
`max_rank` (zeros add nothing), A already times the adapter's scale. The stacks are in the
model's dtype, as vLLM keeps them (bf16 for a bf16 or GGUF model: half the bytes a decode step
reads per adapter), and the ops sum in float32. The adapter manager (quire/lora) writes a slot
with `set_slot`.

Which slot each token row uses is per-step state, so it is not on the modules: the worker sets
a `LoRAContext` around the forward (`lora_context`, as attention's forward context), holding the
step's `LoRAMapping` and the ops that add the deltas (quire/lora: torch on CPU, Triton on GPU).
A step without adapters sets none, and every LoRALinear is its base.

Tensor parallelism cuts the slots as the layer cuts its weight: a column-parallel layer keeps
this rank's rows of B (per fused module, by the layer's `Shard`) and A whole; a row-parallel
layer keeps this rank's columns of A and B whole, and its partial delta joins the partial
product before the all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from quire.distributed.parallel_state import tp_size
from quire.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    Shard,
)


@dataclass(frozen=True)
class LoRAWeights:
    """One module's adapter, full size (every rank reads the same): y += scale * B (A x)."""

    lora_a: torch.Tensor  # [rank, in_features] float32
    lora_b: torch.Tensor  # [out_features, rank] float32
    scale: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each token row of a step adds (-1: none), in the forms the ops read.
    Built once per step (`from_requests`) and read by every LoRALinear of the forward."""

    token_slots: torch.Tensor  # [num_tokens] int32
    # the rows of requests computing several tokens (prompt chunks), contiguous: SGMV
    segments: tuple[tuple[int, int, int], ...]  # (start row, end row, slot)
    # the rows of requests computing one token (decodes), gathered by slot: BGMV
    gathered: tuple[tuple[int, torch.Tensor], ...]  # (slot, rows [n] int64)
    # every row with an adapter, grouped by slot (for one kernel launch over all of them)
    sorted_rows: torch.Tensor  # [rows with an adapter] int64, slot by slot
    group_slots: torch.Tensor  # [groups] int32
    group_starts: torch.Tensor  # [groups] int32: each group's first entry in sorted_rows
    group_sizes: torch.Tensor  # [groups] int32
    slots: frozenset[int]  # the slots this step uses

    @classmethod
    def from_requests(
        cls,
        slots: Sequence[int],  # per request in the step's row order; -1: the base model
        num_tokens: Sequence[int],  # the rows each request computes this step
        device: torch.device | str = "cpu",
    ) -> LoRAMapping:
        token_slots: list[int] = []
        segments: list[tuple[int, int, int]] = []
        single: dict[int, list[int]] = {}
        by_slot: dict[int, list[int]] = {}
        for slot, count in zip(slots, num_tokens, strict=True):
            start = len(token_slots)
            token_slots.extend([slot] * count)
            if slot < 0 or count == 0:
                continue
            by_slot.setdefault(slot, []).extend(range(start, start + count))
            if count == 1:
                single.setdefault(slot, []).append(start)
            else:
                segments.append((start, start + count, slot))
        order = sorted(by_slot)
        sizes = [len(by_slot[s]) for s in order]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]

        def ints(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            token_slots=ints(token_slots, torch.int32),
            segments=tuple(segments),
            gathered=tuple((s, ints(rows, torch.int64)) for s, rows in sorted(single.items())),
            sorted_rows=ints([r for s in order for r in by_slot[s]], torch.int64),
            group_slots=ints(order, torch.int32),
            group_starts=ints(starts, torch.int32),
            group_sizes=ints(sizes, torch.int32),
            slots=frozenset(order),
        )


class LoRAOps(Protocol):
    """Adds each row's adapter delta to a linear's output, in place."""

    def add_lora(
        self,
        out: torch.Tensor,  # [num_tokens, out] the base output
        x: torch.Tensor,  # [num_tokens, in]
        lora_a: torch.Tensor,  # [max_loras, modules * max_rank, in] scale included
        lora_b: torch.Tensor,  # [max_loras, max_rank, out] (B transposed), lora_a's dtype
        out_slices: Sequence[tuple[int, int]],  # per module: (first output column, columns)
        mapping: LoRAMapping,
    ) -> None: ...


@dataclass(frozen=True)
class LoRAContext:
    mapping: LoRAMapping
    ops: LoRAOps


_current: LoRAContext | None = None


@contextlib.contextmanager
def lora_context(mapping: LoRAMapping, ops: LoRAOps) -> Iterator[LoRAContext]:
    """The step's adapter rows, for every LoRALinear the model runs inside it."""
    global _current
    previous, _current = _current, LoRAContext(mapping, ops)
    try:
        yield _current
    finally:
        _current = previous


def get_lora_context() -> LoRAContext | None:
    """The step's LoRAContext, or None in a step that runs no adapter."""
    return _current


def _module_shards(base: nn.Linear) -> tuple[list[Shard], Shard]:
    """(per fused module, this rank's rows of its B; this rank's columns of every A)."""
    whole_in = Shard(1, 0, base.in_features, base.in_features)
    if isinstance(base, QKVParallelLinear):
        return [base.shard(s) for s in "qkv"], whole_in
    if isinstance(base, MergedColumnParallelLinear):
        return [base.shard(i) for i in range(len(base.output_sizes))], whole_in
    if isinstance(base, ColumnParallelLinear):
        return [base.shard()], whole_in
    if isinstance(base, RowParallelLinear):
        return [Shard(0, 0, base.out_features, base.out_features)], base.shard()
    raise TypeError(f"{type(base).__name__} is not a parallel linear that takes adapters")


class LoRALinear(nn.Module):
    """`base` (a parallel linear, packed or quantized later inside this wrapper) plus each token
    row's adapter delta. `modules` names the checkpoint modules it fuses, in its rows' order."""

    def __init__(
        self,
        base: nn.Linear,
        modules: Sequence[str],
        layer_idx: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features  # this rank's
        self.module_names = tuple(modules)
        self.layer_idx = layer_idx
        self.max_rank = max_rank
        self.b_rows, self.a_columns = _module_shards(base)
        assert len(self.b_rows) == len(self.module_names)
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.out_slices = tuple((shard.offset, shard.size) for shard in self.b_rows)
        device = base.weight.device
        self.register_buffer(
            "lora_a",
            torch.zeros(
                max_loras, len(modules) * max_rank, base.in_features, dtype=dtype, device=device
            ),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, max_rank, base.out_features, dtype=dtype, device=device),
            persistent=False,
        )
        # per slot, 1 where it adds anything here (bytes: the C decode step reads them too)
        self.slot_used = bytearray(max_loras)

    def set_slot(self, slot: int, weights: Mapping[str, LoRAWeights]) -> None:
        """Writes an adapter's modules of this layer (full size, any rank up to max_rank) into
        `slot`, this rank's part of each, rounded once to the stacks' dtype (A after the
        scale); modules it lacks stay zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        r_max = self.max_rank
        for i, module in enumerate(self.module_names):
            w = weights.get(module)
            if w is None:
                continue
            self.a_columns.load(
                self.lora_a[slot, i * r_max : i * r_max + w.rank], w.lora_a * w.scale
            )
            self.b_rows[i].load(self.lora_b[slot, : w.rank].t(), w.lora_b)
        self.slot_used[slot] = any(m in weights for m in self.module_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        context = _current
        if context is None or not any(self.slot_used[s] for s in context.mapping.slots):
            return self.base(x)
        if self.row_parallel and tp_size() > 1:  # the partial delta joins the sum over ranks
            out = self.base.partial(x)
            context.ops.add_lora(out, x, self.lora_a, self.lora_b, self.out_slices, context.mapping)
            return self.base.reduce(out)
        out = self.base(x)
        context.ops.add_lora(out, x, self.lora_a, self.lora_b, self.out_slices, context.mapping)
        return out

    def extra_repr(self) -> str:
        return (
            f"modules={','.join(self.module_names)}, slots={self.lora_b.shape[0]}, "
            f"max_rank={self.max_rank}"
        )


def add_lora_layers(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Wraps, in every decoder layer of `model`, each linear its class names in `lora_targets`
    (path under the layer -> the checkpoint modules it fuses) in a LoRALinear with `max_loras`
    empty slots of rank `max_rank` in `dtype` (the model's). Call it after the weights are
    loaded and before they are packed or quantized. Returns how many."""
    count = 0
    for layer_idx, layer in enumerate(model.layers):
        for path, modules in model.lora_targets.items():
            parent_path, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            linear = LoRALinear(
                getattr(parent, name), modules, layer_idx, max_loras, max_rank, dtype
            )
            setattr(parent, name, linear)
            count += 1
    return count

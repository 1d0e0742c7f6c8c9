"""ctypes wrapper of lora.c: each token row's LoRA delta added to a linear's output on CPU, bf16
or float32, one call for a step's rows of every adapter (quire/lora/ops.py's CpuLoRAOps); and a
projection on GGUF blocks with its rows' deltas in one parallel region, as the C decode step
runs it."""

from __future__ import annotations

import torch

from quire.kernels.cpu import load_library


def supported(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and load_library() is not None
    )


def lora_add(
    out: torch.Tensor,  # [tokens, out] bf16 or float32, rows contiguous; updated in place
    x: torch.Tensor,  # [tokens, in], out's dtype, rows contiguous
    lora_a: torch.Tensor,  # [slots, modules * max_rank, in] out's dtype, contiguous
    lora_b: torch.Tensor,  # [slots, max_rank, out] out's dtype (B transposed), contiguous
    token_slots: torch.Tensor,  # [tokens] int32, -1: no adapter
    out_slices: torch.Tensor,  # [modules, 2] int32: each module's first column and width
) -> None:
    assert x.dtype == out.dtype == lora_a.dtype == lora_b.dtype
    assert x.stride(1) == 1 and out.stride(1) == 1
    assert lora_a.is_contiguous() and lora_b.is_contiguous() and token_slots.dtype == torch.int32
    status = load_library().lora_add(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        out.stride(0),
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        token_slots.data_ptr(),
        out_slices.data_ptr(),
        out_slices.shape[0],
        x.shape[0],
        x.shape[1],
        out.shape[1],
        lora_b.shape[1],
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError("lora_add: out of memory, or shapes the kernel does not take")


def qmatmul_lora(
    x: torch.Tensor,  # [tokens, in] bf16, rows contiguous
    packed: torch.Tensor,  # qmatmul.pack's (or pack_parts') blocks
    qtype: str,  # a qmatmul format, or parts' joined by "+"
    bias: torch.Tensor | None,  # [out] bf16
    out_features: int,
    lora_a: torch.Tensor,  # as lora_add's, bf16
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    out_slices: torch.Tensor,
    num_threads: int | None = None,  # default: torch's
) -> torch.Tensor:  # [tokens, out] bf16
    """x W^T (+ b) on GGUF blocks with each row's adapter delta, in one parallel region (the C
    decode step's projection with adapters at a few rows): qmatmul, then lora_add, bit for bit."""
    from quire.kernels.cpu import qmatmul

    assert x.dtype == lora_a.dtype == lora_b.dtype == torch.bfloat16 and x.stride(1) == 1
    assert lora_a.is_contiguous() and lora_b.is_contiguous() and token_slots.dtype == torch.int32
    out = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    status = load_library().qmatmul_lora_bf16(
        qmatmul.format_of(qtype),
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out_features,
        x.shape[0],
        out_features,
        x.shape[1],
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        token_slots.data_ptr(),
        out_slices.data_ptr(),
        out_slices.shape[0],
        lora_b.shape[1],
        num_threads or torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"qmatmul_lora: status {status} for {tuple(x.shape)} x {qtype}")
    return out

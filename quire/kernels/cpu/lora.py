"""ctypes wrapper of lora.c: each token row's LoRA delta added to a linear's output on CPU, bf16
or float32, one call for a step's rows of every adapter (quire/lora/ops.py's CpuLoRAOps)."""

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

"""The Triton LoRA shrink/expand kernels add what the torch ops add, for prompt chunks, decode
rows and base-model rows mixed in one step, over float32 or bf16 adapter stacks. Without CUDA
they run in Triton's interpreter, on float32 rows (the interpreter's tl.dot is wrong on bf16
inputs; the kernels widen bf16 stacks to float32 before their dots)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, at import

pytest.importorskip("triton")

from quire.layers.lora_linear import LoRAMapping  # noqa: E402
from quire.lora.ops import TorchLoRAOps  # noqa: E402
from quire.lora.triton_ops import TritonLoRAOps, _shrink_kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(_shrink_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "quire.lora.triton_ops was imported before TRITON_INTERPRET=1 was set",
        allow_module_level=True,
    )


@pytest.mark.parametrize("stack_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "max_rank, out_slices",
    [(8, [(0, 24), (24, 8), (32, 8)]), (16, [(0, 40)]), (32, [(0, 20), (20, 20)])],
)
def test_triton_kernels_add_what_the_torch_ops_add(max_rank, out_slices, stack_dtype):
    generator = torch.Generator().manual_seed(max_rank)
    in_features, out_features = 40, 40
    lora_a = torch.randn(3, len(out_slices) * max_rank, in_features, generator=generator)
    lora_b = torch.randn(3, max_rank, out_features, generator=generator)
    lora_a, lora_b = lora_a.to(stack_dtype), lora_b.to(stack_dtype)
    x = torch.randn(23, in_features, generator=generator)
    base = torch.randn(23, out_features, generator=generator)
    # prompt chunks (5, 9 rows), decode rows of three slots, and rows of the base model
    slots, sizes = [1, -1, 0, 2, 1, 0, -1], [5, 3, 1, 1, 1, 9, 3]
    want = base.clone()
    TorchLoRAOps().add_lora(
        want, x, lora_a, lora_b, out_slices, LoRAMapping.from_requests(slots, sizes)
    )
    got = base.to(DEVICE)
    TritonLoRAOps().add_lora(
        got,
        x.to(DEVICE),
        lora_a.to(DEVICE),
        lora_b.to(DEVICE),
        out_slices,
        LoRAMapping.from_requests(slots, sizes, DEVICE),
    )
    assert torch.equal(got[5:8].cpu(), base[5:8])  # base-model rows untouched
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-5)

"""EngineConfig.resolve_dtype: what `dtype="auto"` runs, per checkpoint dtype, CPU and kernel; the
checks that need no model (context length, tensor-parallel split, KV dtype) made before loading."""

from __future__ import annotations

import pytest
import torch

from quire import config as config_module
from quire.config import EngineConfig
from quire.kernels.cpu import qmatmul


@pytest.fixture
def cpu_config(tiny_llama) -> EngineConfig:
    return EngineConfig(tiny_llama, device="cpu")


@pytest.mark.parametrize(
    "checkpoint, expected",
    [
        ("bfloat16", torch.bfloat16),
        ("float16", torch.bfloat16),
        ("float32", torch.float32),
        (None, torch.bfloat16),
    ],
)
def test_auto_on_a_bf16_cpu_takes_the_checkpoint_dtype_with_float16_as_bf16(
    cpu_config, monkeypatch, checkpoint, expected
):
    monkeypatch.setattr(config_module, "onednn_runs_bf16", lambda: True)
    assert cpu_config.resolve_dtype(checkpoint) == expected


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "float32", None])
def test_auto_on_an_avx2_only_cpu_without_the_gemv_kernel_runs_float32(
    cpu_config, monkeypatch, checkpoint
):
    monkeypatch.setattr(config_module, "onednn_runs_bf16", lambda: False)
    monkeypatch.setattr(config_module.gemv, "available", lambda: False)
    assert cpu_config.resolve_dtype(checkpoint) == torch.float32


@pytest.mark.parametrize(
    "checkpoint, settings, expected",
    [
        ("bfloat16", {}, torch.bfloat16),
        ("float16", {}, torch.bfloat16),
        (None, {}, torch.bfloat16),
        ("float32", {}, torch.float32),
        ("bfloat16", {"gemv": False}, torch.float32),  # torch's bf16 GEMM would run
        ("bfloat16", {"pack_weights": False}, torch.float32),
        ("bfloat16", {"cpu_kernels": False}, torch.float32),
    ],
)
def test_auto_on_an_avx2_only_cpu_runs_bf16_where_the_gemv_kernel_takes_the_matmuls(
    tiny_llama, monkeypatch, checkpoint, settings, expected
):
    monkeypatch.setattr(config_module, "onednn_runs_bf16", lambda: False)
    monkeypatch.setattr(config_module.gemv, "available", lambda: True)
    config = EngineConfig(tiny_llama, device="cpu", **settings)
    assert config.resolve_dtype(checkpoint) == expected


@pytest.mark.parametrize(
    "simd_types, quantization, expected",
    [
        ({"Q8_0", "Q4_0", "Q4_1"}, "auto", torch.bfloat16),  # the AVX2 loops run its blocks
        ({"Q8_0", "Q4_0", "Q4_1"}, "none", torch.float32),  # dequantized: as any checkpoint
        ({"Q4_0", "Q4_1"}, "auto", torch.float32),  # its Q8_0 table would take plain C
        (set(), "auto", torch.float32),  # a plain C build
    ],
)
def test_auto_on_an_avx2_only_cpu_runs_a_gguf_file_bf16_when_simd_runs_its_blocks(
    monkeypatch, simd_types, quantization, expected
):
    """The default file holds Q4_1 matrices and a Q8_0 embedding table."""
    monkeypatch.setattr(config_module, "onednn_runs_bf16", lambda: False)
    monkeypatch.setattr(config_module.gemv, "available", lambda: False)
    monkeypatch.setattr(qmatmul, "simd_types", lambda: frozenset(simd_types))
    config = EngineConfig(device="cpu", quantization=quantization)
    assert config.resolve_dtype("bfloat16") == expected


def test_an_explicit_dtype_is_kept_whatever_the_cpu(cpu_config, monkeypatch):
    monkeypatch.setattr(config_module, "onednn_runs_bf16", lambda: False)
    cpu_config.dtype = "bfloat16"
    assert cpu_config.resolve_dtype("float32") == torch.bfloat16


def test_a_draft_model_under_tensor_parallelism_is_refused_at_start(tmp_path):
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, speculative_config=spec)


def test_an_unknown_quantization_is_refused_with_the_choices(tiny_llama):
    with pytest.raises(
        ValueError, match="quantization must be one of auto, none, int8; got 'int4'"
    ):
        EngineConfig(tiny_llama, quantization="int4")


def test_a_negative_grammar_cache_bound_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"grammar_cache_bytes must be >= 0, got -1\."):
        EngineConfig(tiny_llama, grammar_cache_bytes=-1)


# ---- what needs no model is refused before anything loads (EngineConfig loads nothing) ------
def test_a_max_model_len_beyond_the_gguf_context_is_refused_from_its_header(default_model):
    with pytest.raises(ValueError) as error:
        EngineConfig(default_model, max_model_len=100_000)
    assert str(error.value) == (
        "max_model_len 100000 exceeds the model's max_position_embeddings (8192); pass a "
        "smaller max_model_len."
    )


def test_a_tensor_parallel_size_the_heads_do_not_divide_by_is_refused(default_model, tiny_llama):
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct.Q4_1.gguf's 9 query heads"):
        EngineConfig(default_model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"size 3 .* 4 query heads and 2 KV heads; .*: 1, 2, 4\."):
        EngineConfig(tiny_llama, tensor_parallel_size=3)


def test_a_quantized_kv_cache_under_explicit_float32_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs bfloat16 activations"):
        EngineConfig(tiny_llama, dtype="float32", kv_cache_dtype="int8")

"""EngineConfig.resolve_dtype: what `dtype="auto"` runs, per checkpoint dtype and CPU."""

from __future__ import annotations

import pytest
import torch

from quire import config as config_module
from quire.config import EngineConfig


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
def test_auto_on_an_avx2_only_cpu_runs_float32(cpu_config, monkeypatch, checkpoint):
    monkeypatch.setattr(config_module, "onednn_runs_bf16", lambda: False)
    assert cpu_config.resolve_dtype(checkpoint) == torch.float32


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

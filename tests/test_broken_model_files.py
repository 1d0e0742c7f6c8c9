"""A model file quire cannot use is one line naming the file and what is wrong: a ModelFileError
(a ValueError) from LLM(), and from `quire generate` / `quire serve` that line on stderr and exit
code 2, with the traceback only at --log-level debug."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from quire.entrypoints.cli import main
from quire.entrypoints.llm import LLM
from quire.model.model_config import ModelFileError

SMALL_POOL = {"kv_cache_memory": 8 << 20}


def _truncated(default_model: str, tmp_path: Path, size: int) -> str:
    path = tmp_path / f"cut-{size}.gguf"
    with open(default_model, "rb") as f:
        path.write_bytes(f.read(size))
    return str(path)


def _header_cut(path: str) -> str:
    return (
        f"{path}: the GGUF file is truncated: 1000 bytes, its header runs past the end "
        "(an interrupted download or copy?)"
    )


def _tensor_cut(path: str, size: int) -> str:
    # the default file's header ends at 1785664 bytes; its first tensor is the Q8_0 embedding
    return (
        f"{path}: the GGUF file is truncated: {size} bytes, and tensor 'token_embd.weight' "
        "needs bytes 1785664 to 31866688 (an interrupted download or copy?)"
    )


def test_a_gguf_cut_inside_its_header_is_named(default_model, tmp_path):
    path = _truncated(default_model, tmp_path, 1000)
    with pytest.raises(ModelFileError) as error:
        LLM(path)
    assert str(error.value) == _header_cut(path)


@pytest.mark.parametrize("size", [3_000_000, 20_000_000])
def test_a_gguf_cut_inside_its_tensors_is_named(default_model, tmp_path, size):
    path = _truncated(default_model, tmp_path, size)
    with pytest.raises(ModelFileError) as error:
        LLM(path)
    assert str(error.value) == _tensor_cut(path, size)


def test_a_file_that_is_not_gguf_is_named(default_model, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelFileError) as error:
        LLM(str(path))
    assert str(error.value) == (
        f"{path}: not a GGUF file: it starts with b'PK\\x03\\x04', a GGUF file with b'GGUF'"
    )


def test_generate_on_a_truncated_gguf_prints_one_line_and_exits_2(default_model, tmp_path, capsys):
    path = _truncated(default_model, tmp_path, 1000)
    assert main(["generate", "Hello", "--model", path]) == 2
    assert capsys.readouterr().err == f"error: {_header_cut(path)}\n"


def test_serve_on_a_truncated_gguf_prints_one_line_and_exits_2(default_model, tmp_path, capsys):
    path = _truncated(default_model, tmp_path, 3_000_000)
    assert main(["serve", path, "--port", "0"]) == 2
    assert capsys.readouterr().err == f"error: {_tensor_cut(path, 3_000_000)}\n"


def test_debug_logging_adds_the_traceback(default_model, tmp_path, capsys):
    path = _truncated(default_model, tmp_path, 1000)
    assert main(["--log-level", "debug", "generate", "Hello", "--model", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith(f"error: {_header_cut(path)}\n")


# ---- Hugging Face folders ----------------------------------------------------------------------
@pytest.fixture
def model_copy(tiny_llama, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


def _edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    for key, value in changes.items():
        if value is None:
            del config[key]
    (model / "config.json").write_text(json.dumps(config))


def test_a_config_that_is_not_json_is_named(model_copy, capsys):
    (model_copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],\n')
    assert main(["generate", "Hello", "--model", str(model_copy)]) == 2
    assert capsys.readouterr().err == (
        f"error: {model_copy}/config.json: not valid JSON (Expecting property name enclosed in "
        "double quotes: line 2 column 1 (char 40))\n"
    )


def test_serve_with_a_config_missing_a_key_prints_one_line_and_exits_2(model_copy, capsys):
    _edit_config(model_copy, num_attention_heads=None)
    assert main(["serve", str(model_copy), "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"error: {model_copy}/config.json: num_attention_heads is missing (a positive integer)\n"
    )


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"num_attention_heads": "4"}, "num_attention_heads must be a positive integer, not '4'"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer, not 0"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false, not 'no'"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number, not '1e-6'"),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads (4) is not a multiple of num_key_value_heads (3)",
        ),
        (
            {"architectures": "LlamaForCausalLM"},
            "architectures must be a list of class names, not 'LlamaForCausalLM'",
        ),
    ],
)
def test_an_ill_typed_config_key_is_named(model_copy, changes, problem):
    _edit_config(model_copy, **changes)
    with pytest.raises(ModelFileError) as error:
        LLM(str(model_copy), **SMALL_POOL)
    assert str(error.value) == f"{model_copy}/config.json: {problem}"


def test_a_missing_tensor_is_named(model_copy):
    weights = load_file(model_copy / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFileError) as error:
        LLM(str(model_copy), **SMALL_POOL)
    assert str(error.value) == (
        f"{model_copy}: Checkpoint is missing tensors: ['layers.1.mlp.down_proj.weight']"
    )


def test_a_tensor_of_the_wrong_shape_is_named(model_copy):
    _edit_config(model_copy, intermediate_size=96)  # the checkpoint's MLP is 128 wide
    with pytest.raises(ModelFileError) as error:
        LLM(str(model_copy), **SMALL_POOL)
    assert str(error.value) == (
        f"{model_copy}: Checkpoint tensor 'layers.0.mlp.down_proj.weight' has shape (64, 128), "
        "expected (64, 96)."
    )


@pytest.mark.parametrize(
    "engine_args",
    [{"tensor_parallel_size": 2}, {"engine_core_process": True}],
    ids=["tensor-parallel ranks", "engine-core process"],
)
def test_a_missing_tensor_is_named_from_a_child_process(model_copy, engine_args, capsys):
    """The ranks and the engine core load the model in processes of their own: the same one
    line reaches the user, and `quire generate` exits 2 with it."""
    weights = load_file(model_copy / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model_copy / "model.safetensors", metadata={"format": "pt"})
    expected = f"{model_copy}: Checkpoint is missing tensors: ['layers.1.mlp.down_proj.weight']"
    with pytest.raises(ModelFileError) as error:
        LLM(str(model_copy), **SMALL_POOL, **engine_args)
    assert str(error.value) == expected
    flags = [f"--{name.replace('_', '-')}" for name in engine_args]
    if "tensor_parallel_size" in engine_args:
        flags.append("2")
    argv = ["generate", "hi", "--model", str(model_copy), "--kv-cache-memory", str(8 << 20)]
    assert main(argv + flags) == 2
    assert capsys.readouterr().err.strip() == f"error: {expected}"

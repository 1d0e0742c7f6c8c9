"""EngineArgs is the one declaration of the engine's knobs: the `quire` flags (vLLM's spellings)
and `LLM(...)`'s keyword arguments are made from it and agree with it; `quire serve MODEL`; each
subcommand's --help lists the flags it uses, each with its default."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

import pytest

from quire import LLM, envs
from quire.config import EngineConfig, resolve_config
from quire.engine_args import EngineArgs
from quire.entrypoints.cli import build_parser, main, serve_model
from quire.layers.quantized_linear import KERNEL_TYPES

# The flags as vLLM spells them, then quire's own (--num-kv-blocks and the CPU kernel choices).
EXPECTED_FLAGS = {
    "--model": "model",
    "--tokenizer": "tokenizer",
    "--dtype": "dtype",
    "--quantization": "quantization",
    "--device": "device",
    "--max-model-len": "max_model_len",
    "--block-size": "block_size",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--no-enable-prefix-caching": "enable_prefix_caching",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--kv-cache-memory": "kv_cache_memory",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--attention-backend": "attention_backend",
    "--enforce-eager": "enforce_eager",
    "--no-enforce-eager": "enforce_eager",
    "--seed": "seed",
    "--distributed-executor-backend": "distributed_executor_backend",
    "--ray-address": "ray_address",
    "--ray-placement-strategy": "ray_placement_strategy",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--tensor-parallel-port": "tensor_parallel_port",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "-pp": "pipeline_parallel_size",
    "--pp-layer-partition": "pp_layer_partition",
    "--max-steps-in-flight": "max_steps_in_flight",
    "--async-scheduling": "async_scheduling",
    "--no-async-scheduling": "async_scheduling",
    "--engine-core-process": "engine_core_process",
    "--no-engine-core-process": "engine_core_process",
    "--speculative-config": "speculative_config",
    "--disaggregation-mode": "disaggregation_mode",
    "--kv-transfer-config": "kv_transfer_config",
    "--kv-host": "kv_host",
    "--kv-port": "kv_port",
    "--kv-lease-timeout": "kv_lease_timeout",
    "--kv-transfer-timeout": "kv_transfer_timeout",
    "--grammar-cache-bytes": "grammar_cache_bytes",
    "--num-kv-blocks": "num_kv_blocks",
    "--cpu-kernels": "cpu_kernels",
    "--no-cpu-kernels": "cpu_kernels",
    "--pack-weights": "pack_weights",
    "--no-pack-weights": "pack_weights",
    "--gemv": "gemv",
    "--no-gemv": "gemv",
    "--gemv-fma": "gemv_fma",
    "--no-gemv-fma": "gemv_fma",
    "--cpu-amx": "cpu_amx",
    "--no-cpu-amx": "cpu_amx",
    "--huge-pages": "huge_pages",
    "--no-huge-pages": "huge_pages",
    "--enable-lora": "enable_lora",
    "--no-enable-lora": "enable_lora",
    "--lora-modules": "lora_modules",
    "--max-loras": "max_loras",
    "--max-lora-rank": "max_lora_rank",
    "--max-cpu-loras": "max_cpu_loras",
}


SERVING_FLAGS = {
    "--disaggregation-mode",
    "--kv-transfer-config",
    "--kv-host",
    "--kv-port",
    "--kv-lease-timeout",
    "--kv-transfer-timeout",
}
SERVER_FLAGS = SERVING_FLAGS | {"--host", "--port", "--api-key", "--served-model-name"}
SUBCOMMANDS = [
    ["generate"],
    ["serve"],
    ["router"],
    ["cluster"],
    ["chat"],
    ["bench", "throughput"],
    ["bench", "latency"],
    ["bench", "serve"],
    ["bench", "speculative"],
    ["bench", "pd-profile"],
]
# The subcommands that run a model in this process
OFFLINE_COMMANDS = [["generate"], ["chat"], ["bench", "throughput"], ["bench", "latency"]]


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, serving=True)
    return parser


def help_entries(command: list[str], capsys) -> dict[str, str]:
    """`quire COMMAND --help`: each flag's entry (its flags line and help), keyed by its first
    flag, the words joined with single spaces."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    entries: dict[str, str] = {}
    flag = None
    for line in capsys.readouterr().out.splitlines():
        if match := re.match(r"  (-[-\w]+)", line):
            flag = match.group(1)
            entries[flag] = ""
        elif not line.startswith("   "):
            flag = None  # a group's title or the end of the options
        if flag is not None:
            entries[flag] = " ".join((entries[flag] + " " + line).split())
    return entries


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineArgs)]


def test_the_flags_are_vllms_spellings_one_or_a_no_pair_per_field() -> None:
    flags = {
        option: action.dest
        for action in engine_parser()._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    }
    assert flags == EXPECTED_FLAGS
    assert set(flags.values()) == set(field_names())


def test_no_flags_give_engine_args_defaults() -> None:
    args = engine_parser().parse_args([])
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    assert (args.block_size, args.max_num_seqs, args.enable_prefix_caching) == (16, 256, True)


def test_flags_set_their_fields() -> None:
    args = engine_parser().parse_args(
        "--model m.gguf --dtype float32 --max-num-seqs 8 --no-enable-prefix-caching "
        "--kv-cache-memory 1000000 --gpu-memory-utilization 0.5 --enforce-eager "
        "--no-gemv --gemv-fma --no-huge-pages".split()
    )
    assert EngineArgs.from_cli_args(args) == dataclasses.replace(
        EngineArgs(),
        model="m.gguf",
        dtype="float32",
        max_num_seqs=8,
        enable_prefix_caching=False,
        kv_cache_memory=1_000_000,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        gemv=False,
        gemv_fma=True,
        huge_pages=False,
    )


@pytest.mark.parametrize("flag", ["--dtype=float64", "--attention-backend=flash", "--seed=x"])
def test_a_bad_flag_value_is_refused(flag, capsys) -> None:
    with pytest.raises(SystemExit):
        engine_parser().parse_args([flag])
    assert flag.split("=")[0] in capsys.readouterr().err


def test_kernel_choices_default_to_the_environment(monkeypatch) -> None:
    monkeypatch.setattr(
        envs, "_ENVIRONMENT", envs.Environment(QUIRE_PACK_WEIGHTS=False, QUIRE_GEMV_FMA=True)
    )
    assert (EngineArgs().pack_weights, EngineArgs().gemv_fma, EngineArgs().gemv) == (
        False,
        True,
        True,
    )
    args = engine_parser().parse_args([])
    assert (args.pack_weights, args.gemv_fma) == (False, True)


def test_every_field_is_an_llm_keyword_with_the_same_default() -> None:
    params = inspect.signature(LLM).parameters
    assert list(params) == field_names()
    defaults = EngineArgs()
    assert {name: p.default for name, p in params.items()} == {
        name: getattr(defaults, name) for name in field_names()
    }
    assert params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert {p.kind for name, p in params.items() if name != "model"} == {
        inspect.Parameter.KEYWORD_ONLY
    }


def test_an_unknown_llm_keyword_names_the_closest_field() -> None:
    with pytest.raises(TypeError, match="'max_num_seq': did you mean 'max_num_seqs'") as error:
        LLM(max_num_seq=4)
    assert "max_num_batched_tokens, enable_prefix_caching" in str(error.value)


def test_an_unknown_llm_keyword_with_no_close_field_lists_them_all() -> None:
    with pytest.raises(TypeError, match="Unknown engine argument 'zzz': The engine arguments are"):
        LLM(zzz=1)


def test_create_engine_config_validates_and_resolves(tmp_path) -> None:
    model = tmp_path / "model.gguf"
    model.touch()
    config = EngineArgs(model=str(model), device="cpu", gemv=False).create_engine_config()
    assert type(config) is EngineConfig
    assert (config.attention_backend, config.gemv, config.block_size) == ("torch", False, 16)
    with pytest.raises(ValueError, match="block_size must be a power of two, got 12"):
        EngineArgs(model=str(model), block_size=12).create_engine_config()


def test_serve_takes_the_model_as_a_positional_argument() -> None:
    args = build_parser().parse_args(["serve", "path/to/model", "--port", "9000"])
    assert serve_model(args) == "path/to/model"
    assert args.port == 9000


@pytest.mark.parametrize(
    "argv, model",
    [
        (["serve", "--model", "a"], "a"),
        (["serve", "a", "--model", "a"], "a"),
        (["serve"], None),
    ],
)
def test_serve_still_takes_model_as_a_flag(argv, model) -> None:
    assert serve_model(build_parser().parse_args(argv)) == model


def test_serve_refuses_two_different_models() -> None:
    args = build_parser().parse_args(["serve", "a", "--model", "b"])
    with pytest.raises(ValueError, match="given twice, as 'a' and --model 'b'"):
        serve_model(args)


@pytest.mark.parametrize("command", OFFLINE_COMMANDS, ids=" ".join)
def test_every_model_subcommand_takes_the_engine_flags(command) -> None:
    argv = [*command, "hi"] if command == ["generate"] else command
    args = build_parser().parse_args([*argv, "--max-num-seqs", "3", "--no-gemv"])
    assert (args.max_num_seqs, args.gemv) == (3, False)
    serving = {flag[2:].replace("-", "_") for flag in SERVING_FLAGS}
    assert set(field_names()) - serving <= set(vars(args))
    assert EngineArgs.from_cli_args(args).kv_host == EngineArgs().kv_host


@pytest.mark.parametrize("command", [*OFFLINE_COMMANDS, ["bench", "speculative"]], ids=" ".join)
def test_a_command_that_serves_nothing_lists_no_server_flag(command, capsys) -> None:
    flags = set(help_entries(command, capsys))
    assert flags & SERVER_FLAGS == set()
    assert {"--model", "--quantization", "--tensor-parallel-size", "-h"} <= flags


@pytest.mark.parametrize("command", [["router"], ["cluster"]])
def test_only_serve_takes_the_disaggregation_flags(command, capsys) -> None:
    assert set(help_entries(command, capsys)) & SERVING_FLAGS == set()
    assert SERVER_FLAGS <= set(help_entries(["serve"], capsys))
    args = build_parser().parse_args(["serve", "--disaggregation-mode", "decode", "--kv-port", "9"])
    assert EngineArgs.from_cli_args(args) == dataclasses.replace(
        EngineArgs(), disaggregation_mode="decode", kv_port=9
    )


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=" ".join)
def test_every_flag_shows_its_default(command, capsys) -> None:
    entries = help_entries(command, capsys)
    required = {"bench pd-profile": {"--prefill", "--decode", "--output"}}.get(" ".join(command))
    without = {flag for flag, text in entries.items() if "default" not in text}
    assert without == {"-h"} | (required or set())


def test_quantization_help_names_every_gguf_type_kept_in_blocks(capsys) -> None:
    text = help_entries(["generate"], capsys)["--quantization"]
    named = set(re.findall(r"\bQ\d_[01K]\b", text))
    assert named == set(KERNEL_TYPES) == {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_num_seqs", "8", "max_num_seqs must be int, got str '8'"),
        ("block_size", True, "block_size must be int, got bool True"),
        ("enable_prefix_caching", 1, "enable_prefix_caching must be bool, got int 1"),
        ("gemv_fma", "yes", "gemv_fma must be bool or None, got str 'yes'"),
        ("max_model_len", 1.5, "max_model_len must be int or None, got float 1.5"),
        ("model", 3, "model must be str or None, got int 3"),
    ],
)
def test_a_value_of_the_wrong_type_raises_naming_the_field(field, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**{field: value}).create_engine_config()


def test_an_int_is_a_float_a_numpy_int_an_int_and_a_path_a_str(tmp_path) -> None:
    import numpy as np

    model = tmp_path / "model.gguf"
    model.touch()
    config = EngineArgs(
        model=model, gpu_memory_utilization=1, max_num_seqs=np.int64(8)
    ).create_engine_config()
    assert (config.model, config.gpu_memory_utilization, config.max_num_seqs) == (str(model), 1, 8)


def test_kv_transfer_config_is_vllms_spelling_of_the_disaggregation_flags(tiny_llama):
    config = EngineArgs(
        model=tiny_llama,
        kv_transfer_config={"kv_connector": "QuireConnector", "kv_role": "kv_consumer"},
    ).create_engine_config()
    assert config.disaggregation_mode == "decode"
    assert (config.kv_host, config.kv_port) == ("127.0.0.1", None)  # no socket bound yet
    endpoint = resolve_config(config).kv_transfer
    assert endpoint.host == "127.0.0.1" and 0 < endpoint.port < 65536  # a free port
    with pytest.raises(ValueError, match="kv_role must be one of kv_producer, kv_consumer"):
        EngineArgs(
            model=tiny_llama, kv_transfer_config={"kv_role": "kv_leader"}
        ).create_engine_config()


def test_the_grammar_cache_bound_is_a_flag_with_a_512_mib_default() -> None:
    assert EngineArgs().grammar_cache_bytes == 512 * 2**20
    args = engine_parser().parse_args(["--grammar-cache-bytes", "1000"])
    assert EngineArgs.from_cli_args(args).grammar_cache_bytes == 1000

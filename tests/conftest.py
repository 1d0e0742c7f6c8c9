"""Shared fixtures and helpers: the default GGUF model's tokenizer, tiny random Hugging Face
checkpoints, engines over them (`make_llm`), LoRA adapters on them (`make_adapter`), greedy
parameters (`greedy`) and the idle invariant (`assert_idle`)."""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter; read when quire.kernels is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from quire import LLM, SamplingParams  # noqa: E402
from quire.config import default_model_path  # noqa: E402

SMALL_POOL = 64  # KV blocks of `make_llm`'s engines: a default-sized pool takes seconds to allocate


def pytest_terminal_summary(terminalreporter) -> None:
    """Names the CPU and the matmul paths this run covered, after the results (also under -q):
    they depend on both (AMX tiles or AVX-512 for bf16; VNNI, AVX2 or plain C for GGUF blocks)."""
    from quire.kernels import cpu as cpu_kernels
    from quire.kernels.cpu import gemv, qmatmul

    cpu = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    terminalreporter.write_line(
        f"quire kernels: {cpu}; bf16 matmul {gemv.path()}, GGUF blocks {qmatmul.path()} "
        f"(prompt rows {qmatmul.prompt_path()}), "
        f"decode attention {cpu_kernels.decode_attention_path()}, "
        f"prefill attention {cpu_kernels.prefill_attention_path()}"
    )


# Shapes chosen to cover GQA ratios, head_dim != hidden / heads, tied and untied embeddings.
TINY_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
}


def token_prompts(lengths: list[int]) -> list[dict]:
    """Distinct token-id prompts of the given lengths (no shared prefix)."""
    return [
        {"prompt_token_ids": [(97 * i + 13 * j) % 40000 + 10 for j in range(n)]}
        for i, n in enumerate(lengths)
    ]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored); `kwargs` are further
    SamplingParams fields."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, path: str, seed: int, **lora) -> str:
    """A peft LoRA adapter with random (non-zero) A and B on `base`, saved at `path`; `lora`
    are LoraConfig's fields (r, lora_alpha, target_modules: default every linear)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, **{"target_modules": LORA_MODULES, **lora})
    get_peft_model(model, config).save_pretrained(path)
    return path


def make_llm(model: str, **engine_args) -> LLM:
    """An LLM over `model` with a pool of SMALL_POOL KV blocks; `engine_args` (LLM's keyword
    arguments) override that or add to it."""
    return LLM(model, **{"num_kv_blocks": SMALL_POOL, **engine_args})


def assert_idle(*engines, timeout: float = 10.0) -> None:
    """The idle invariant on each engine (an LLM, LLMEngine or AsyncLLM), via its
    `check_invariants`: nothing running or waiting, every KV block free with ref count 0, no
    request left on any rank's worker. An AsyncLLM is first given up to `timeout` seconds to
    finish its requests and K/V transfers (its engine thread ends them after the caller saw the
    last output)."""
    from quire.engine.async_engine import AsyncLLM

    for engine in engines:
        if isinstance(engine, AsyncLLM):
            deadline = time.monotonic() + timeout
            while engine.has_work() and time.monotonic() < deadline:
                time.sleep(0.01)
        engine.check_invariants()


def in_process_runner(llm: LLM):
    """The model runner of the LLM's in-process worker (the `uni` executor), for tests of the
    worker's own parts driven by a real engine: the C decode step, CUDA graphs, the draft model,
    the KV cache's memory. The one place tests reach into the worker; everything else goes
    through `LLM.stats()`, `LLM.check_invariants()` and the outputs."""
    return llm.engine.core.executor.worker.runner


def in_process_model(llm: LLM):
    """The target's ModelForward in the LLM's in-process worker: its model, KV cache and fast
    paths (`in_process_runner`)."""
    return in_process_runner(llm).target


def load_model_alone(model: str, **engine_args) -> torch.nn.Module:
    """The model an engine with `engine_args` runs, loaded without an engine (model/loader.py)."""
    from quire.config import resolve_config
    from quire.engine_args import EngineArgs
    from quire.model.loader import load_model

    config = EngineArgs.from_kwargs(model=model, **engine_args).create_engine_config()
    settings = resolve_config(config).model
    return load_model(settings, settings.architecture, settings.dtype, settings.max_model_len)


def worker_pids(llm: LLM) -> list[int]:
    """The process id of each rank's worker, in rank order."""
    return [state.pid for state in llm.engine.worker_states()]


def process_exists(pid: int) -> bool:
    """Whether process `pid` exists (one that ended and was waited for does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def default_model() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, request) -> str:
    """The default model's tokenizer saved as tokenizer.json, reused by the tiny checkpoints.

    QUIRE_TEST_TOKENIZER_DIR names a folder holding that tokenizer already saved, for machines
    without the default model's package (the GPU machine of scripts/gpu_checks.sh)."""
    from quire.model.tokenizer import load_tokenizer

    if saved := os.environ.get("QUIRE_TEST_TOKENIZER_DIR"):
        return saved
    path = tmp_path_factory.mktemp("tokenizer")
    tok = load_tokenizer(request.getfixturevalue("default_model"))
    tok.save_pretrained(path)
    return str(path)


def build_tiny_model(
    path: str,
    arch: str,
    tokenizer_dir: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> str:
    """Saves a random tiny checkpoint of `arch` (SmolLM2's tokenizer) at `path`; `overrides`
    replace config fields (e.g. other shapes)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[arch])
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(
        spec["architectures"][0], "qwen3"
    )
    fields = dict(
        vocab_size=49152,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(spec)
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


@pytest.fixture(scope="session")
def build_model(tokenizer_dir):
    """`build_tiny_model` with the shared tokenizer: build_model(path, arch, **overrides)."""
    return lambda path, arch, **kwargs: build_tiny_model(path, arch, tokenizer_dir, **kwargs)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(str(root / arch), arch, tokenizer_dir) for arch in TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


def use_amx_order(amx: bool) -> None:
    """The C kernels' AMX order on or off, as EngineConfig.cpu_amx sets it (restore it with the
    `kernel_settings` fixture); skips the test when asked for AMX tiles where they cannot run."""
    from quire.kernels import cpu as cpu_kernels
    from quire.kernels.cpu import gemv

    if amx and not gemv.amx_available():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    cpu_kernels.configure(cpu_kernels.KernelSettings(enabled=True, gemv_fma=None, amx=amx))


@pytest.fixture
def kernel_settings():
    """Restores the process's C kernel choices (quire/kernels/cpu `configure`) after a test that
    changes them, directly or by building an engine with other choices."""
    from quire.kernels import cpu as cpu_kernels

    saved = cpu_kernels.settings()
    yield
    cpu_kernels.configure(saved)

"""Every environment variable quire reads, read once (at `import quire`) with its default here.

Code reads `envs.QUIRE_GEMV`, never `os.environ`. The QUIRE_* kernel switches are only defaults:
each is also a field of EngineArgs / EngineConfig (`--no-gemv`, `LLM(gemv=False)`), which is what
the engine and the tests set; the variable serves where no flag reaches (a script, a benchmark
run under `QUIRE_GEMV=0 quire bench ...`). A value that cannot be parsed raises ValueError at
import, naming the variable, rather than silently meaning the default.

Not read here, but set by quire: GOMP_SPINCOUNT. `quire/__init__.py` sets it (unless already
set) to 100000 before torch is imported, because libgomp reads it once when torch loads: with no
spin count, libgomp throttles its spin-wait on small machines and its threads sleep between the
hundreds of short parallel regions of a CPU decode step, each region then paying a futex wake-up.
A Ray rank whose group spans nodes sets GLOO_SOCKET_IFNAME (unless set) to the interface of its
node's Ray address (executor/ray.py): gloo otherwise binds what the host name resolves to, often
a loopback address the other nodes cannot reach.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Environment:
    """The variables, their types and defaults; the docstring under each says what it does."""

    QUIRE_CPU_KERNELS: bool = True
    """0: never build or load the C kernels (quire/kernels/cpu); PyTorch runs attention, norms and
    rotary instead, and no weight gets a GEMV copy. Default of EngineConfig.cpu_kernels."""

    QUIRE_PACK_WEIGHTS: bool = True
    """0: keep bf16 CPU weights as plain `nn.Linear` instead of packing them once at load time
    (quire/layers/linear.py). Default of EngineConfig.pack_weights."""

    QUIRE_GEMV: bool = True
    """0: packed weights get no copy for the GEMV kernel (kernels/cpu/gemv.c), only oneDNN's, and
    the one-call-per-layer CPU decode step is off. Default of EngineConfig.gemv."""

    QUIRE_GEMV_FMA: bool | None = None
    """0 or 1 forces the GEMV kernel's inner loop (0: vdpbf16ps, 1: two float32 FMAs; same bits);
    unset, a timing probe at first use picks the faster. Default of EngineConfig.gemv_fma."""

    QUIRE_CPU_AMX: bool = True
    """0: the C kernels leave AMX tiles alone, and the GEMV kernel sums in its AVX-512 order on
    a CPU with AMX too (to run the path of CPUs without AMX; set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
    and ATEN_CPU_CAPABILITY=avx512 beside it to hide AMX from torch as well). Default of
    EngineConfig.cpu_amx."""

    QUIRE_HUGE_PAGES: bool = True
    """0: no transparent huge pages for the CPU weights and KV cache (quire/worker/host_memory.py).
    Default of EngineConfig.huge_pages."""

    QUIRE_CPU_MARCH: str = "native"
    """The -march the C kernels are built for, e.g. x86-64-v3 to run the AVX2 branches on an
    AVX-512 machine. Part of the build's cache key."""

    QUIRE_API_KEY: str | None = None
    """The API key `quire serve` requires when --api-key is not given; unset: no key."""

    CC: str | None = None
    """The C compiler for the kernels; unset: gcc, else cc, from PATH."""

    XDG_CACHE_HOME: str = os.path.join(os.path.expanduser("~"), ".cache")
    """Where quire keeps its files, under quire/: the built C kernels (kernels/cpu), GGUF files'
    tokenizers (model/tokenizer.py) and the random benchmark checkpoint (bench/models.py)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Environment:
        """The variables as `environ` sets them; the default for each one it does not set (or
        sets to the empty string, as the shell's `VAR= cmd` does)."""
        values = {}
        for field in dataclasses.fields(cls):
            text = environ.get(field.name, "")
            if text:
                values[field.name] = _parse(field.name, field.type, text)
        return cls(**values)


def _parse(name: str, type_name: str, text: str) -> bool | str:
    if type_name.startswith("bool"):
        if text not in ("0", "1"):
            raise ValueError(f"Environment variable {name} must be 0 or 1, got {text!r}.")
        return text == "1"
    return text


_ENVIRONMENT = Environment.from_environ(os.environ)


def __getattr__(name: str) -> bool | str | None:
    """`envs.QUIRE_GEMV`: the value read at import (module attributes resolve through here)."""
    try:
        return getattr(_ENVIRONMENT, name)
    except AttributeError:
        raise AttributeError(f"quire.envs has no variable {name!r}") from None

"""quire/envs.py: every environment variable quire reads, parsed once with its default, and no
other module reading the environment itself."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from quire import envs
from quire.envs import Environment

QUIRE_DIR = pathlib.Path(envs.__file__).parent


def test_unset_variables_take_their_defaults() -> None:
    env = Environment.from_environ({})
    assert env == Environment(
        QUIRE_CPU_KERNELS=True,
        QUIRE_PACK_WEIGHTS=True,
        QUIRE_GEMV=True,
        QUIRE_GEMV_FMA=None,
        QUIRE_CPU_AMX=True,
        QUIRE_HUGE_PAGES=True,
        QUIRE_CPU_MARCH="native",
        QUIRE_API_KEY=None,
        CC=None,
        XDG_CACHE_HOME=os.path.expanduser("~/.cache"),
    )


def test_set_variables_are_parsed() -> None:
    env = Environment.from_environ(
        {
            "QUIRE_GEMV": "0",
            "QUIRE_GEMV_FMA": "1",
            "QUIRE_CPU_AMX": "0",
            "QUIRE_HUGE_PAGES": "0",
            "QUIRE_CPU_MARCH": "x86-64-v3",
            "QUIRE_API_KEY": "secret",
            "XDG_CACHE_HOME": "/tmp/cache",
            "UNRELATED": "x",
        }
    )
    assert (env.QUIRE_GEMV, env.QUIRE_GEMV_FMA, env.QUIRE_HUGE_PAGES) == (False, True, False)
    assert env.QUIRE_CPU_AMX is False
    assert (env.QUIRE_CPU_MARCH, env.QUIRE_API_KEY, env.XDG_CACHE_HOME) == (
        "x86-64-v3",
        "secret",
        "/tmp/cache",
    )
    assert env.QUIRE_CPU_KERNELS is True


def test_an_empty_variable_counts_as_unset() -> None:
    env = Environment.from_environ({"QUIRE_GEMV_FMA": "", "QUIRE_API_KEY": ""})
    assert (env.QUIRE_GEMV_FMA, env.QUIRE_API_KEY) == (None, None)


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_a_switch_that_is_not_0_or_1_raises_naming_the_variable(value) -> None:
    with pytest.raises(ValueError, match=f"QUIRE_PACK_WEIGHTS must be 0 or 1, got '{value}'"):
        Environment.from_environ({"QUIRE_PACK_WEIGHTS": value})


def test_the_module_reads_the_environment_once_at_import() -> None:
    # envs.py loaded on its own (no torch), as a fresh process with the variables set sees it.
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('envs', {str(QUIRE_DIR / 'envs.py')!r})\n"
        "envs = sys.modules['envs'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(envs)\n"
        "print(envs.QUIRE_GEMV, envs.QUIRE_GEMV_FMA, envs.QUIRE_CPU_MARCH, envs.CC)"
    )
    environ = {"PATH": os.environ.get("PATH", ""), "QUIRE_GEMV": "0", "QUIRE_CPU_MARCH": "znver4"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=environ, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["False", "None", "znver4", "None"]


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="quire.envs has no variable 'QUIRE_NOPE'"):
        envs.QUIRE_NOPE  # noqa: B018


def test_no_other_module_reads_the_environment() -> None:
    """Only envs.py reads variables; quire/__init__.py sets GOMP_SPINCOUNT, and a Ray rank
    GLOO_SOCKET_IFNAME (see envs.py)."""
    readers = re.compile(r"os\.environ|os\.getenv|getenv\(")
    found = [
        f"{path.relative_to(QUIRE_DIR)}: {line.strip()}"
        for path in sorted([*QUIRE_DIR.rglob("*.py"), *QUIRE_DIR.rglob("*.c")])
        if path.name != "envs.py"
        for line in path.read_text().splitlines()
        if readers.search(line)
    ]
    assert found == [
        '__init__.py: os.environ.setdefault("GOMP_SPINCOUNT", "100000")',
        'executor/ray.py: os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)',
    ]

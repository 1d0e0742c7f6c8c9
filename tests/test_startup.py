"""What LLM() does to start, counted rather than timed (`quire bench startup` times it): the
GGUF header is read once, by quire's reader, the KV pool is not filled, a GGUF file's tokenizer
is built once, an offline run imports no server package, and start freezes the heap without
leaking a dropped LLM."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import gguf
import pytest
import torch

from quire.engine_args import EngineArgs
from quire.entrypoints.llm import LLM
from quire.model import gguf_loader

_POOL_BYTES = 4 << 30  # the default CPU KV pool (a quarter of memory at most)


def test_llm_reads_the_gguf_header_once_and_never_with_ggufs_reader(default_model, monkeypatch):
    reads: list[str] = []
    read = gguf_loader.read_gguf
    monkeypatch.setattr(gguf_loader, "read_gguf", lambda path: reads.append(path) or read(path))
    constructed: list[str] = []
    init = gguf.GGUFReader.__init__

    def counting_init(self, path, *args, **kwargs):
        constructed.append(str(path))
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting_init)
    gguf_loader._parsed.cache_clear()
    LLM(default_model, kv_cache_memory=_POOL_BYTES)
    assert reads == [os.path.abspath(default_model)]
    assert constructed == []


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_llm_does_not_fill_the_kv_pool(default_model, monkeypatch):
    """No fill call on a tensor of a KV layer's size (4 GiB over 30 layers' K and V: 68 MiB
    each), and the pool takes no memory until blocks are written."""
    filled: list[int] = []
    for name in ("zero_", "fill_"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            filled.append(self.nbytes)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    before = _rss_bytes()
    llm = LLM(default_model, kv_cache_memory=_POOL_BYTES)
    # SmolLM2: 30 layers' K and V, 3 heads x 64 bf16 values each per token, 16 tokens a block
    assert llm.engine.num_kv_blocks == _POOL_BYTES // (30 * 2 * 3 * 64 * 2 * 16)
    assert [n for n in filled if n >= 64 << 20] == []
    assert _rss_bytes() - before < _POOL_BYTES // 4


_SERVER_AND_TRANSPORT = ("fastapi", "starlette", "uvicorn", "httpx", "rich", "zmq", "ray")

_IMPORTS_OF_AN_OFFLINE_RUN = """
import sys
from quire.entrypoints.cli import build_parser
build_parser()
from quire import LLM, SamplingParams
LLM(sys.argv[1], kv_cache_memory=1 << 28).generate(["hi"], SamplingParams(max_tokens=2))
print(" ".join(sorted(set(sys.argv[2:]) & set(sys.modules))))
"""


def test_an_offline_run_imports_no_server_or_transport_package(default_model):
    """`quire --help`, `quire bench` and LLM.generate start without the HTTP server's packages,
    the HTTP client of `quire bench serve` (httpx, which loads rich), pyzmq or Ray: they cost
    start time, and a machine may lack them (the GPU image does)."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_OF_AN_OFFLINE_RUN, default_model, *_SERVER_AND_TRANSPORT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1:] in ([], [""]), done.stdout


_LOAD_TOKENIZER = """
import sys
from quire.model.tokenizer import load_tokenizer
load_tokenizer(sys.argv[1])
print("transformers.models" in sys.modules)
"""


def test_a_gguf_files_tokenizer_is_built_once_then_read_from_the_cache(default_model, tmp_path):
    """Building it imports every model package of transformers (the tokenizer classes it builds
    with) and converts the vocabulary in Python; a later load of the same file, in another
    process, reads the cached result instead. A file changed in place is built again."""
    model = shutil.copy(default_model, tmp_path / "model.gguf")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def built() -> bool:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_TOKENIZER, model],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-1] == "True"

    assert [built(), built()] == [True, False]
    os.utime(model, ns=(0, 0))
    assert built()


@pytest.mark.parametrize("make", ["kwargs", "engine_config"])
def test_start_freezes_the_heap_and_a_dropped_llm_is_still_freed(default_model, make):
    """What start made is taken out of the collector's generations (a full collection walks
    only what the steps made); dropping the LLM gives it back, so its engine, held in reference
    cycles, is freed by the next collection, however the LLM was made (the benches make theirs
    from an EngineConfig, and `bench throughput --compare transformers` needs the memory)."""
    import gc
    import weakref

    if make == "kwargs":
        llm = LLM(default_model, num_kv_blocks=16)
    else:
        config = EngineArgs.from_kwargs(model=default_model, num_kv_blocks=16)
        llm = LLM.from_engine_config(config.create_engine_config())
    assert gc.get_freeze_count() > 10_000  # modules, tokenizer, tables
    engine = weakref.ref(llm.engine)
    llm.generate("Hello", use_tqdm=False)
    del llm
    gc.collect()
    assert engine() is None and gc.get_freeze_count() == 0

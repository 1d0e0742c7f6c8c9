"""GrammarCompiler: structured-output constraints compiled once per (kind, text) by xgrammar.

A constraint (`StructuredOutputsParams`) becomes an xgrammar `CompiledGrammar` for the model's
tokenizer: the token masks of every grammar state are precomputed over the vocabulary, so the
first use of a schema costs milliseconds and later ones a dictionary lookup. The cache is an
LRU bounded by the compiled grammars' bytes (`max_cache_bytes`, xgrammar's `memory_size_bytes`:
a 100,000-member enum alone takes hundreds of MB), keyed by the constraint's kind and text; a
grammar larger than the whole bound is used and not kept. xgrammar's own cache is off so that
one bound holds.

A grammar whose root can never end (a JSON schema's `$ref` cycle with no way out: finite.py) is
refused like one xgrammar cannot compile.

Compiling never slows the engine's steps: xgrammar compiles on one thread per compile
(`max_threads=1`; its default of eight took every core of a small host), on `_COMPILE_THREADS`
daemon threads of this compiler's own, at a lower CPU priority (nice `_COMPILE_NICE`; on Linux a
thread is a task of its own), so the engine's threads win the cores whenever they have work.
xgrammar releases the GIL while it compiles, so a niced compile never holds the event loop or the
engine's Python; the server awaits `submit`'s future, and the process exits without waiting for
a compile.

The vocabulary is the model's logits width (`vocab_size`), which can exceed the tokenizer's:
ids past the tokenizer's are never allowed. The model's EOS ids are the grammar's stop tokens: a
matcher ends (is terminated) when it accepts one at the end of a complete output.

JSON is generated compact (`any_whitespace=False`: ", " and ": " between items, no newlines),
which is vLLM's `disable_any_whitespace`: a small model given free whitespace can pad a JSON
value with newlines until max_tokens.

Thread-safe: the server submits compiles from the event loop while the engine thread looks
grammars up. xgrammar is imported, and the tokenizer's vocabulary read, on the first compile
(on a compile thread).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from quire.sampling_params import StructuredOutputsParams
from quire.structured_output.finite import has_finite_output

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

_COMPILE_THREADS = 2  # a large grammar's compile leaves one for the rest
_COMPILE_NICE = 10  # about a tenth of a core's time against a busy engine thread
DEFAULT_GRAMMAR_CACHE_BYTES = 512 * 2**20  # --grammar-cache-bytes' default (engine_args.py)
_XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # "[14:00:40] /path/file.cc:83: "


class GrammarError(ValueError):
    """A constraint xgrammar cannot compile; `detail` says why."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"structured_outputs.{kind} is invalid: {detail}")
        self.kind = kind
        self.detail = detail


class GrammarCompiler:
    def __init__(
        self,
        load_tokenizer: Callable[[], PreTrainedTokenizerBase],
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
    ) -> None:
        if max_cache_bytes < 0:
            raise ValueError(f"max_cache_bytes must be >= 0, got {max_cache_bytes}.")
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size  # the model's logits width
        self._eos_token_ids = set(eos_token_ids)
        self.max_cache_bytes = max_cache_bytes
        self._compiler: xgrammar.GrammarCompiler | None = None
        # key -> (grammar, its bytes), least recently used first
        self._cache: OrderedDict[tuple[str, str], tuple[xgrammar.CompiledGrammar, int]]
        self._cache = OrderedDict()
        self.cache_bytes = 0  # the cached grammars' memory_size_bytes, summed
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (params, future) to compile
        self._threads: list[threading.Thread] = []  # started on the first compile
        self.num_compiled = 0  # cache misses, since start
        self.num_hits = 0

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `params`, from the cache when it was compiled before.
        Raises GrammarError when xgrammar rejects the schema, regex or grammar."""
        return self.submit(params).result()

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of `params` as a future: done at once from the cache, else
        compiled on the compiler's threads (its exception a GrammarError when xgrammar rejects
        the constraint). Cancelling it drops a compile that has not started."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        cached = self._lookup(params.key)
        if cached is not None:
            future.set_result(cached)
            return future
        with self._lock:
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._work, name="quire-grammar", daemon=True)
                    for _ in range(_COMPILE_THREADS)
                ]
                for thread in self._threads:
                    thread.start()
        self._queue.put((params, future))
        return future

    def _lookup(self, key: tuple[str, str]) -> xgrammar.CompiledGrammar | None:
        with self._lock:
            cached = self._cache.get(key)
            if cached is None:
                return None
            self._cache.move_to_end(key)
            self.num_hits += 1
            return cached[0]

    def _work(self) -> None:
        """A compile thread: daemon (a compile never holds up the process's exit), niced."""
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILE_NICE)
        while True:
            params, future = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                compiled = self._compile_and_keep(params)
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(compiled)

    def _compile_and_keep(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        key = params.key
        cached = self._lookup(key)  # queued twice: compiled by the first
        if cached is not None:
            return cached
        with self._lock:
            compiler = self._xgrammar_compiler()
        compiled = _compile(compiler, params)
        size = compiled.memory_size_bytes
        with self._lock:
            self.num_compiled += 1
            if key not in self._cache and size <= self.max_cache_bytes:
                self._cache[key] = (compiled, size)
                self.cache_bytes += size
                while self.cache_bytes > self.max_cache_bytes:
                    _, (_, evicted) = self._cache.popitem(last=False)
                    self.cache_bytes -= evicted
        return compiled

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar

            tokenizer = self._load_tokenizer()
            stop_ids = set(self._eos_token_ids)
            if tokenizer.eos_token_id is not None:
                stop_ids.add(tokenizer.eos_token_id)
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(stop_ids)
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def _compile(
    compiler: xgrammar.GrammarCompiler, params: StructuredOutputsParams
) -> xgrammar.CompiledGrammar:
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        elif kind == "json_object":
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif kind == "regex":
            compiled = compiler.compile_regex(params.regex)
        elif kind == "choice":
            compiled = compiler.compile_grammar(choice_grammar(params.choice))
        else:
            compiled = compiler.compile_grammar(params.grammar)
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse/convert errors
        detail = _XGRAMMAR_LOCATION.sub("", str(error).strip().splitlines()[0])
        raise GrammarError(kind, detail) from None
    if not has_finite_output(str(compiled.grammar)):
        what = "schema's $refs" if kind == "json" else "grammar's rules"
        raise GrammarError(
            kind,
            f"no finite output matches it: the {what} refer to each other with no way to "
            "end (a required self-reference, or a cycle); make the recursion optional.",
        )
    return compiled


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)

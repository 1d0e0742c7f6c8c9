"""GrammarCompiler: structured-output constraints compiled once per (kind, text) by xgrammar.

A constraint (`StructuredOutputsParams`) becomes an xgrammar `CompiledGrammar` for the model's
tokenizer: the token masks of every grammar state are precomputed over the vocabulary, so the
first use of a schema costs milliseconds and later ones a dictionary lookup. The cache is an
LRU of `MAX_CACHED_GRAMMARS` entries keyed by the constraint's kind and text; xgrammar's own
cache is off so that one bound holds.

The vocabulary is the model's logits width (`vocab_size`), which can exceed the tokenizer's:
ids past the tokenizer's are never allowed. The model's EOS ids are the grammar's stop tokens: a
matcher ends (is terminated) when it accepts one at the end of a complete output.

JSON is generated compact (`any_whitespace=False`: ", " and ": " between items, no newlines),
which is vLLM's `disable_any_whitespace`: a small model given free whitespace can pad a JSON
value with newlines until max_tokens.

Thread-safe: the server compiles on its tokenizer pool's threads while the engine thread looks
grammars up. xgrammar is imported, and the tokenizer's vocabulary read, on the first compile.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from quire.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

MAX_CACHED_GRAMMARS = 256
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
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size  # the model's logits width
        self._eos_token_ids = set(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, since start
        self.num_hits = 0

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `params`, from the cache when it was compiled before.
        Raises GrammarError when xgrammar rejects the schema, regex or grammar."""
        key = params.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return compiled
            compiler = self._xgrammar_compiler()
        compiled = _compile(compiler, params)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            self.num_compiled += 1
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
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def _compile(
    compiler: xgrammar.GrammarCompiler, params: StructuredOutputsParams
) -> xgrammar.CompiledGrammar:
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        return compiler.compile_grammar(params.grammar)
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse/convert errors
        detail = _XGRAMMAR_LOCATION.sub("", str(error).strip().splitlines()[0])
        raise GrammarError(kind, detail) from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)

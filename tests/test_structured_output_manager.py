"""The grammar compiler's cache, the per-request matcher (proposal trimming, rollback) and the
step's bitmask rows, on the default model's tokenizer; and StructuredOutputsParams' checks."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from quire.kernels.cpu import pointwise
from quire.messages import ForkedRequestData, SchedulerOutput
from quire.model.tokenizer import load_tokenizer
from quire.sample.sampler import apply_token_bitmask
from quire.sampling_params import StructuredOutputsParams
from quire.structured_output.compiler import GrammarCompiler, GrammarError, choice_grammar
from quire.structured_output.manager import RequestGrammar, StructuredOutputManager

VOCAB_SIZE = 49152
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return load_tokenizer(default_model)


@pytest.fixture
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, VOCAB_SIZE, [EOS])


def allowed(bitmask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return set(np.nonzero(bits)[0].tolist())


def test_equal_constraints_compile_once(compiler):
    first = compiler.compile(StructuredOutputsParams(json={"type": "object", "required": ["a"]}))
    reordered = compiler.compile(
        StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    )
    as_text = compiler.compile(
        StructuredOutputsParams(json='{"required": ["a"], "type": "object"}')
    )
    assert reordered is first and as_text is first
    assert (compiler.num_compiled, compiler.num_hits) == (1, 2)


def test_kinds_with_the_same_text_are_cached_apart(compiler):
    as_regex = compiler.compile(StructuredOutputsParams(regex="abc"))
    as_grammar = compiler.compile(StructuredOutputsParams(grammar='root ::= "abc"'))
    as_choice = compiler.compile(StructuredOutputsParams(choice=["abc"]))
    assert compiler.num_compiled == 3
    assert len({id(as_regex), id(as_grammar), id(as_choice)}) == 3


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            StructuredOutputsParams(json={"type": "nope"}),
            'structured_outputs.json is invalid: Unsupported type "nope"',
        ),
        (
            StructuredOutputsParams(regex="(abc"),
            "structured_outputs.regex is invalid: Regex parsing error",
        ),
        (
            StructuredOutputsParams(grammar="root ::= foo"),
            'structured_outputs.grammar is invalid: EBNF parser error at line 1, column 10: Rule "foo" is not defined',
        ),
    ],
)
def test_invalid_constraints_raise_naming_the_field(compiler, params, message):
    with pytest.raises(GrammarError, match="^" + re.escape(message)):
        compiler.compile(params)
    assert compiler.num_compiled == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"json": {}, "regex": "a"},
        {"choice": []},
        {"choice": ["a", ""]},
        {"json": "[1"},
        {"json": "[1]"},
    ],
)
def test_params_need_exactly_one_valid_constraint(kwargs):
    with pytest.raises(ValueError, match="^structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_grammar(['a "b"', "c\\d"]) == 'root ::= "a \\"b\\"" | "c\\\\d"'


def test_proposals_are_trimmed_at_the_first_rejected_token(compiler, tokenizer):
    grammar = RequestGrammar(compiler.compile(StructuredOutputsParams(regex="[0-9]+;")))
    digits = tokenizer.encode("123")
    letter = tokenizer.encode("x")
    assert grammar.num_valid_tokens(digits + letter + digits) == len(digits)
    # The matcher is where it was: the same proposals give the same answer.
    assert grammar.num_valid_tokens(digits + letter) == len(digits)


def test_a_stop_token_is_never_a_valid_proposal(compiler, tokenizer):
    grammar = RequestGrammar(compiler.compile(StructuredOutputsParams(choice=["yes"])))
    yes = tokenizer.encode("yes")
    assert grammar.num_valid_tokens(yes + [EOS]) == len(yes)
    for token_id in yes:
        assert grammar.accept_token(token_id)
    assert not grammar.is_terminated
    assert grammar.accept_token(EOS)
    assert grammar.is_terminated


def test_rows_after_proposals_then_rollback(compiler, tokenizer):
    grammar = RequestGrammar(compiler.compile(StructuredOutputsParams(choice=["yes"])))
    yes = tokenizer.encode("yes")
    assert len(yes) == 1
    bitmask = np.zeros((3, VOCAB_SIZE // 32), dtype=np.int32)
    assert grammar.fill_rows(bitmask, 1, yes) == 2
    assert yes[0] in allowed(bitmask[1])
    assert allowed(bitmask[2]) == {EOS}
    assert allowed(bitmask[0]) == set()
    # Rolled back: the next token may still be "yes".
    assert grammar.accept_token(yes[0])


def test_bitmask_rows_per_sampled_position(compiler, tokenizer):
    class Req:
        def __init__(self, grammar, num_computed, num_tokens):
            self.grammar = grammar
            self.num_computed_tokens = num_computed
            self.num_tokens = num_tokens

    yes = tokenizer.encode("yes")
    compiled = compiler.compile(StructuredOutputsParams(choice=["yes"]))
    requests = {
        "plain": Req(None, 9, 10),
        "spec": Req(RequestGrammar(compiled), 9, 10),
        "chunk": Req(RequestGrammar(compiled), 0, 50),  # a prompt chunk: samples nothing
        "decode": Req(RequestGrammar(compiled), 4, 5),
        "fork": Req(RequestGrammar(compiled), 4, 5),
    }
    output = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"plain": 1, "spec": 2, "chunk": 20, "decode": 1},
        total_num_scheduled_tokens=24,
        forked_reqs=[ForkedRequestData("fork", "decode", 1)],
        scheduled_spec_decode_tokens={"spec": yes},
    )
    manager = StructuredOutputManager(compiler, max_rows=8)
    bitmask, first_rows = manager.bitmask(output, requests)
    assert first_rows == {"spec": 0, "decode": 2, "fork": 3}
    assert bitmask.shape == (4, VOCAB_SIZE // 32)
    assert [allowed(row) == {EOS} for row in bitmask] == [False, True, False, False]


def test_no_grammar_in_the_step_leaves_no_bitmask(compiler):
    output = SchedulerOutput([], [], {"a": 1}, 1)
    manager = StructuredOutputManager(compiler, max_rows=4)
    assert manager.bitmask(output, {"a": _Plain()}) == (None, {})


class _Plain:
    grammar = None
    num_computed_tokens = 0
    num_tokens = 1


@pytest.mark.parametrize("kernel", ["quire C", "xgrammar"])
def test_the_bitmask_leaves_exactly_the_allowed_tokens_of_the_masked_rows(kernel, monkeypatch):
    if kernel == "xgrammar":  # the GPU path's kernel, on CPU rows
        monkeypatch.setattr(pointwise, "apply_token_bitmask", lambda *args: False)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB_SIZE, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, VOCAB_SIZE // 32), dtype=torch.int32)
    expected = logits.clone()
    for mask_row, logits_row in enumerate([2, 0]):
        allowed_ids = sorted(allowed(bitmask[mask_row].numpy()))
        keep = torch.full((VOCAB_SIZE,), float("-inf"))
        keep[allowed_ids] = 0.0
        expected[logits_row] += keep
    assert torch.equal(apply_token_bitmask(logits, bitmask, [2, 0]), expected)


# ---- grammars with no finite output, and the cache's byte bound -----------------------------
@pytest.mark.parametrize(
    ("params", "detail"),
    [
        (
            StructuredOutputsParams(
                json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
            ),
            "schema's $refs",
        ),
        (
            StructuredOutputsParams(
                json={
                    "$ref": "#/$defs/a",
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                }
            ),
            "schema's $refs",
        ),
        (
            StructuredOutputsParams(
                json={"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
            ),
            "schema's $refs",
        ),
        (
            StructuredOutputsParams(json={"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
            "schema's $refs",
        ),
        (StructuredOutputsParams(grammar='root ::= root "a"'), "grammar's rules"),
        (StructuredOutputsParams(grammar='root ::= x\nx ::= "a" x'), "grammar's rules"),
    ],
)
def test_a_constraint_with_no_finite_output_is_refused(compiler, params, detail):
    with pytest.raises(GrammarError) as raised:
        compiler.compile(params)
    assert raised.value.detail == (
        f"no finite output matches it: the {detail} refer to each other with no way to end (a "
        "required self-reference, or a cycle); make the recursion optional."
    )


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"x": {"$ref": "#"}}}),
        StructuredOutputsParams(json={"type": "array", "items": {"$ref": "#"}}),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(grammar='root ::= "a" root | "b"'),
        StructuredOutputsParams(grammar='root ::= "a" x{2,3} [^\\]a-z]*\nx ::= "c"+ x? "d"*'),
        StructuredOutputsParams(regex="(ab|c){2,}[0-9]?"),
        StructuredOutputsParams(
            json={"type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}
        ),
    ],
)
def test_a_recursion_with_a_way_out_compiles(compiler, params):
    assert compiler.compile(params) is not None


def enum_schema(index: int, num_members: int = 400) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"enum": [f"v{index}-{i}" for i in range(num_members)]})


def test_the_cache_stays_within_its_byte_bound_least_recently_used_out(tokenizer):
    size = GrammarCompiler(lambda: tokenizer, VOCAB_SIZE, [EOS]).compile(enum_schema(0))
    max_bytes = 3 * size.memory_size_bytes + size.memory_size_bytes // 2  # three such grammars
    compiler = GrammarCompiler(lambda: tokenizer, VOCAB_SIZE, [EOS], max_cache_bytes=max_bytes)
    for index in range(12):
        compiler.compile(enum_schema(index))
        assert 0 < compiler.cache_bytes <= max_bytes
    assert compiler.num_compiled == 12
    compiler.compile(enum_schema(11))  # among the three most recent: kept
    assert compiler.num_hits == 1
    compiler.compile(enum_schema(8))  # the fourth most recent: evicted
    assert (compiler.num_hits, compiler.num_compiled) == (1, 13)


def test_a_grammar_larger_than_the_whole_bound_is_compiled_and_not_kept(tokenizer):
    compiler = GrammarCompiler(lambda: tokenizer, VOCAB_SIZE, [EOS], max_cache_bytes=1000)
    assert compiler.compile(enum_schema(0)) is not None
    assert compiler.cache_bytes == 0
    compiler.compile(enum_schema(0))
    assert (compiler.num_hits, compiler.num_compiled) == (0, 2)

"""Structured outputs through the offline API on SmolLM2 in bf16: grammars share steps with
unconstrained requests without changing them, agree with n-gram speculation and survive
preemption (the matcher never advances twice), and invalid constraints raise ValueError."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import assert_idle

from quire import LLM, SamplingParams
from quire.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "colors": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "colors", "age"],
}
SAMPLE = '{"name": "Ann", "colors": ["red", "green", "blue"], "age": 30}'
CONVERSATIONS = [
    [{"role": "user", "content": f"Repeat exactly this JSON: {SAMPLE}"}],
    [{"role": "user", "content": "Describe a person as JSON."}],
    [{"role": "user", "content": "Tell me about the sea."}],
    [{"role": "user", "content": "Another person, as JSON, please."}],
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
NUM_KV_BLOCKS = 256  # 4096 tokens, ~90 MB: not the default 4 GiB pool per engine


def json_params(temperature: float = 0.0, seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )


PLAIN = SamplingParams(temperature=0, max_tokens=24)
MIXED = [json_params(), json_params(0.8, 1), PLAIN, json_params(1.0, 2)]


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, dtype="bfloat16", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def mixed_reference(llm):
    return [o.outputs[0] for o in llm.chat(CONVERSATIONS, MIXED, use_tqdm=False)]


def test_constrained_outputs_validate(llm, mixed_reference):
    for params, output in zip(MIXED, mixed_reference):
        if params.structured_outputs is not None:
            assert output.finish_reason == "stop", output.text
            jsonschema.validate(json.loads(output.text), SCHEMA)
    assert_idle(llm)


def test_grammars_do_not_change_the_unconstrained_request_beside_them(llm, mixed_reference):
    alone = llm.chat(CONVERSATIONS[2], PLAIN, use_tqdm=False)[0].outputs[0]
    assert mixed_reference[2].token_ids == alone.token_ids
    assert not alone.text.startswith("{")


def test_a_constrained_request_is_the_same_alone_and_in_a_batch(llm, mixed_reference):
    alone = llm.chat(CONVERSATIONS[1], MIXED[1], use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == mixed_reference[1].token_ids


def test_ngram_speculation_keeps_the_constrained_tokens(default_model, mixed_reference):
    spec = LLM(
        default_model, dtype="bfloat16", num_kv_blocks=NUM_KV_BLOCKS, speculative_config=NGRAM
    )
    outputs = [o.outputs[0] for o in spec.chat(CONVERSATIONS, MIXED, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in mixed_reference]
    assert json.loads(outputs[0].text) == json.loads(SAMPLE)
    stats = spec.engine.spec_decoding_stats
    assert stats.num_accepted_tokens > 0  # proposals were verified under the grammar
    assert_idle(spec)


def test_preemption_replays_without_advancing_the_grammar_twice(default_model, mixed_reference):
    small = LLM(default_model, dtype="bfloat16", num_kv_blocks=14, enable_prefix_caching=False)
    outputs = [o.outputs[0] for o in small.chat(CONVERSATIONS, MIXED, use_tqdm=False)]
    assert small.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in mixed_reference]
    assert_idle(small)


def test_n_sequences_each_follow_the_grammar(llm):
    choices = ["alpha", "beta", "gamma", "delta"]
    params = SamplingParams(
        n=4, temperature=1.0, seed=9, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    outputs = llm.chat(CONVERSATIONS[2], params, use_tqdm=False)[0].outputs
    assert len(outputs) == 4
    assert all(o.text in choices and o.finish_reason == "stop" for o in outputs)


def test_regex_and_grammar_outputs_match(llm):
    grammar = (
        'root ::= "(" word ")" | digit digit? "!"\nword ::= [a-z] [a-z]? [a-z]?\ndigit ::= [0-9]'
    )
    params = [
        SamplingParams(
            temperature=0.9,
            seed=4,
            structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{3}-\d{2}"),
        ),
        SamplingParams(
            temperature=0.9,
            seed=4,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(grammar=grammar),
        ),
    ]
    regex_out, grammar_out = llm.chat([CONVERSATIONS[1]] * 2, params, use_tqdm=False)
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", regex_out.outputs[0].text)
    assert re.fullmatch(r"\([a-z]{1,3}\)|[0-9]{1,2}!", grammar_out.outputs[0].text)
    assert grammar_out.outputs[0].finish_reason == "stop"


def test_max_tokens_mid_structure_finishes_with_length(llm):
    params = SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    output = llm.chat(CONVERSATIONS[0], params, use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "length"
    assert SAMPLE.startswith(output.text)


def test_an_invalid_grammar_raises_before_anything_is_queued(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-"))
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex is invalid: "):
        llm.generate(["a", "b"], [PLAIN, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_idle(llm)


def test_a_core_in_its_own_process_compiles_and_follows_its_grammars(default_model, llm):
    choices = ["alpha", "beta"]
    params = SamplingParams(
        n=2, temperature=1.0, seed=1, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    remote = LLM(
        default_model, dtype="bfloat16", num_kv_blocks=NUM_KV_BLOCKS, engine_core_process=True
    )
    try:
        outputs = remote.chat(CONVERSATIONS[2], params, use_tqdm=False)[0].outputs
    finally:
        remote.engine.shutdown()
    local = llm.chat(CONVERSATIONS[2], params, use_tqdm=False)[0].outputs
    assert [o.text for o in outputs] == [o.text for o in local]
    assert all(o.text in choices for o in outputs)

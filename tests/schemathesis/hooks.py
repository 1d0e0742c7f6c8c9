"""The rules of quire's API that no JSON schema can state, declared for schemathesis.

/openapi.json states every rule on a single field. These rules tie fields together or depend on
the tokenizer; a request that breaks one is schema-valid but gets 400, so schema-valid cases that
break them are left out of generation (`filter_case`). Every check still runs on every case that
is generated. The server under test is described by environment variables that
tests/test_openapi_contract.py sets: QUIRE_CONTRACT_MODEL (model folder, for its tokenizer),
QUIRE_CONTRACT_MAX_MODEL_LEN, QUIRE_CONTRACT_CHAT_TEMPLATE (a template file) and
QUIRE_CONTRACT_LORA_PATH (an adapter of the model, which valid load requests are pointed at).

One filter is a budget, not a rule: a request may ask for n = 128 samples of each of many prompts,
valid and served, but minutes of generation on a 2-core CI machine; cases that would generate
more than MAX_GENERATED_TOKENS are left out.
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import Any

import pydantic
import schemathesis

from quire.entrypoints.chat_template import load_chat_template, render_chat
from quire.entrypoints.openai_protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
)
from quire.entrypoints.tool_choice import request_tool_choice
from quire.model.tokenizer import load_tokenizer
from quire.structured_output.compiler import GrammarCompiler, GrammarError

MAX_GENERATED_TOKENS = 1024
MIN_TIMEOUT_S = 60.0


@functools.cache
def _tokenizer():
    return load_tokenizer(os.environ["QUIRE_CONTRACT_MODEL"])


@functools.cache
def _chat_template() -> str:
    return load_chat_template(os.environ["QUIRE_CONTRACT_CHAT_TEMPLATE"])


@functools.cache
def _grammar_compiler() -> GrammarCompiler:
    return GrammarCompiler(_tokenizer, len(_tokenizer()), [])


def _max_model_len() -> int:
    return int(os.environ["QUIRE_CONTRACT_MAX_MODEL_LEN"])


@schemathesis.hook("filter_case").apply_to(method="POST", path="/v1/completions")
def completion_rules(ctx: Any, case: Any) -> bool:
    body = case.body
    if not isinstance(body, dict):
        return True
    max_tokens = body.get("max_tokens", 16)
    lengths = _completion_prompt_lengths(body.get("prompt"))
    return (
        _sampling_rules(body, max_tokens)
        and _structured_output_rules(CompletionRequest, body)
        # best_of: one sample per choice.
        and body.get("best_of") in (None, body.get("n", 1))
        and _fits_context(lengths, max_tokens)
        and _within_budget(body, len(lengths or [1]), max_tokens)
    )


@schemathesis.hook("filter_case").apply_to(method="POST", path="/v1/chat/completions")
def chat_rules(ctx: Any, case: Any) -> bool:
    body = case.body
    if not isinstance(body, dict):
        return True
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    return (
        _sampling_rules(body, max_tokens)
        # top_logprobs needs logprobs.
        and (body.get("top_logprobs") is None or body.get("logprobs") is True)
        and _tool_rules(body)
        and _structured_output_rules(ChatCompletionRequest, body)
        and _fits_context(_chat_prompt_lengths(body), max_tokens)
        and _within_budget(body, 1, max_tokens)
    )


@schemathesis.hook("filter_case").apply_to(method="POST", path="/tokenize")
def tokenize_rules(ctx: Any, case: Any) -> bool:
    """A chat tokenized whole must be short enough to fit the context in characters: the
    server rejects a rendered chat longer than max_model_len times the vocabulary's longest
    token untokenized (api_server.check_prompt_chars; a plain prompt it tokenizes whatever its
    length)."""
    body = case.body
    if not isinstance(body, dict) or "messages" not in body:
        return True
    text = _chat_text(body)
    return text is None or len(text) <= _max_model_len() * _max_token_chars()


@schemathesis.hook("map_body").apply_to(method="POST", path="/v1/load_lora_adapter")
def load_a_real_adapter(ctx: Any, body: Any) -> Any:
    """A schema-valid lora_path must still name an adapter of the base model on the server's
    disk, and a lora_name must be free: a valid body gets the adapter at
    QUIRE_CONTRACT_LORA_PATH and a name no earlier case used, so that it is loaded (200)."""
    try:
        request = LoadLoRAAdapterRequest.model_validate(body)
    except pydantic.ValidationError:
        return body  # invalid as generated: it stays so
    return {
        "lora_name": f"{request.lora_name}-{next(_adapter_names)}",
        "lora_path": os.environ["QUIRE_CONTRACT_LORA_PATH"],
    }


_adapter_names = itertools.count()


@schemathesis.hook("filter_case").apply_to(method="POST", path="/v1/load_lora_adapter")
def adapter_rules(ctx: Any, case: Any) -> bool:
    """The coverage phase sends its bodies unmapped: of the valid ones, keep those that name
    the adapter (none do; the fuzzing phase's mapped ones load it)."""
    try:
        LoadLoRAAdapterRequest.model_validate(case.body)
    except pydantic.ValidationError:
        return True
    return case.body["lora_path"] == os.environ["QUIRE_CONTRACT_LORA_PATH"]


def _within_budget(body: dict[str, Any], num_prompts: int, max_tokens: Any) -> bool:
    n = body.get("n", 1)
    per_sample = max_tokens if _is_int(max_tokens) else _max_model_len()
    return not _is_int(n) or n * num_prompts * per_sample <= MAX_GENERATED_TOKENS


def _sampling_rules(body: dict[str, Any], max_tokens: Any) -> bool:
    """stream_options only with stream; min_tokens at most max_tokens; logit_bias keys in the
    vocabulary. (And the seed within
    int64, as the schema says: the coverage phase rounds 2**63 - 1 through a float and sends
    2**63 + 191 as a valid seed.)"""
    if body.get("stream_options") is not None and body.get("stream") is not True:
        return False
    seed = body.get("seed")
    if _is_int(seed) and not INT64_MIN <= seed <= INT64_MAX:
        return False
    min_tokens = body.get("min_tokens", 0)
    if _is_int(max_tokens) and _is_int(min_tokens) and min_tokens > max_tokens:
        return False
    # logit_bias' keys are token ids of the vocabulary (a schema's key pattern cannot say so).
    logit_bias = body.get("logit_bias")
    if isinstance(logit_bias, dict) and any(
        key.isdigit() and int(key) >= len(_tokenizer()) for key in logit_bias
    ):
        return False
    # A request's own `timeout` must leave time to serve it, or it is aborted by design (504,
    # the deadline the client asked for); how long serving takes no schema can say.
    timeout = body.get("timeout")
    return timeout is None or not isinstance(timeout, int | float) or timeout >= MIN_TIMEOUT_S


def _tool_rules(body: dict[str, Any]) -> bool:
    """tool_choice other than "none" needs tools; a named function must be one of them. The
    server runs with --enable-auto-tool-choice."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is None or choice == "none":
        return True
    if not tools:
        return False
    if isinstance(choice, dict) and isinstance(tools, list):
        name = (choice.get("function") or {}).get("name")
        return any(
            isinstance(t, dict) and (t.get("function") or {}).get("name") == name for t in tools
        )
    return True


def _structured_output_rules(model: type[pydantic.BaseModel], body: dict[str, Any]) -> bool:
    """One constraint at most (response_format, structured_outputs, a guided_* field, or a
    forced tool choice), with exactly one kind given, that xgrammar compiles for the model's
    tokenizer: the server answers 400 otherwise (a regex or schema's validity is xgrammar's)."""
    try:
        request = model.model_validate(body)
    except pydantic.ValidationError:
        return True  # schema-invalid: the server must answer 400 anyway
    try:
        params = request._sampling_params(None, None, None).structured_outputs
        if isinstance(request, ChatCompletionRequest):
            forced = request_tool_choice(
                request.tools, request.tool_choice, request.parallel_tool_calls, None
            ).structured_outputs
            if forced is not None:
                if params is not None:
                    return False
                params = forced
        if params is not None:
            _grammar_compiler().compile(params)
    except (GrammarError, ValueError):
        return False
    return True


def _fits_context(prompt_lengths: list[int] | None, max_tokens: Any) -> bool:
    """A prompt of at least one token (a text of control characters can tokenize to none),
    shorter than max_model_len, with room for max_tokens after it."""
    if prompt_lengths is None:  # schema-invalid prompt: the server must say 400 anyway
        return True
    budget = _max_model_len() - (max_tokens if _is_int(max_tokens) else 1)
    return all(1 <= length <= budget for length in prompt_lengths)


def _completion_prompt_lengths(prompt: Any) -> list[int] | None:
    if isinstance(prompt, str):
        return [len(_tokenizer().encode(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [len(_tokenizer().encode(p)) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [len(p) for p in prompt]
        return [len(prompt)]
    return None


def _chat_text(body: dict[str, Any]) -> str | None:
    try:
        return render_chat(
            _tokenizer(),
            body["messages"],
            body.get("tools"),
            body.get("add_generation_prompt", True),
            _chat_template(),
        )
    except (KeyError, TypeError, ValueError):  # schema-invalid messages: 400 anyway
        return None


def _chat_prompt_lengths(body: dict[str, Any]) -> list[int] | None:
    text = _chat_text(body)
    if text is None:
        return None
    return [len(_tokenizer().encode(text, add_special_tokens=False))]


@functools.cache
def _max_token_chars() -> int:
    return max(len(token) for token in _tokenizer().get_vocab())


def _is_int(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == int(value)

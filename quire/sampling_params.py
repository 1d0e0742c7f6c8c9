"""SamplingParams: per-request generation options, with vLLM's names and meanings."""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
_STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains a request's output to a language (vLLM's names); exactly one is given.

    `json`: a JSON schema (a dict or its text): the output is a JSON value valid under it.
    `regex`: the output fully matches the regular expression. `choice`: the output is one of the
    strings. `grammar`: an EBNF grammar in xgrammar's (GBNF) syntax, from the rule `root`.
    `json_object=True`: the output is a JSON object, any one.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must give exactly one of json, regex, choice, grammar or "
                f"json_object=True; got {', '.join(given) or 'none'}: keep one."
            )
        if isinstance(self.json, dict | str):
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as error:
                    raise ValueError(
                        f"structured_outputs.json is not valid JSON: {error}; give a JSON schema."
                    ) from None
                if not isinstance(parsed, dict | bool):
                    raise ValueError("structured_outputs.json must be a JSON schema (an object).")
        elif self.json is not None:
            raise ValueError("structured_outputs.json must be a JSON schema: a dict or its text.")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("structured_outputs.grammar must be a non-empty string.")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice must hold non-empty strings only.")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object not in (True, False):
            raise ValueError("structured_outputs.json_object must be a boolean.")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return next(k for k in _STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal for equal constraints; the grammar cache's key."""
        kind = self.kind
        if kind == "json":
            text = (
                self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            )
        elif kind == "choice":
            text = json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text


class RequestOutputKind(enum.Enum):
    """Which steps give a request's caller a RequestOutput (vLLM's names)."""

    CUMULATIVE = enum.auto()  # every step that made progress: the text and tokens so far
    FINAL_ONLY = enum.auto()  # only the last: its text is decoded once, when it finishes


@dataclass
class SamplingParams:
    """How to generate one request's completions.

    temperature 0 means greedy. top_k 0 or -1 means no top-k cut. Penalties follow vLLM: presence
    and frequency penalties apply to generated tokens, repetition_penalty to prompt and generated
    tokens (> 1 discourages repeats). `logprobs=k` returns the k most likely tokens' logprobs at
    each sampled position (plus the sampled token's); `prompt_logprobs=k` the same for the prompt.
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar.
    `logit_bias` maps token ids to a bias in [-100, 100] added to their logits before the
    penalties and sampling (OpenAI's meaning: -100 all but bans a token, 100 all but forces it);
    returned logprobs stay those of the raw logits. `output_kind` FINAL_ONLY gives one output,
    when the request finishes (LLM.generate's), instead of one a step.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    # Prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true, "transfer_id": ..}
    # on a prefill instance, {"do_remote_prefill": true, "transfer_id": .., "remote_host": ..,
    # "remote_port": ..} on a decode instance. Set by the router, not by users.
    kv_transfer_params: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine: the model's EOS ids (stops the request unless ignore_eos).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not self.logit_bias:
            self.logit_bias = None
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers.")
        if self.logit_bias is not None:
            _validate_logit_bias(self.logit_bias)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                "output_kind must be a RequestOutputKind (CUMULATIVE or FINAL_ONLY), got "
                f"{self.output_kind!r}."
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams(json=..., regex=..., "
                "choice=... or grammar=...)."
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the tokens seen so far (repetition, presence, frequency)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def argmax_only(self) -> bool:
        """Whether the token is the argmax of the raw logits (when no token is banned): greedy,
        unpenalized, unbiased, no logprobs. A grammar's mask, where it applies, comes first."""
        return (
            self.is_greedy
            and self.logprobs is None
            and not self.uses_penalties
            and self.logit_bias is None
        )

    def clone(self) -> SamplingParams:
        copy = SamplingParams.__new__(SamplingParams)
        copy.__dict__.update(self.__dict__)
        copy.stop = list(self.stop)
        copy.stop_token_ids = list(self.stop_token_ids)
        copy.all_stop_token_ids = set(self.all_stop_token_ids)
        return copy


def _validate_logit_bias(logit_bias: Any) -> None:
    if not isinstance(logit_bias, dict):
        raise ValueError(
            f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}."
        )
    for token_id, bias in logit_bias.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(
                f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}."
            )
        if (
            not isinstance(bias, numbers.Real)
            or isinstance(bias, bool)
            or not math.isfinite(bias)
            or abs(bias) > MAX_LOGIT_BIAS
        ):
            raise ValueError(
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token_id}."
            )

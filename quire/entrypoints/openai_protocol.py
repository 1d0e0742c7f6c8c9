"""The OpenAI API's shapes: request bodies as pydantic models that map to SamplingParams, and
builders for the response objects and stream chunks that the official `openai` client parses.

Requests name every field they accept (OpenAI's, plus vLLM's sampling extras that the client
sends through `extra_body`); an unknown field is an error, as on OpenAI's own API, so a typo never
passes silently. Responses are plain dicts: they are built once per chunk on the hot path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quire.outputs import Logprob, PositionLogprobs
from quire.sampling_params import SamplingParams

# OpenAI caps top_logprobs at 20; completions' `logprobs` follows (OpenAI's own cap there is 5).
MAX_LOGPROBS = 20

ChatMessageDict = dict[str, str]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields that completions and chat share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported; leave it out or pass {}")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true.")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # None: as many as fit in the context
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def to_sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported: leave it out or set it equal to n.")
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"content parts of type {value!r} are not supported; use 'text'")
        return value


class ChatMessage(BaseModel):
    # Extra keys (name, refusal, tool_calls: None ...) come back when a client sends a response
    # message back as history; they do not change the prompt.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def to_template_dict(self) -> ChatMessageDict:
        """The message as the chat template wants it: a role and one string."""
        if isinstance(self.content, list):
            content = "\n".join(part.text or "" for part in self.content)
        else:
            content = self.content or ""
        return {"role": self.role, "content": content}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's extra: end the prompt with the assistant's turn header.
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @property
    def max_output_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true.")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.max_output_tokens, logprobs, None)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------
def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def response_object(
    object_type: str, response_id: str, created: int, model: str, choices: list[dict]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": object_type,
        "created": created,
        "model": model,
        "choices": choices,
    }


def model_card(name: str, root: str, max_model_len: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "quire",
        "root": root,
        "max_model_len": max_model_len,
    }


def completion_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    num_top: int,
    text_offset: int,
    decode: Callable[[int], str],
) -> dict[str, list]:
    """Completions' logprobs: per token its text, logprob, the top `num_top` alternatives (plus
    the token itself) and the text offset where it starts. A position without logprobs (the
    first prompt token with echo) gets None; `decode` gives its text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position else None
        text = _token_text(token_id, chosen, decode)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if chosen is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(chosen.logprob)
        top = {
            _token_text(tid, lp, decode): lp.logprob
            for tid, lp in position.items()
            if lp.rank <= num_top or tid == token_id
        }
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], num_top: int
) -> dict[str, list]:
    """Chat's logprobs: per token its text, UTF-8 bytes, logprob and the `num_top` most likely
    tokens at that position, most likely first."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        top = sorted((lp for lp in position.values() if lp.rank <= num_top), key=_by_rank)
        content.append(
            {**_chat_token(chosen), "top_logprobs": [_chat_token(lp) for lp in top[:num_top]]}
        )
    return {"content": content}


def _chat_token(logprob: Logprob) -> dict[str, Any]:
    text = logprob.decoded_token or ""
    return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode("utf-8"))}


def _by_rank(logprob: Logprob) -> int:
    return logprob.rank


def _token_text(token_id: int, logprob: Logprob | None, decode: Callable[[int], str]) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode(token_id)

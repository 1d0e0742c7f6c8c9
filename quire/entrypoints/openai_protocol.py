"""The OpenAI API's shapes: request bodies as pydantic models that map to SamplingParams, and
builders for the response objects and stream chunks that the official `openai` client parses.

Requests name every field they accept (OpenAI's, plus vLLM's sampling extras that the client
sends through `extra_body`); an unknown field is an error, as on OpenAI's own API, so a typo never
passes silently. Responses are plain dicts: they are built once per chunk on the hot path.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from quire.entrypoints.tool_parsers import (
    ToolCallStream,
    ToolParser,
    assistant_message,
    tool_call_json,
)
from quire.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from quire.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutputsParams

# OpenAI caps top_logprobs at 20; completions' `logprobs` follows (OpenAI's own cap there is 5).
MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's cap on choices per request
MIN_LOGPROB = -9999.0  # what vLLM's server sends for a logprob of -inf
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed's range (OpenAI's and torch's)

# The published schema states every rule that validation enforces (the contract that
# tests/schemathesis checks). Where a rule keeps its own friendlier error message, the schema
# gets it through json_schema_extra instead of a pydantic constraint.


def _whole_number(value: Any) -> Any:
    """JSON's integers include 2.0 (JSON Schema counts it as one); strict mode would not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(**bounds: int) -> Any:
    """An integer within `bounds` (ge=, le=) that also takes 2.0; the bounds come first so the
    schema states them as minimum / maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


NonEmptyStr = Annotated[str, Field(min_length=1)]
NonEmptyStrs = Annotated[list[NonEmptyStr], Field(min_length=1)]
TokenId = _int(ge=0)
PositiveInt = _int(ge=1)
NumLogprobs = _int(ge=0, le=MAX_LOGPROBS)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,8})$")]  # a token id, in decimal
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
# Keys that are not token ids are errors: the schema says so beside its patternProperties.
LogitBiases = Annotated[
    dict[TokenIdKey, LogitBias], Field(json_schema_extra={"additionalProperties": False})
]


class _Strict(BaseModel):
    # strict: JSON types as the schema states them (no "1" or true for an integer).
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    """A message or part of one: fields beyond the known ones are accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class FieldError(ValueError):
    """A ValueError about one request field (`param`), answered as a 400 naming it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(
        alias="schema", description="A JSON schema; the output is generated to validate under it."
    )
    strict: bool | None = Field(None, description="Ignored: the schema is always enforced.")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description='Needed by type "json_schema".')


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON schema (or its text) the output validates under."
    )
    regex: str | None = Field(None, description="A regular expression the output fully matches.")
    choice: NonEmptyStrs | None = Field(None, description="The output is one of these strings.")
    grammar: str | None = Field(
        None, description="An EBNF grammar (xgrammar's GBNF syntax, start rule `root`)."
    )
    json_object: bool | None = Field(None, description="true: the output is a JSON object.")


_DEPRECATED = {"deprecated": True}
# vLLM's older spellings of structured_outputs' fields.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class _SamplingRequest(_Strict):
    """Fields that completions and chat share."""

    model: str | None = None
    n: _int(ge=1, le=MAX_N) = 1
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: _int(ge=INT64_MIN, le=INT64_MAX) | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # OpenAI's: token ids (as JSON object keys) -> a bias in [-100, 100] added to the logit.
    logit_bias: LogitBiases | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None  # only with stream: true
    # Prefill/decode disaggregation (vLLM's field), set by `quire router` (SamplingParams).
    kv_transfer_params: dict[str, Any] | None = None
    # quire's: seconds from arrival after which the request is aborted (504, or an error event).
    timeout: float | None = Field(default=None, gt=0)
    # vLLM's extras.
    top_k: _int(ge=-1) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: TokenId = 0  # at most max_tokens
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or (deprecated)
    # vLLM's guided_* fields; one of them at most.
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: json_object or json_schema constrain the output."
    )
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM's: constrain the output to a JSON schema, regex, choice or grammar."
    )
    guided_json: dict[str, Any] | str | None = Field(
        None, description="Deprecated: structured_outputs.json.", json_schema_extra=_DEPRECATED
    )
    guided_regex: str | None = Field(
        None, description="Deprecated: structured_outputs.regex.", json_schema_extra=_DEPRECATED
    )
    guided_choice: NonEmptyStrs | None = Field(
        None, description="Deprecated: structured_outputs.choice.", json_schema_extra=_DEPRECATED
    )
    guided_grammar: str | None = Field(
        None, description="Deprecated: structured_outputs.grammar.", json_schema_extra=_DEPRECATED
    )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def structured_outputs_field(self) -> str | None:
        """The field that constrains the output, if any (FieldError when several do)."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if self.structured_outputs is not None:
            given.append("structured_outputs")
        given += [name for name in _GUIDED_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise FieldError(
                given[1], f"{given[1]} cannot be combined with {given[0]}: give one constraint."
            )
        return given[0] if given else None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        field = self.structured_outputs_field
        if field is None:
            return None
        if field == "response_format":
            fmt = self.response_format
            if fmt.type == "json_object":
                kwargs: dict[str, Any] = {"json_object": True}
            elif fmt.json_schema is None:
                raise FieldError(field, 'response_format of type "json_schema" needs json_schema.')
            else:
                kwargs = {"json": fmt.json_schema.json_schema}
        elif field == "structured_outputs":
            kwargs = self.structured_outputs.model_dump(exclude_none=True)
            if "json_" in kwargs:
                kwargs["json"] = kwargs.pop("json_")
        else:
            kwargs = {_GUIDED_FIELDS[field]: getattr(self, field)}
        try:
            return StructuredOutputsParams(**kwargs)
        except ValueError as error:
            raise FieldError(field, f"{field}: {error}") from None

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true.")
        structured_outputs = self._structured_outputs()
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
            structured_outputs=structured_outputs,
            logit_bias=(
                None
                if self.logit_bias is None
                else {int(token_id): bias for token_id, bias in self.logit_bias.items()}
            ),
            kv_transfer_params=self.kv_transfer_params,
        )


class CompletionRequest(_SamplingRequest):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: PositiveInt | None = 16  # None: as many as fit in the context
    echo: bool = False
    logprobs: NumLogprobs | None = None
    best_of: PositiveInt | None = None  # equal to n: one sample per choice
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})

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


class ContentPart(_Open):
    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"content parts of type {value!r} are not supported; use 'text'")
        return value


class FunctionCallMessage(_Open):
    name: str
    arguments: str = "{}"  # a JSON object


class ToolCallMessage(_Open):
    """A tool call of an earlier assistant message, sent back as history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallMessage


class ChatMessage(_Open):
    """A system, developer, user or assistant message."""

    # Extra keys (refusal, audio: None ...) come back when a client sends a response message
    # back as history; they do not change the prompt.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's

    def to_template_dict(self) -> dict[str, Any]:
        """The message as `render_chat` takes it (it joins text parts itself)."""
        return self.model_dump(exclude_none=True)


class ToolMessage(ChatMessage):
    """A tool's answer to an assistant's call: as on OpenAI, it names the call it answers and
    has content."""

    role: Literal["tool"]
    content: str | list[ContentPart]
    tool_call_id: str


def _message_kind(message: Any) -> str:
    if isinstance(message, dict) and message.get("role") == "tool":
        return "ToolMessage"
    return "ChatMessage"


# A message whose role is "tool" is a ToolMessage: errors then name its fields.
Message = Annotated[
    Annotated[ChatMessage, Tag("ChatMessage")] | Annotated[ToolMessage, Tag("ToolMessage")],
    Discriminator(_message_kind),
]


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatCompletionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[Message] = Field(json_schema_extra={"minItems": 1})
    # deprecated by OpenAI for max_completion_tokens; both work
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's extra: end the prompt with the assistant's turn header.
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[Message]) -> list[Message]:
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


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[ChatCompletionTool] | None = None
    add_generation_prompt: bool = True


def _tokenize_kind(body: Any) -> str:
    if isinstance(body, dict) and "messages" in body:
        return "TokenizeChatRequest"
    return "TokenizeCompletionRequest"


# A body with messages is a chat one, else a prompt one: errors then name the fields of the
# one the client meant.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's body: the adapter's name (what requests give as `model`) and its path on the
    server (a PEFT folder or a GGUF LoRA file)."""

    lora_name: NonEmptyStr
    lora_path: NonEmptyStr


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: NonEmptyStr


# ---- responses --------------------------------------------------------------------------------
@dataclass
class Prompt:
    """A prompt as the request gave it: its text (None for token ids until decoded) and ids."""

    text: str | None
    token_ids: list[int]

    @property
    def engine_input(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


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


def model_card(
    name: str, root: str, max_model_len: int, parent: str | None = None
) -> dict[str, Any]:
    """/v1/models' entry, as vLLM's: `root` the model's (or adapter's) path, `parent` the base
    model's name for an adapter."""
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "quire",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
    }


def json_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (a token a grammar forbade, emitted only as the
    stop of an output nothing could continue) becomes vLLM's -9999.0."""
    return max(logprob, MIN_LOGPROB)


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
        token_logprobs.append(json_logprob(chosen.logprob))
        top = {
            _token_text(tid, lp, decode): json_logprob(lp.logprob)
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
    return {
        "token": text,
        "logprob": json_logprob(logprob.logprob),
        "bytes": list(text.encode("utf-8")),
    }


def _by_rank(logprob: Logprob) -> int:
    return logprob.rank


def _token_text(token_id: int, logprob: Logprob | None, decode: Callable[[int], str]) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode(token_id)


# ---- responses of one request -----------------------------------------------------------------
@dataclass
class _ChoiceState:
    """What a stream has sent of one choice."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # where the next token's logprobs entry starts in the streamed text
    started: bool = False
    finished: bool = False


class CompletionFormatter:
    """Engine outputs as one /v1/completions response or its stream chunks. Prompt p's sample j
    is choice p * n + j."""

    def __init__(
        self,
        body: CompletionRequest,
        prompts: list[Prompt],
        response_id: str,
        model_name: str,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.body = body
        self.n = body.n
        self.prompts = prompts
        self.response_id = response_id
        self.model_name = model_name
        self.decode = decode
        self.created = int(time.time())

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for p, output in enumerate(finals):
            for completion in output.outputs:
                choice = self._choice(p, output, completion, _ChoiceState())
                choice["finish_reason"] = completion.finish_reason
                choice["stop_reason"] = completion.stop_reason
                choices.append(choice)
        body = self._object(choices)
        body["usage"] = self._usage(finals)
        return body

    async def chunks(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncGenerator[dict[str, Any], None]:
        states = [_ChoiceState() for _ in range(len(self.prompts) * self.n)]
        finals: list[RequestOutput | None] = [None] * len(self.prompts)
        async for p, output in outputs:
            finals[p] = output
            for completion in output.outputs:
                state = states[p * self.n + completion.index]
                if state.finished:
                    continue
                state.finished = completion.finish_reason is not None
                new_text = len(completion.text) > state.num_chars
                new_tokens = len(completion.token_ids) > state.num_tokens
                if not (
                    new_text
                    or state.finished
                    or (self.body.echo and not state.started)
                    or (new_tokens and self.body.logprobs is not None)
                ):
                    continue
                choice = self._choice(p, output, completion, state)
                choice["finish_reason"] = completion.finish_reason
                choice["stop_reason"] = completion.stop_reason
                yield self._object([choice], self.body.include_usage)
        if self.body.include_usage:
            chunk = self._object([])
            chunk["usage"] = self._usage([f for f in finals if f is not None])
            yield chunk

    def _choice(
        self, p: int, output: RequestOutput, completion: CompletionOutput, state: _ChoiceState
    ) -> dict[str, Any]:
        """The choice's text and logprobs after what `state` says was sent; advances `state`.
        With echo, the first piece starts with the prompt (and its logprobs)."""
        echo = self.body.echo and not state.started
        state.started = True
        text = completion.text[state.num_chars :]
        token_ids = completion.token_ids[state.num_tokens :]
        logprobs = None
        if self.body.logprobs is not None:
            positions = list(completion.logprobs[state.num_tokens : len(completion.token_ids)])
            if echo:
                token_ids = output.prompt_token_ids + token_ids
                positions = list(output.prompt_logprobs or []) + positions
            logprobs = completion_logprobs(
                token_ids, positions, self.body.logprobs, state.text_offset, self._decode_token
            )
            if logprobs["tokens"]:
                state.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        state.num_chars = len(completion.text)
        state.num_tokens = len(completion.token_ids)
        if echo:
            text = self._prompt_text(p) + text
        return {"index": p * self.n + completion.index, "text": text, "logprobs": logprobs}

    def _prompt_text(self, index: int) -> str:
        prompt = self.prompts[index]
        if prompt.text is None:
            prompt.text = self.decode(prompt.token_ids)
        return prompt.text

    def _decode_token(self, token_id: int) -> str:
        return self.decode([token_id])

    def _usage(self, finals: list[RequestOutput]) -> dict[str, int]:
        num_completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs)
        num_prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        return usage(num_prompt_tokens, num_completion_tokens)

    def _object(self, choices: list[dict], null_usage: bool = False) -> dict[str, Any]:
        body = response_object(
            "text_completion", self.response_id, self.created, self.model_name, choices
        )
        if null_usage:
            body["usage"] = None
        return body


class ChatCompletionFormatter:
    """Engine outputs as one /v1/chat/completions response or its stream chunks. With a tool
    parser, each choice's text is split into content and `tool_calls` (at most one call when
    `parallel_tool_calls` is false), and a choice that stopped after calling ends with
    finish_reason "tool_calls"."""

    def __init__(
        self,
        body: ChatCompletionRequest,
        prompt: Prompt,
        response_id: str,
        model_name: str,
        tool_parser: ToolParser | None = None,
    ) -> None:
        self.body = body
        self.n = body.n
        self.prompt = prompt
        self.response_id = response_id
        self.model_name = model_name
        self.tool_parser = tool_parser
        self.max_calls = None if body.parallel_tool_calls else 1
        self.created = int(time.time())

    def response(self, final: RequestOutput) -> dict[str, Any]:
        choices = []
        for completion in final.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": completion.text}
            finish_reason = completion.finish_reason
            if self.tool_parser is not None:
                content, calls = assistant_message(
                    self.tool_parser, completion.text, self.max_calls
                )
                message["content"] = content
                if calls:
                    message["tool_calls"] = [tool_call_json(call) for call in calls]
                    finish_reason = _tool_calls_finish_reason(finish_reason, self.tool_parser)
            choices.append(
                {
                    "index": completion.index,
                    "message": message,
                    "logprobs": self._logprobs(completion, 0),
                    "finish_reason": finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
        body = self._object("chat.completion", choices)
        body["usage"] = self._usage(final)
        return body

    async def chunks(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The role first, then content and tool-call deltas; each choice's last chunk has its
        finish_reason."""
        include_usage = self.body.include_usage
        for index in range(self.n):
            delta = {"role": "assistant", "content": ""}
            yield self._chunk(index, delta, None, None, include_usage)
        states = [_ChoiceState() for _ in range(self.n)]
        tool_streams = (
            [ToolCallStream(self.tool_parser, self.max_calls) for _ in range(self.n)]
            if self.tool_parser is not None
            else None
        )
        final = None
        async for _, output in outputs:
            final = output
            for completion in output.outputs:
                state = states[completion.index]
                if state.finished:
                    continue
                state.finished = completion.finish_reason is not None
                logprobs = self._logprobs(completion, state.num_tokens)
                has_new_tokens = len(completion.token_ids) > state.num_tokens
                state.num_tokens = len(completion.token_ids)
                finish_reason = completion.finish_reason
                delta: dict[str, Any] = {}
                if tool_streams is None:
                    text = completion.text[state.num_chars :]
                    state.num_chars = len(completion.text)
                else:
                    stream = tool_streams[completion.index]
                    num_calls_sent = stream.num_calls
                    text, calls = stream.update(completion.text, state.finished)
                    if calls:
                        delta["tool_calls"] = [
                            {"index": num_calls_sent + i, **tool_call_json(call)}
                            for i, call in enumerate(calls)
                        ]
                    if stream.num_calls:
                        finish_reason = _tool_calls_finish_reason(finish_reason, self.tool_parser)
                if text:
                    delta = {"content": text, **delta}
                if not (delta or state.finished or (logprobs and has_new_tokens)):
                    continue
                yield self._chunk(
                    completion.index,
                    delta,
                    logprobs,
                    finish_reason,
                    include_usage,
                    completion.stop_reason,
                )
        if include_usage and final is not None:
            chunk = self._object("chat.completion.chunk", [])
            chunk["usage"] = self._usage(final)
            yield chunk

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict | None,
        finish_reason: str | None,
        null_usage: bool,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        chunk = self._object("chat.completion.chunk", [choice])
        if null_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, completion: CompletionOutput, start: int) -> dict[str, list] | None:
        if not self.body.logprobs:
            return None
        end = len(completion.token_ids)
        return chat_logprobs(
            completion.token_ids[start:end],
            completion.logprobs[start:end],
            self.body.top_logprobs or 0,
        )

    def _usage(self, final: RequestOutput) -> dict[str, int]:
        num_completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return usage(len(self.prompt.token_ids), num_completion_tokens)

    def _object(self, object_type: str, choices: list[dict]) -> dict[str, Any]:
        return response_object(
            object_type, self.response_id, self.created, self.model_name, choices
        )


def _tool_calls_finish_reason(finish_reason: str | None, parser: ToolParser) -> str | None:
    """A choice that called tools and then stopped on its own ends with the parser's
    `calls_finish_reason` ("tool_calls"; "stop" for a function named by tool_choice); one cut
    short (length) keeps its reason."""
    return parser.calls_finish_reason if finish_reason == "stop" else finish_reason

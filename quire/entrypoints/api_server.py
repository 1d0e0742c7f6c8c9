"""The OpenAI-compatible HTTP server: `build_app(engine)` makes the FastAPI app, `serve` runs it.

Routes: POST /v1/completions, POST /v1/chat/completions (both streamed as server-sent events with
`stream: true`), GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize, GET
/version, GET /ready, and with --allow-runtime-lora-updating POST /v1/load_lora_adapter and POST
/v1/unload_lora_adapter (vLLM's). A request's `model` chooses the LoRA adapter it runs (the base
model's served name, or none: no adapter). Errors use OpenAI's body `{"error": {"message", "type",
"param", "code"}}`: 400 for bad input (pydantic's checks, then SamplingParams' and the engine's
ValueErrors), 401 for a missing or wrong API key, 404 for an unknown model or adapter, 413 for a
body over `max_request_bytes`, 503 with Retry-After when `max_num_seqs + max_queued_requests`
requests are already in (quire.entrypoints.admission), 504 for a request past its deadline (its
`timeout` field or the server's `request_timeout`, from arrival; a stream gets an error event
instead). A client that disconnects, mid-stream or while waiting for a whole response, has its
requests aborted at once; so has a request past its deadline.

Tokenizing, rendering chat templates and detokenizing prompts run on a TokenizerPool, never on
the event loop, and a text prompt longer than the pool's character bound is rejected untokenized:
/health (200 while the engine loop is alive) answers within milliseconds under any load. /ready
is 200 only while the server also admits more requests: a load balancer routes by /ready and
restarts by /health. Chat prompts render through
`chat_template.render_chat`; `tool_choice.py` picks the tool parser that reads a chat output;
`openapi.py` corrects the published document.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import re
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from quire import __version__
from quire.config import DEFAULT_GGUF_NAME, EngineConfig
from quire.engine.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from quire.engine.metrics import EngineMetrics
from quire.entrypoints import openai_protocol as protocol
from quire.entrypoints.admission import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    Admission,
    AdmissionGate,
    BodySizeLimit,
)
from quire.entrypoints.chat_template import check_chat_template, render_chat
from quire.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    Prompt,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from quire.entrypoints.openapi import install_openapi
from quire.entrypoints.tokenizer_pool import TokenizerPool
from quire.entrypoints.tool_choice import request_tool_choice
from quire.entrypoints.tool_parsers import TOOL_PARSERS, ToolParser
from quire.lora.adapter import LoRAAdapterError
from quire.lora_request import LoRARequest
from quire.outputs import RequestOutput
from quire.sampling_params import SamplingParams
from quire.structured_output.compiler import GrammarError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = DEFAULT_GGUF_NAME.split(".")[0]  # SmolLM2-135M-Instruct
_PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})
# The routes that hold a slot of the admission gate while they run.
_WORK_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
_CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})  # pydantic union tags
_T = TypeVar("_T")


class APIError(Exception):
    """An error answered in OpenAI's format."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def body(self) -> dict[str, Any]:
        error_type = "invalid_request_error" if self.status < 500 else "server_error"
        return protocol.error_body(self.message, error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


def bad_request(
    error: ValueError, param: str | None = None, fields: Iterable[str] = ()
) -> APIError:
    """A 400 for a ValueError from the request's own checks, SamplingParams or the engine. Their
    messages start with the name of the field at fault, which becomes `param` when it is a
    sampling field or one of `fields` (the request's)."""
    message = str(error)
    if isinstance(error, protocol.FieldError):
        return APIError(400, message, error.param)
    first_word = message.split(" ", 1)[0]
    known = first_word in _SAMPLING_FIELDS or first_word in fields
    return APIError(400, message, first_word if known else param)


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: AsyncLLM,
        model_name: str,
        tokenizers: TokenizerPool,
        request_timeout: float | None = None,
        chat_template: str | None = None,
        auto_tool_parser: type[ToolParser] | None = None,
        grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.grammar_compile_timeout = grammar_compile_timeout
        self.stopped = asyncio.Event()  # set by a stopping server (quire.entrypoints.shutdown)
        self.tokenizer = engine.tokenizer
        self.tokenizers = tokenizers
        self.model_name = model_name
        self.request_timeout = request_timeout
        self.chat_template = chat_template
        self.auto_tool_parser = auto_tool_parser
        # Ids of adapters loaded at run time, after those loaded at start (event loop only).
        first_id = max((r.lora_int_id for r in engine.list_loras()), default=0) + 1
        self._lora_ids = itertools.count(first_id)

    # ---- validation ------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str | None:
        """The adapter a request's `model` names: None for the base model (its served name, or
        no name); 404 `model_not_found` for a name neither the base model nor an adapter has."""
        if model is None or model == self.model_name:
            return None
        if any(r.lora_name == model for r in self.engine.list_loras()):
            return model
        raise self.model_not_found(model)

    def model_not_found(self, model: str) -> APIError:
        adapters = [r.lora_name for r in self.engine.list_loras()]
        served = ", ".join(f"`{name}`" for name in [self.model_name, *adapters])
        return APIError(
            404,
            f"The model `{model}` does not exist. This server serves {served}.",
            "model",
            "model_not_found",
        )

    async def completion_prompts(self, prompt: str | list) -> list[Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        prompts = []
        for item in prompt:
            if isinstance(item, str):
                self.check_prompt_chars(item, "prompt")
                token_ids = await self.tokenizers.run(len(item), self.tokenizer.encode, item)
                prompts.append(Prompt(item, token_ids))
            else:
                self.check_token_ids(item, "prompt")
                prompts.append(Prompt(None, list(item)))
        return prompts

    async def chat_prompt(
        self,
        messages: list[protocol.ChatMessage],
        add_generation_prompt: bool,
        tools: list[protocol.ChatCompletionTool] | None = None,
    ) -> Prompt:
        template_messages = [m.to_template_dict() for m in messages]
        size = sum(len(str(m.get("content") or "")) for m in template_messages)
        try:
            text = await self.tokenizers.run(
                size,
                render_chat,
                self.tokenizer,
                template_messages,
                [t.model_dump(exclude_none=True) for t in tools] if tools else None,
                add_generation_prompt,
                self.chat_template,
            )
        except ValueError as error:
            raise APIError(400, str(error), "messages") from error
        self.check_prompt_chars(text, "messages")
        token_ids = await self.tokenizers.run(
            len(text), self.tokenizer.encode, text, add_special_tokens=False
        )
        return Prompt(text, token_ids)

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Rejects, untokenized, a text too long to fit whatever its tokens (TokenizerPool)."""
        if len(text) > self.tokenizers.max_prompt_chars:
            max_model_len = self.engine.max_model_len
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens, and the "
                f"{param} has {len(text)} characters, more than {max_model_len} tokens can hold "
                f"(at most {self.tokenizers.max_token_chars} characters each): shorten the "
                f"{param}.",
                param,
                "context_length_exceeded",
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.engine.engine.model_config.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
            raise APIError(400, f"Token ids must be in [0, {vocab_size}).", param)

    def check_context(self, prompts: list[Prompt], max_tokens: int | None, param: str) -> None:
        """Prompt plus max_tokens must fit the context (the engine would cut max_tokens short)."""
        max_model_len = self.engine.max_model_len
        for prompt in prompts:
            num_prompt = len(prompt.token_ids)
            if num_prompt >= max_model_len:
                raise APIError(
                    400,
                    f"This model's maximum context length is {max_model_len} tokens, and the "
                    f"prompt has {num_prompt}: shorten the {param}.",
                    param,
                    "context_length_exceeded",
                )
            if max_tokens is not None and num_prompt + max_tokens > max_model_len:
                raise APIError(
                    400,
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                    f"{param}, {max_tokens} in the completion). Reduce the {param} or max_tokens.",
                    "max_tokens",
                    "context_length_exceeded",
                )

    async def check_structured_outputs(self, params: SamplingParams, param: str | None) -> None:
        """Compiles the request's grammar on the compiler's threads (cached: the engine then
        finds it compiled); a schema, regex or grammar xgrammar rejects, or one with no finite
        output, is a 400 naming `param`; so is one not compiled within grammar_compile_timeout
        (a compile already running goes on, and a retry finds it cached). Once the server has
        stopped (`stopped` set), a request still waiting for its compile gets 503."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        compiling = asyncio.wrap_future(self.engine.engine.grammar_compiler.submit(constraint))
        stopped = asyncio.ensure_future(self.stopped.wait())
        try:
            await asyncio.wait(
                {compiling, stopped},
                timeout=self.grammar_compile_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stopped.cancel()
        if not compiling.done():
            compiling.cancel()
            if stopped.done():
                raise APIError(503, "The server is shutting down: retry the request elsewhere.")
            raise APIError(
                400,
                f"{param} was not compiled within this server's limit of "
                f"{self.grammar_compile_timeout:g} s (--grammar-compile-timeout): simplify it "
                "(fewer enum members or alternatives, less nesting).",
                param,
                "grammar_compile_timeout",
            )
        try:
            compiling.result()
        except GrammarError as error:
            raise APIError(400, f"{param} is invalid: {error.detail}", param) from error

    # ---- engine requests -------------------------------------------------------------------
    async def add_requests(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        arrival_time: float,
        param: str,
        timeout: float | None,
        lora: str | None,
    ) -> _EngineRequests:
        """One engine request per prompt, running adapter `lora` (a name; None: the base
        model); all or none are added. The first of the request's `timeout` and the server's
        `request_timeout` after arrival aborts what is unfinished."""
        if len(prompts) == 1:
            ids = [request_id]
        else:
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = []
        try:
            for rid, prompt in zip(ids, prompts):
                stream = await self.engine.add_request(
                    rid, prompt.engine_input, params, arrival_time, lora
                )
                streams.append(stream)
        except BaseException as error:
            self.engine.abort(ids[: len(streams)])
            if isinstance(error, ValueError):
                raise bad_request(error, param) from error
            if isinstance(error, KeyError):  # the adapter was unloaded meanwhile
                raise self.model_not_found(lora) from None
            raise
        return _EngineRequests(self.engine, ids, streams, self.deadline(arrival_time, timeout))

    def deadline(self, arrival_time: float, timeout: float | None) -> _Deadline | None:
        """The sooner of the request's `timeout` and the server's request_timeout, if any."""
        if self.request_timeout is not None and (timeout is None or self.request_timeout < timeout):
            return _Deadline(arrival_time, self.request_timeout, by_server=True)
        if timeout is not None:
            return _Deadline(arrival_time, timeout, by_server=False)
        return None

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        """SamplingParams of the request (a 400 naming the field if invalid)."""
        try:
            return body.to_sampling_params()
        except ValueError as error:
            raise bad_request(error, fields=type(body).model_fields) from error

    async def respond(
        self,
        stream: bool,
        requests: _EngineRequests,
        raw: Request,
        chunks: Callable[[AsyncIterator[tuple[int, RequestOutput]]], AsyncIterator[dict[str, Any]]],
        response: Callable[[list[RequestOutput]], dict[str, Any]],
    ) -> Response:
        """SSE of `chunks(outputs)` when streaming, else the JSON `response(final outputs)`.
        A client that leaves aborts whatever is unfinished."""
        if stream:
            events = _sse_events(chunks(requests.outputs()))
            return EventStreamResponse(events, on_close=requests.abort_unfinished)
        try:
            finals = await _unless_disconnected(raw, requests.final_outputs())
        finally:
            requests.abort_unfinished()
        return JSONResponse(response(finals))

    # ---- /v1/completions -------------------------------------------------------------------
    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        arrival_time = time.monotonic()
        lora = self.check_model(body.model)
        params = self.sampling_params(body)
        await self.check_structured_outputs(params, body.structured_outputs_field)
        prompts = await self.completion_prompts(body.prompt)
        self.check_context(prompts, body.max_tokens, "prompt")
        if body.echo:  # the echoed text of token-id prompts
            for prompt in prompts:
                if prompt.text is None:
                    prompt.text = await self.tokenizers.run(
                        len(prompt.token_ids), self.tokenizer.decode, prompt.token_ids
                    )
        response_id = f"cmpl-{uuid.uuid4().hex}"
        requests = await self.add_requests(
            response_id, prompts, params, arrival_time, "prompt", body.timeout, lora
        )
        formatter = protocol.CompletionFormatter(
            body, prompts, response_id, lora or self.model_name, self.tokenizer.decode
        )
        return await self.respond(body.stream, requests, raw, formatter.chunks, formatter.response)

    # ---- /v1/chat/completions --------------------------------------------------------------
    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival_time = time.monotonic()
        lora = self.check_model(body.model)
        params = self.sampling_params(body)
        try:
            tool_choice = request_tool_choice(
                body.tools, body.tool_choice, body.parallel_tool_calls, self.auto_tool_parser
            )
        except ValueError as error:
            raise APIError(400, str(error), "tool_choice") from error
        tool_parser = tool_choice.parser
        if tool_choice.structured_outputs is not None:
            field = body.structured_outputs_field
            if field is not None:
                raise APIError(
                    400,
                    f"{field} cannot be combined with tool_choice {body.tool_choice!r}, which "
                    "constrains the output itself: leave one out.",
                    field,
                )
            params.structured_outputs = tool_choice.structured_outputs
            await self.check_structured_outputs(params, "tools")
        else:
            await self.check_structured_outputs(params, body.structured_outputs_field)
        prompt = await self.chat_prompt(body.messages, body.add_generation_prompt, body.tools)
        self.check_context([prompt], body.max_output_tokens, "messages")
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        requests = await self.add_requests(
            response_id, [prompt], params, arrival_time, "messages", body.timeout, lora
        )
        formatter = protocol.ChatCompletionFormatter(
            body, prompt, response_id, lora or self.model_name, tool_parser
        )
        return await self.respond(
            body.stream,
            requests,
            raw,
            formatter.chunks,
            lambda finals: formatter.response(finals[0]),
        )

    # ---- /v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter ------------------------
    def models(self) -> dict[str, Any]:
        """The base model, then each adapter with `parent` the base model and `root` its path."""
        max_model_len = self.engine.max_model_len
        cards = [
            protocol.model_card(self.model_name, self.engine.engine.config.model, max_model_len)
        ]
        for lora in self.engine.list_loras():
            cards.append(
                protocol.model_card(lora.lora_name, lora.lora_path, max_model_len, self.model_name)
            )
        return {"object": "list", "data": cards}

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        """Loads an adapter that requests then name as `model`: 400 naming lora_name if the
        name is taken, lora_path if the adapter does not fit the base model. It is read and
        checked on the engine thread, between steps."""
        name = body.lora_name
        if name == self.model_name:
            raise APIError(
                400,
                f"lora_name `{name}` is the base model's name: give the adapter another.",
                "lora_name",
            )
        try:
            await self.engine.add_lora(LoRARequest(name, next(self._lora_ids), body.lora_path))
        except LoRAAdapterError as error:
            raise APIError(400, str(error), "lora_path") from error
        except ValueError as error:  # the name is taken
            raise APIError(400, str(error), "lora_name") from error
        logger.info("Loaded LoRA adapter %s from %s", name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        """Unloads an adapter: new requests cannot name it, running ones finish with it; 404
        for a name not loaded."""
        name = body.lora_name
        try:
            await self.engine.remove_lora(name)
        except KeyError:
            loaded = ", ".join(f"`{r.lora_name}`" for r in self.engine.list_loras()) or "none"
            raise APIError(
                404,
                f"No LoRA adapter named `{name}` is loaded (loaded: {loaded}).",
                "lora_name",
                "model_not_found",
            ) from None
        logger.info("Unloaded LoRA adapter %s", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    # ---- /tokenize, /detokenize ------------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if isinstance(body, protocol.TokenizeChatRequest):
            prompt = await self.chat_prompt(body.messages, body.add_generation_prompt, body.tools)
            token_ids = prompt.token_ids
        else:
            token_ids = await self.tokenizers.run(
                len(body.prompt),
                self.tokenizer.encode,
                body.prompt,
                add_special_tokens=body.add_special_tokens,
            )
        return {
            "count": len(token_ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": token_ids,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        self.check_token_ids(body.tokens, "tokens")
        text = await self.tokenizers.run(len(body.tokens), self.tokenizer.decode, body.tokens)
        return {"prompt": text}


# ---- streams and disconnects ------------------------------------------------------------------
async def merge_streams(
    streams: list[AsyncGenerator[_T, None]],
) -> AsyncGenerator[tuple[int, _T], None]:
    """Items of several async generators as they come, tagged with the generator's index.
    Leaving early (or an error in one) closes them all."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncGenerator[_T, None]) -> None:
        try:
            async for item in stream:
                merged.put_nowait((index, item))
        except Exception as error:
            merged.put_nowait((index, error))
        finally:
            merged.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


class _Deadline:
    """A request's time limit: `timeout` seconds after `arrival_time` (time.monotonic), set by
    the request's own `timeout` field or, when `by_server`, by the server's request_timeout."""

    def __init__(self, arrival_time: float, timeout: float, by_server: bool) -> None:
        self.arrival_time = arrival_time
        self.timeout = timeout
        self.by_server = by_server

    def error(self) -> APIError:
        if self.by_server:
            limit = f"this server's request timeout of {self.timeout:g} s"
            advice = "lower max_tokens"
        else:
            limit = f"its timeout of {self.timeout:g} s"
            advice = "raise `timeout` or lower max_tokens"
        return APIError(
            504,
            f"The request did not finish within {limit} and was aborted: {advice}.",
            None if self.by_server else "timeout",
            "request_timeout",
        )


class _EngineRequests:
    """The engine requests behind one HTTP request, one per prompt. The server calls
    `abort_unfinished` whenever a response ends, so none outlives its client, even one whose
    stream was never read; a deadline aborts them too, and their outputs then end in its error."""

    def __init__(
        self,
        engine: AsyncLLM,
        ids: list[str],
        streams: list[AsyncGenerator[RequestOutput, None]],
        deadline: _Deadline | None = None,
    ) -> None:
        self.engine = engine
        self.ids = ids
        self.streams = streams
        self.unfinished = set(ids)
        self.deadline = deadline
        self.timed_out = False
        self._timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            delay = deadline.arrival_time + deadline.timeout - time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(max(delay, 0.0), self._expire)

    def _expire(self) -> None:
        if self.unfinished:
            self.timed_out = True
            self.abort_unfinished()

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, output) as they come; raises the deadline's APIError once it aborted
        the requests."""
        merged = merge_streams(self.streams)
        try:
            async for index, output in merged:
                if output.finished:
                    self.unfinished.discard(self.ids[index])
                yield index, output
        finally:
            self.abort_unfinished()
            await merged.aclose()
        if self.timed_out:
            raise self.deadline.error()

    async def final_outputs(self) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(self.ids)
        async for index, output in self.outputs():
            finals[index] = output
        if any(f is None or not f.finished for f in finals):
            raise APIError(503, "The request was aborted before it finished.")
        return finals

    def abort_unfinished(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.unfinished:
            self.engine.abort(self.unfinished)
            self.unfinished = set()


async def _unless_disconnected(raw: Request, work: Awaitable[_T]) -> _T:
    """Awaits `work`, cancelling it (which aborts its requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():  # the client went away first
        task.cancel()
        raise APIError(_CLIENT_CLOSED_REQUEST, "The client disconnected.")
    return task.result()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """Server-sent events. Its event generator is closed however the response ends, so a client
    that disconnects mid-stream has its requests aborted at once."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._events.aclose()


async def _sse_events(
    chunks: AsyncGenerator[dict[str, Any], None],
) -> AsyncGenerator[str, None]:
    """Chunks as server-sent events, ending with `[DONE]`. An engine failure mid-stream becomes
    an error event (the openai client raises it as an APIError)."""
    try:
        async for chunk in chunks:
            yield _sse(chunk)
    except (RequestFailedError, EngineDeadError) as error:
        yield _sse(protocol.error_body(str(error), "server_error"))
    except APIError as error:  # a deadline
        yield _sse(error.body)
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


def _sse(body: dict[str, Any]) -> str:
    return f"data: {_json(body)}\n\n"


def _json(body: Any) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


# ---- the app --------------------------------------------------------------------------------
class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` (the scheme in any case, as HTTP says);
    /health, /ready, /metrics and /version stay open. A 401 says `WWW-Authenticate: Bearer`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = given.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(
                key.strip(), self.expected
            ):
                error = APIError(
                    401,
                    "Missing or incorrect API key: send the header Authorization: Bearer <key>.",
                    code="invalid_api_key",
                )
                response = error.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _NonFiniteNumber(ValueError):
    """NaN, Infinity or a number too large for a float: not JSON's numbers."""


def _reject_constant(name: str) -> float:
    raise _NonFiniteNumber(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFiniteNumber(f"{text} is out of a 64-bit float's range")
    return value


class _FiniteJSONRequest(Request):
    """A request whose JSON body holds finite numbers only: `NaN`, `Infinity` (which Python's
    json reads) and numbers past a double's range are malformed JSON, answered 400."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            text = (await self.body()).decode()
            try:
                self._json = json.loads(
                    text, parse_constant=_reject_constant, parse_float=_finite_float
                )
            except _NonFiniteNumber as error:
                raise json.JSONDecodeError(f"{error}: send finite numbers", text, 0) from None
        return self._json


class _FiniteJSONRoute(APIRoute):
    """Routes that parse their body with _FiniteJSONRequest."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def finite_json_handler(request: Request) -> Response:
            return await handler(_FiniteJSONRequest(request.scope, request.receive))

        return finite_json_handler


def build_app(
    engine: AsyncLLM,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_queued_requests: int | None = None,
    request_timeout: float | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S,
    grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The FastAPI app serving `engine` under `served_model_name` (default: the model path).

    Bodies over `max_request_bytes` get 413, bodies not received within `request_body_timeout`
    seconds 408; a structured-output constraint not compiled within `grammar_compile_timeout`
    seconds 400. At most max_num_seqs + `max_queued_requests`
    requests are in at once, more get 503; the default queue holds as many full-context prompts
    as the KV pool does, and at least one batch (max_num_seqs): deeper, a request would wait
    for more than the pool can start. `request_timeout` seconds after arrival a request is
    aborted (default: no limit). `chat_template` (a Jinja template's text) replaces the model's;
    `tool_call_parser` (a name in TOOL_PARSERS) turns on tool_choice "auto".
    `allow_runtime_lora_updating` adds the routes that load and unload adapters (needs an engine
    with enable_lora). A template that cannot render raises ValueError here.
    """
    config = engine.engine.config
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}.")
    if max_queued_requests is None:
        pool_tokens = engine.engine.num_kv_blocks * config.block_size
        max_queued_requests = max(config.max_num_seqs, pool_tokens // engine.max_model_len)
    if max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}.")
    if request_timeout is not None and request_timeout <= 0:
        raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}.")
    if not request_body_timeout > 0:
        raise ValueError(f"request_body_timeout must be > 0 seconds, got {request_body_timeout}.")
    if not grammar_compile_timeout > 0:
        raise ValueError(
            f"grammar_compile_timeout must be > 0 seconds, got {grammar_compile_timeout}."
        )
    _check_lora_updating(allow_runtime_lora_updating, engine.engine.config)
    if chat_template is not None:
        check_chat_template(engine.tokenizer, chat_template)
    tokenizers = TokenizerPool(engine.tokenizer, engine.max_model_len)
    serving = OpenAIServing(
        engine,
        served_model_name or config.model,
        tokenizers,
        request_timeout,
        chat_template,
        TOOL_PARSERS[tool_call_parser] if tool_call_parser else None,
        grammar_compile_timeout,
    )
    admission = Admission(config.max_num_seqs + max_queued_requests)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        tokenizers.shutdown()

    app = FastAPI(title="quire", version=__version__, lifespan=lifespan)
    app.router.route_class = _FiniteJSONRoute
    app.state.serving = serving
    app.state.admission = admission
    install_openapi(
        app,
        engine.max_model_len,
        engine.engine.model_config.vocab_size,
        bool(api_key),
        disaggregated=engine.engine.config.disaggregation_mode is not None,
    )
    # Starlette runs the last added outermost: key check, then admission, then the body limit.
    app.add_middleware(
        BodySizeLimit,
        max_bytes=max_request_bytes,
        timeout=request_body_timeout,
        error_response=_error_response,
    )
    app.add_middleware(
        AdmissionGate, admission=admission, paths=_WORK_PATHS, error_response=_error_response
    )
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        response = APIError(error.status_code, str(error.detail)).response()
        response.headers.update(error.headers or {})  # Allow, on a 405
        return response

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, error: RequestFailedError) -> JSONResponse:
        return APIError(500, str(error)).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return APIError(503, str(error)).response()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(body, raw)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return serving.models()

    if allow_runtime_lora_updating:  # else the routes are absent: 404

        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            return await serving.load_lora_adapter(body)

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            return await serving.unload_lora_adapter(body)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return APIError(503, "The engine has stopped.").response()
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        if not engine.is_running:
            return APIError(503, "The engine has stopped.").response()
        if admission.closing:
            return APIError(503, "The server is shutting down.").response()
        if not admission.has_room:
            return APIError(503, "The server is at its --max-queued-requests limit.").response()
        return Response(status_code=200)

    @app.get("/load")
    async def load() -> dict[str, Any]:
        """What `quire router` balances on, and where this instance's KV endpoint is."""
        stats = engine.engine.core_stats()
        kv = stats.kv_transfer
        endpoint = engine.engine.quire_config.kv_transfer
        return {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting + (kv.num_waiting if kv else 0),
            "kv_cache_usage": stats.kv_cache_usage,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "disaggregation_mode": config.disaggregation_mode,
            "kv_endpoint": (None if kv is None else {"host": endpoint.host, "port": endpoint.port}),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await serving.detokenize(body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app


def _check_lora_updating(allow_runtime_lora_updating: bool, config: EngineConfig) -> None:
    if allow_runtime_lora_updating and not config.enable_lora:
        raise ValueError(
            "--allow-runtime-lora-updating needs --enable-lora: adapters load into its slots."
        )


def _error_response(status: int, message: str, code: str) -> JSONResponse:
    return APIError(status, message, code=code).response()


def validation_error(error: RequestValidationError) -> APIError:
    """pydantic's complaints as one 400: malformed JSON, unknown fields, wrong types or values.
    Of several (a value that fits no member of a union), the deepest is the most telling."""
    problems = error.errors()
    problem = max(problems, key=lambda p: len(p["loc"]))
    param = _field_path(problem["loc"])
    if problem["type"] == "json_invalid":
        detail = problem.get("ctx", {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}".strip())
    if problem["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param)
    message = f"Invalid value for {param or 'the request body'}: {problem['msg']}"
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problems)"
    return APIError(400, message, param)


def _field_path(loc: tuple) -> str | None:
    """`messages.0.content` from pydantic's location, without "body" and union member tags."""
    parts = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif part[:1].isupper():  # a tagged union's member (a model's name)
            continue
        elif _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            parts.append(part)
        else:
            break
    return ".".join(parts) or None


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_requests: bool = True,
    log_stats: bool = True,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_queued_requests: int | None = None,
    request_timeout: float | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    allow_runtime_lora_updating: bool = False,
) -> None:
    """Loads the model and serves it until SIGTERM or SIGINT (`build_app` says what the limits
    and the chat options mean; quire.entrypoints.shutdown what the signals do, with
    `shutdown_timeout` seconds for the requests in flight after a SIGTERM)."""
    import uvicorn

    from quire.entrypoints.shutdown import GracefulServer

    if not shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}.")
    _check_lora_updating(allow_runtime_lora_updating, config)  # before the model loads
    name = served_model_name or DEFAULT_MODEL_NAME
    metrics = EngineMetrics(
        name, log_requests=log_requests, log_stats_interval_s=10.0 if log_stats else None
    )
    engine = AsyncLLM.from_engine_config(config, metrics)
    try:
        app = build_app(
            engine,
            name,
            api_key,
            max_request_bytes,
            max_queued_requests,
            request_timeout,
            chat_template,
            tool_call_parser,
            request_body_timeout,
            grammar_compile_timeout,
            allow_runtime_lora_updating,
        )
        config = uvicorn.Config(app, host=host, port=port, log_config=None)
        server = GracefulServer(
            config, engine, app.state.admission, app.state.serving.stopped, shutdown_timeout
        )
        logger.info("Serving %s at http://%s:%d/v1", name, host, port)
        server.run()
    finally:
        engine.shutdown()

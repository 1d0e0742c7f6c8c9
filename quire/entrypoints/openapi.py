"""The server's OpenAPI document (/openapi.json), made to say what the server really does.

FastAPI's generated document describes pydantic's 422 and JSON everywhere. This server answers
bad input with 400 and OpenAI's error body, may answer 401 (API key, with WWW-Authenticate),
404 (unknown model or adapter), 408 (a body not received within --request-body-timeout), 413 (a
body over --max-request-bytes), 500 (the engine failed the request), 503 (the engine
stopped, or the admission queue is full), 504 (the request's deadline passed), streams
text/event-stream,
answers /health with an empty body and /metrics in Prometheus' text format. Limits that depend
on the model (max_tokens below max_model_len, token ids below the vocabulary size) are written
into the document when it is built. Rules no schema can state (a prompt that does not fit the
context, fields that depend on each other) are declared beside the contract test, in
tests/schemathesis/.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_GENERATE = ("/v1/completions", "/v1/chat/completions")
# Routes that answer 404 for a name they do not know: a model, or an adapter to unload.
_CHECKS_MODEL = (*_GENERATE, "/tokenize", "/detokenize", "/v1/unload_lora_adapter")
_PUBLIC = ("/health", "/ready", "/metrics", "/version")
# One server-sent event of a stream (stream: true): a JSON chunk, or [DONE] at the end.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a field out of range, or a request the model cannot serve",
    401: "Missing or wrong API key",
    404: "The model or LoRA adapter named is not served",
    408: "The request body was not received within the server's --request-body-timeout",
    413: "The request body is larger than the server's --max-request-bytes",
    500: "The engine failed the request",
    503: "The engine has stopped, the request was aborted, or the server's queue is full "
    "(then with Retry-After)",
    504: "The request's deadline (its timeout, or the server's --request-timeout) passed",
}
# Routes behind the admission gate (api_server._WORK_PATHS): 503 when the queue is full.
_ADMITTED = (*_GENERATE, "/tokenize", "/detokenize")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorInfo


def install_openapi(
    app: FastAPI, max_model_len: int, vocab_size: int, api_key: bool, disaggregated: bool
) -> None:
    """Replaces `app.openapi` by one that builds the corrected document once. A collocated
    instance (not `disaggregated`) refuses `kv_transfer_params`, so its document has none."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _correct(schema, max_model_len, vocab_size, api_key)
            if not disaggregated:
                for model in schema["components"]["schemas"].values():
                    model.get("properties", {}).pop("kv_transfer_params", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _correct(schema: dict[str, Any], max_model_len: int, vocab_size: int, api_key: bool) -> None:
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    for model in (ErrorInfo, ErrorResponse):
        schemas[model.__name__] = model.model_json_schema(ref_template=_REF)
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            _correct_responses(path, operation, api_key)
    _limit_integers(schemas, max_model_len, vocab_size)


def _correct_responses(path: str, operation: dict[str, Any], api_key: bool) -> None:
    responses = operation["responses"]
    responses.pop("422", None)
    statuses = []
    if "requestBody" in operation:
        statuses += [400, 408, 413]
    if api_key and path not in _PUBLIC:
        statuses.append(401)
        operation["security"] = [{"bearer": []}]
    if path in _CHECKS_MODEL:
        statuses.append(404)
    if path in _ADMITTED:
        statuses.append(503)
    if path in _GENERATE:
        statuses += [500, 504]
        responses["200"]["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
    if path == "/health":
        statuses.append(503)
        responses["200"] = {"description": "The engine is running (empty body)"}
    if path == "/ready":
        statuses.append(503)
        responses["200"] = {"description": "The server admits requests (empty body)"}
    if path == "/metrics":
        responses["200"] = {
            "description": "Prometheus metrics, text format",
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
        }
    for status in sorted(set(statuses)):
        responses[str(status)] = {
            "description": _DESCRIPTIONS[status],
            "content": {
                "application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}
            },
        }
    if "401" in responses:
        responses["401"]["headers"] = {
            "WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}
        }


def _limit_integers(schemas: dict[str, Any], max_model_len: int, vocab_size: int) -> None:
    """The model's limits on the request fields: a prompt holds at least one token, so
    max_tokens stays below max_model_len; token ids index the vocabulary."""
    max_tokens = {"maximum": max_model_len - 1}
    token_id = {"maximum": vocab_size - 1}
    for model, field, limit in [
        ("CompletionRequest", "max_tokens", max_tokens),
        ("ChatCompletionRequest", "max_tokens", max_tokens),
        ("ChatCompletionRequest", "max_completion_tokens", max_tokens),
        ("CompletionRequest", "prompt", token_id),
        ("DetokenizeRequest", "tokens", token_id),
    ]:
        _set_on_integers(schemas[model]["properties"][field], limit)


def _set_on_integers(node: Any, limit: dict[str, int]) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.update(limit)
        for value in node.values():
            _set_on_integers(value, limit)
    elif isinstance(node, list):
        for value in node:
            _set_on_integers(value, limit)

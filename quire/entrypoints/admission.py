"""What the server lets in: request bodies up to a size, and a bounded number of requests at once.

Both are ASGI middleware, so they act before FastAPI reads or parses anything:
- `BodySizeLimit`: a body over `max_bytes` gets 413, at once when its Content-Length says so,
  else as soon as the bytes read pass the limit. The body is never parsed.
- `AdmissionGate`: the API routes that take work (completions, chat, tokenize, detokenize) hold a
  slot from the moment their request arrives until their response has been sent, a stream to its
  end. Once `capacity` are held, more get 503 with `Retry-After` instead of piling up in memory.
  The server sets `capacity` to max_num_seqs (what the engine runs at once) plus
  `--max-queued-requests` (what may wait behind them). A request counts once whatever its number
  of prompts: the slot bounds bodies held and clients waiting, the engine bounds sequences.

Errors are OpenAI's body `{"error": {...}}`, built by the caller's `error_response`.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A full context of text or token ids fits many times over.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20

# Seconds a client is told to wait after a 503: the queue drains at the pace of the engine's
# steps, so a second is many steps and not so long that a client sits idle.
RETRY_AFTER_S = 1

ErrorResponse = Callable[[int, str, str], Response]  # (status, message, code)


class BodySizeLimit:
    """413 for a request body over `max_bytes`; smaller bodies are read here and replayed."""

    def __init__(self, app: ASGIApp, max_bytes: int, error_response: ErrorResponse) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-bytes): send a shorter prompt."
        )
        await self.error_response(413, message, "request_too_large")(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the whole body once, then whatever the client sends next (its
    disconnect, which streaming responses watch for)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class Admission:
    """The count of admitted requests against `capacity` (touched only on the event loop)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_admitted = 0

    @property
    def has_room(self) -> bool:
        return self.num_admitted < self.capacity


class AdmissionGate:
    """Admits requests to `paths` while `admission` has room; 503 with Retry-After otherwise."""

    def __init__(
        self,
        app: ASGIApp,
        admission: Admission,
        paths: frozenset[str],
        error_response: ErrorResponse,
    ) -> None:
        self.app = app
        self.admission = admission
        self.paths = paths
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        admission = self.admission
        if not admission.has_room:
            message = (
                f"The server is busy: {admission.capacity} requests are already running or "
                f"queued. Retry after {RETRY_AFTER_S} s."
            )
            response = self.error_response(503, message, "server_busy")
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            await response(scope, receive, send)
            return
        admission.num_admitted += 1
        try:
            await self.app(scope, receive, send)
        finally:
            admission.num_admitted -= 1

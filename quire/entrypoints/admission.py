"""What the server lets in: request bodies up to a size and within a time, and a bounded number of
requests at once.

Both are ASGI middleware, so they act before FastAPI reads or parses anything:
- `BodySizeLimit`: a body over `max_bytes` gets 413, at once when its Content-Length says so,
  else as soon as the bytes read pass the limit. The body is never parsed. A body not received
  in full within `timeout` seconds (a client that declares more than it sends, or trickles)
  gets 408 and its connection is closed.
- `AdmissionGate`: the API routes that take work (completions, chat, tokenize, detokenize) hold a
  slot from the moment their request arrives until their response has been sent, a stream to its
  end. Once `capacity` are held, more get 503 with `Retry-After` instead of piling up in memory.
  The server sets `capacity` to max_num_seqs (what the engine runs at once) plus
  `--max-queued-requests` (what may wait behind them). A request counts once whatever its number
  of prompts: the slot bounds bodies held and clients waiting, the engine bounds sequences.
  Once the server is closing (quire.entrypoints.shutdown), every new request gets 503.

Errors are OpenAI's body `{"error": {...}}`, built by the caller's `error_response`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: `quire --help` and `quire bench` run without the server's packages
    from starlette.responses import Response
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A full context of text or token ids fits many times over.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20

# Seconds a client has to send its whole body: a 4 MiB body at 10 Mbit/s takes about 3.5 s.
DEFAULT_REQUEST_BODY_TIMEOUT_S = 5.0

# Seconds the requests in flight get to finish after a SIGTERM (--shutdown-timeout): a few
# hundred tokens of a stream on a CPU; longer ones end with an error event.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0

# Seconds a structured-output constraint may take to compile before the request gets 400
# (--grammar-compile-timeout): a 10,000-member enum compiles in a few seconds on 2 cores.
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0

# Seconds a client is told to wait after a 503: the queue drains at the pace of the engine's
# steps, so a second is many steps and not so long that a client sits idle.
RETRY_AFTER_S = 1

ErrorResponse = Callable[[int, str, str], "Response"]  # (status, message, code)


class BodySizeLimit:
    """413 for a request body over `max_bytes`, 408 for one not received within `timeout`
    seconds; other bodies are read here and replayed."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, timeout: float, error_response: ErrorResponse
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read_body(receive)
        except TimeoutError:
            await self._too_slow(scope, receive, send)
            return
        except _TooLarge:
            await self._too_large(scope, receive, send)
            return
        if body is None:
            return  # the client left before sending its body: nobody to answer
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body; None if the client disconnects first, _TooLarge past max_bytes."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"The request body was not received within this server's limit of "
            f"{self.timeout:g} s (--request-body-timeout): send the whole body at once, as "
            "long as its Content-Length says."
        )
        response = self.error_response(408, message, "request_timeout")
        response.headers["Connection"] = "close"  # what is left of the body is never read
        await response(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-bytes): send a shorter prompt."
        )
        await self.error_response(413, message, "request_too_large")(scope, receive, send)


class _TooLarge(Exception):
    """A body past max_bytes."""


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
    """The count of admitted requests against `capacity`, and whether the server is closing
    (shutting down: it admits nothing more). Touched only on the event loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_admitted = 0
        self.closing = False

    @property
    def has_room(self) -> bool:
        return not self.closing and self.num_admitted < self.capacity


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
        if admission.closing:
            message = "The server is shutting down: send the request to another instance."
            await self.error_response(503, message, "server_shutting_down")(scope, receive, send)
            return
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

"""GracefulServer: uvicorn serving the OpenAI app, stopped the way an operator expects.

- The first SIGTERM closes admission (new requests and /ready get 503, so a load balancer
  routes elsewhere while the listener stays open), then lets the requests in flight finish for
  up to `shutdown_timeout` seconds (vLLM's --shutdown-timeout).
- When they have finished, or the time is up, the engine shuts down: every request still live
  ends with an error (a stream gets an error event, then `[DONE]`; a waiting client, one whose
  grammar is still compiling included, a 503),
  uvicorn closes the connections once their responses are sent, and the process exits 0.
- A second SIGTERM, or a SIGINT (Ctrl-C) at any time, skips the wait: the live requests end
  with the error event at once.

uvicorn's own handling is replaced: it stops listening at once, waits for the longest stream
without a bound, and re-raises the signal once it is done (exit status -15 instead of 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator

import uvicorn

from quire.engine.async_engine import AsyncLLM
from quire.entrypoints.admission import Admission

logger = logging.getLogger(__name__)

# What a stopping server gives a response whose request the engine has ended to be sent (an
# error event and [DONE]) before its connection is cut.
_FLUSH_S = 2.0
_POLL_S = 0.05


class GracefulServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncLLM,
        admission: Admission,
        stopped: asyncio.Event,
        shutdown_timeout: float,
    ) -> None:
        config.timeout_graceful_shutdown = _FLUSH_S
        super().__init__(config)
        self.engine = engine
        self.admission = admission
        self.stopped = stopped  # set once the live requests have been ended
        self.shutdown_timeout = shutdown_timeout
        self._drain: asyncio.Task | None = None
        self._stopping = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only: nothing to handle here
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def on_signal(self, sig: signal.Signals) -> None:
        """The first SIGTERM drains; a second one, or a SIGINT, stops at once."""
        if self._stopping:
            return  # the live requests are being ended already
        if sig == signal.SIGTERM and self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_stop())
            return
        if self._drain is not None:
            self._drain.cancel()
        asyncio.ensure_future(self._stop(f"The server was stopped ({signal.Signals(sig).name})"))

    async def _drain_then_stop(self) -> None:
        self.admission.closing = True
        num_live = self.admission.num_admitted
        logger.info(
            "SIGTERM: admitting no more requests; waiting up to %g s for the %d in flight "
            "(--shutdown-timeout)",
            self.shutdown_timeout,
            num_live,
        )
        deadline = time.monotonic() + self.shutdown_timeout
        while self.admission.num_admitted and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        await self._stop(
            f"The server is shutting down (SIGTERM) and its --shutdown-timeout of "
            f"{self.shutdown_timeout:g} s has passed"
        )

    async def _stop(self, why: str) -> None:
        """Ends every live request with `why` and has uvicorn exit once responses are sent."""
        self._stopping = True
        self.admission.closing = True
        if self.admission.num_admitted:
            logger.warning("%s: ending %d requests", why, self.admission.num_admitted)
        reason = f"{why}: the request was ended before it finished; retry it."
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown, None, reason)
        self.stopped.set()  # requests still waiting for a grammar's compile: 503
        self.should_exit = True

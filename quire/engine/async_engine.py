"""AsyncLLM: an asyncio front over LLMEngine.

One background thread owns the engine and runs the step loop; nothing else touches the engine.
Callers talk to it through a command queue (add, abort, adapter changes, shutdown) and get each
request's outputs through an asyncio queue fed from the thread with `call_soon_threadsafe`, one
call per event loop per step. The thread steps while any request is live, so concurrent requests
batch together, and blocks on the command queue when idle.

`from_engine_config` builds the engine on that thread too, so that it is the only thread with
OpenMP workers: a second pool (the main thread's, after loading the weights) made libgomp stop
spinning between parallel regions and a served decode step ~1.6x slower than offline
(quire.engine.host_threads).

Why a thread and not an engine-core process: torch releases the GIL while it computes, so the
server's event loop runs alongside a step, and what it does per token (one SSE chunk) is small
next to the step. Measured on 2 CPU cores with 64 streaming clients (client on the same cores):
SmolLM2-135M's full-batch decode step took 172-178 ms served against 158-219 ms offline, and
throughput was the same within noise. With a tiny model, whose step is mostly Python, the step
grew from ~26 to ~40 ms: that is where a separate engine-core process starts to pay (short GPU
steps will be the same case), at the price of sending every output across processes.

Each request's stream is an async generator of cumulative RequestOutputs. A consumer that falls
behind gets the newest output only (outputs are cumulative, so nothing is lost). Closing or
cancelling the stream before the request finishes aborts it, which frees its KV blocks once the
current step ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass

from quire.config import EngineConfig
from quire.engine.host_threads import release_openmp_threads
from quire.engine.llm_engine import LLMEngine, PromptType
from quire.engine.metrics import EngineMetrics
from quire.lora_request import LoRARequest
from quire.outputs import RequestOutput
from quire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the loop sleeps when it has live requests but could schedule none of them.
_STALL_WAIT_S = 0.001
# How long it sleeps when it only holds KV leases for decode instances (prefill instance): the
# KV server answers pulls on its own thread, the loop only frees what was pulled or ran out.
_LEASE_WAIT_S = 0.01


class EngineDeadError(RuntimeError):
    """The step loop has stopped; the engine takes no more requests."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (an internal error, not bad input)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    # RequestOutput, a RequestFailedError/EngineDeadError to raise, or None: aborted elsewhere.
    queue: asyncio.Queue


@dataclass
class _AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams | None
    arrival_time: float
    stream: _Stream
    added: asyncio.Future
    lora_request: LoRARequest | str | None


@dataclass
class _Call:
    """`function(engine)` to run on the engine thread; its result or error settles `done`."""

    function: Callable[[LLMEngine], object]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Shutdown:
    reason: str  # the error that live requests end with


class AsyncLLM:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        """Serves an engine built on the calling thread. That thread's OpenMP workers are
        released first (quire.engine.host_threads): a second pool would slow every step."""
        release_openmp_threads()
        self._start(lambda: engine, metrics)

    @classmethod
    def from_engine_config(
        cls, config: EngineConfig, metrics: EngineMetrics | None = None
    ) -> AsyncLLM:
        """Builds the engine on the engine thread, which then is the only thread that runs
        parallel regions. Raises what building the engine raises."""
        async_llm = cls.__new__(cls)
        async_llm._start(functools.partial(LLMEngine, config), metrics)
        return async_llm

    def _start(self, build: Callable[[], LLMEngine], metrics: EngineMetrics | None) -> None:
        """Starts the engine thread and returns once it has built the engine."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # owned by the engine thread
        # The engine's adapters as of its last command, replaced whole by the engine thread.
        self._loras: dict[str, LoRARequest] = {}
        self._dead: BaseException | None = None
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(build, metrics, ready), name="quire-engine", daemon=True
        )
        self._thread.start()
        ready.result()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def has_work(self) -> bool:
        """Whether the engine has a request unfinished or K/V to move."""
        return self._has_work()

    def check_invariants(self) -> None:
        """LLMEngine.check_invariants; for tests, once `has_work()` is False (it reads the
        engine's state from the caller's thread, which is safe only while the engine waits)."""
        self.engine.check_invariants()

    # ---- requests (any event loop) -------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queues a request and returns its output stream once the engine has accepted it.
        `lora_request`: the adapter it runs: a LoRARequest (loaded first if new, as
        LLMEngine.add_request), or the name of a loaded one (KeyError if none is loaded under
        that name when the engine takes the request); None: the base model.

        Raises ValueError (the engine untouched) on bad input. Closing the stream before the
        last output aborts the request; so does cancelling this call.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        added = loop.create_future()
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(
            _AddRequest(request_id, prompt, params, arrival_time, stream, added, lora_request)
        )
        self._check_alive()  # a loop that died before taking the command never will
        try:
            await added
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return self._iterate(request_id, stream)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Cumulative outputs of one request until it finishes; leaving early aborts it.
        `lora_request` as add_request's."""
        stream = await self.add_request(
            request_id or uuid.uuid4().hex, prompt, params, lora_request=lora_request
        )
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    # ---- adapters (any event loop) -------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> None:
        """LLMEngine.add_lora on the engine thread: ValueError if the name is taken or LoRA is
        off, LoRAAdapterError (a ValueError) naming what does not fit."""
        await self._call(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, name: str) -> None:
        """LLMEngine.remove_lora on the engine thread: requests that run the adapter finish
        with it. KeyError if no adapter of that name is loaded."""
        await self._call(lambda engine: engine.remove_lora(name))

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded, as of the engine thread's last command (add_lora and
        remove_lora return once it shows their change). Safe from any thread."""
        return list(self._loras.values())

    async def _call(self, function: Callable[[LLMEngine], object]) -> object:
        self._check_alive()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(_Call(function, loop, done))
        self._check_alive()
        return await done

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Ends requests and frees their KV blocks after the current step. Safe from any thread;
        ids that are finished or unknown are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._commands.put(_Abort(ids))

    def shutdown(
        self, timeout: float | None = 10.0, reason: str = "The engine was shut down."
    ) -> None:
        """Stops the step loop and the engine's processes; live requests end with
        EngineDeadError(reason)."""
        self._commands.put(_Shutdown(reason))
        self._thread.join(timeout)

    async def _iterate(
        self, request_id: str, stream: _Stream
    ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # Outputs are cumulative: a consumer that fell behind needs only the newest.
                while isinstance(item, RequestOutput) and not item.finished:
                    if stream.queue.empty():
                        break
                    item = stream.queue.get_nowait()
                if item is None:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def _check_alive(self) -> None:
        if not self.is_running:
            if isinstance(self._dead, EngineDeadError):  # shut down: its reason says why
                raise EngineDeadError(str(self._dead))
            raise EngineDeadError(f"The engine has stopped: {self._dead!r}")

    # ---- the step loop (engine thread) ---------------------------------------------------
    def _run(
        self,
        build: Callable[[], LLMEngine],
        metrics: EngineMetrics | None,
        ready: concurrent.futures.Future,
    ) -> None:
        try:
            self.engine = build()
            # The engine's tokenizer, shared with the server's threads (a copy took as long as
            # loading it): every use only reads it, which tokenizers allows concurrently (no
            # truncation or padding is ever set; quire.entrypoints.tokenizer_pool).
            self.tokenizer = self.engine.tokenizer
            self.metrics = metrics or EngineMetrics(
                self.engine.config.model, log_stats_interval_s=None
            )
            self._refresh_loras()
        except BaseException as error:
            self._dead = error
            ready.set_exception(error)
            return
        ready.set_result(None)
        try:
            while (shutdown := self._handle_commands(block=not self._has_work())) is None:
                if self._has_work():
                    self._step()
                self.metrics.log_stats_if_due(self.engine, time.monotonic())
        except BaseException as error:
            logger.exception("The engine loop died")
            self._dead = error
            self._end_all_streams(EngineDeadError(f"The engine has stopped: {error!r}"))
        else:
            self._dead = EngineDeadError(shutdown.reason)
            self._end_all_streams(self._dead)
        self.engine.shutdown()  # its core and worker processes, if any

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests() or self.engine.has_kv_transfers()

    def _end_all_streams(self, error: EngineDeadError) -> None:
        """Ends every live stream and every request still queued (the loop has stopped)."""
        for stream in self._streams.values():
            _call_soon(stream.loop, stream.queue.put_nowait, error)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _AddRequest):
                _call_soon(command.stream.loop, _settle, command.added, error)
            elif isinstance(command, _Call):
                _call_soon(command.loop, _settle, command.done, error)

    def _handle_commands(self, block: bool) -> _Shutdown | None:
        """Runs queued commands (waiting for one if `block`); the shutdown once told to."""
        try:
            if block:
                command = self._commands.get(timeout=self.metrics.log_stats_interval_s)
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return None
        aborted: list[str] = []
        while True:
            if isinstance(command, _Shutdown):
                return command
            if isinstance(command, _AddRequest):
                self._add(command)
            elif isinstance(command, _Call):
                self._run_call(command)
            else:
                aborted += command.request_ids
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        if aborted:
            self._abort(aborted)
        self._refresh_loras()  # an added request may have loaded its adapter
        self.metrics.update_gauges(self.engine)
        return None

    def _run_call(self, command: _Call) -> None:
        try:
            result = command.function(self.engine)
        except Exception as error:
            _call_soon(command.loop, _settle, command.done, error)
        else:
            self._refresh_loras()
            _call_soon(command.loop, _set_result, command.done, result)

    def _refresh_loras(self) -> None:
        self._loras = {r.lora_name: r for r in self.engine.list_loras()}

    def _add(self, command: _AddRequest) -> None:
        lora = command.lora_request
        try:
            if isinstance(lora, str):
                lora = self.engine.get_lora(lora)
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                command.arrival_time,
                lora_request=lora,
            )
        except Exception as error:
            # ValueError is bad input, KeyError an adapter not loaded; anything else fails it
            if not isinstance(error, ValueError | KeyError):
                logger.exception("Adding request %s failed", command.request_id)
                error = RequestFailedError(f"Adding the request failed: {error!r}")
            _call_soon(command.stream.loop, _settle, command.added, error)
            return
        self._streams[command.request_id] = command.stream
        if lora is not None:
            self.metrics.record_lora_request(lora.lora_name)
        if not _call_soon(command.stream.loop, _settle, command.added, None):
            self._abort([command.request_id])  # the caller's event loop is gone

    def _abort(self, request_ids: list[str], reason: str = "abort") -> None:
        live = [rid for rid in dict.fromkeys(request_ids) if rid in self.engine.groups]
        self.engine.abort_request(live)
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                _call_soon(stream.loop, stream.queue.put_nowait, None)
        if live:
            self.metrics.record_aborted(live, time.monotonic(), reason)

    def _step(self) -> None:
        num_steps = self.engine.num_steps
        try:
            outputs = self.engine.step()
        except Exception as error:
            self._fail_live_requests(error)
            return
        self.metrics.record_step(self.engine, outputs, time.monotonic())
        self._deliver(outputs)
        if self.engine.num_steps == num_steps:  # nothing could be scheduled: wait a little
            idle = not self.engine.has_unfinished_requests()
            time.sleep(_LEASE_WAIT_S if idle else _STALL_WAIT_S)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]]
        batches = defaultdict(list)
        ids_by_loop: dict[asyncio.AbstractEventLoop, list[str]] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            item: RequestOutput | RequestFailedError = output
            failed = [o.stop_reason for o in output.outputs if o.finish_reason == "error"]
            if output.finished and failed:
                # failed in the engine (its K/V never arrived): an error for the caller
                item = RequestFailedError(f"Request {output.request_id} failed: {failed[0]}")
            batches[stream.loop].append((stream.queue, item))
            ids_by_loop[stream.loop].append(output.request_id)
            if output.finished:
                del self._streams[output.request_id]
        for loop, items in batches.items():
            if not _call_soon(loop, _put_all, items):
                self._abort(ids_by_loop[loop])  # the consumers' event loop is gone

    def _fail_live_requests(self, error: Exception) -> None:
        """A step raised: which request caused it is unknown, so every live request fails (with
        an error for its caller) and the engine is emptied; the loop keeps serving new ones."""
        request_ids = list(self.engine.groups)
        logger.exception("Engine step failed; failing %d live requests", len(request_ids))
        failure = RequestFailedError(f"The engine failed while running this request: {error!r}")
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                _call_soon(stream.loop, stream.queue.put_nowait, failure)
        self.engine.abort_all()
        self.metrics.record_aborted(request_ids, time.monotonic(), "error")
        self.metrics.update_gauges(self.engine)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> bool:
    """Schedules `callback` on `loop` from another thread; False if the loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _set_result(future: asyncio.Future, result: object) -> None:
    if not future.done():  # the caller was cancelled
        future.set_result(result)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for stream_queue, item in items:
        stream_queue.put_nowait(item)

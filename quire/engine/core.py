"""EngineCore: schedule -> executor.submit -> scheduler.update, and nothing else.

Up to `max_steps_in_flight` steps are in flight at once (vLLM's batch queue; by default one per
pipeline stage, so every stage has work): a step call submits steps while the queue has room and
the scheduler finds requests with no step in flight, then waits for the oldest and updates from
it. With one step in flight, that is schedule, execute, update. Async scheduling keeps two in
flight on one stage, the second over the same requests (engine/scheduler.py): the core schedules
step N + 1, then takes step N's outputs, while the worker runs step N.

The scheduler writes each step's SchedulerOutput, asking the Speculator (engine/
speculator.py) which proposals to verify and the StructuredOutputManager (structured_output/
manager.py) for the grammar bitmask; the core gives a request its grammar matcher when it is
added, and after the step hands the speculator the step's output (accepted tokens, the worker's
proposals for the next step) and time.

It takes tokenized `Request`s and gives back, per step, plain `EngineCoreOutput`s (new token ids,
logprobs, finish status) for each sequence that made progress. Text (tokenizing, detokenizing,
stop strings) belongs to the front end (llm_engine.py), which only calls `add_request`,
`abort_requests` and `step`, so the core can run in a process of its own.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quire.config import QuireConfig
from quire.engine.kv_manager import KVCacheManager
from quire.engine.request import Request, RequestStatus
from quire.engine.scheduler import Scheduler
from quire.engine.speculator import SpecDecodingStats, Speculator
from quire.executor import make_executor
from quire.executor.base import StepFuture
from quire.kv_transfer.scheduler_connector import KVConnectorScheduler, KVTransferStats
from quire.messages import SchedulerOutput, TopLogprobs
from quire.model.tokenizer import load_tokenizer
from quire.structured_output.compiler import GrammarCompiler
from quire.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from quire.worker.worker import WorkerState

logger = logging.getLogger(__name__)


@dataclass
class CoreStats:
    """The core's state, for gauges and the stats line."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_kv_blocks: int = 0
    num_preemptions: int = 0  # since start
    prefix_cache_queries: int = 0  # tokens looked up, since start
    prefix_cache_hits: int = 0
    spec_decoding: SpecDecodingStats | None = None  # None when speculation is off
    kv_transfer: KVTransferStats | None = None  # None without --disaggregation-mode
    # The adapters (their core names, "name@load") of running and of waiting requests; empty
    # without enable_lora.
    running_lora_adapters: frozenset[str] = frozenset()
    waiting_lora_adapters: frozenset[str] = frozenset()
    most_steps_in_flight: int = 0  # since start
    num_scheduled_ahead: int = 0  # async scheduling: requests scheduled ahead, since start


@dataclass(slots=True)
class EngineCoreOutput:
    """What one sequence got from one step."""

    req_id: str
    group_id: str
    index: int  # which of its group's n completions
    new_token_ids: list[int]
    logprobs: TopLogprobs | None  # one row per new token, when asked for
    prompt_logprobs: TopLogprobs | None  # for the prompt chunk computed this step
    prompt_logprobs_start: int  # the prompt position that chunk starts at
    status: RequestStatus
    stop_reason: int | str | None
    num_cached_tokens: int
    first_scheduled_time: float | None


@dataclass
class _StepInFlight:
    output: SchedulerOutput
    future: StepFuture
    start: float  # perf_counter at its scheduling


class EngineCore:
    def __init__(self, config: QuireConfig, grammar_compiler: GrammarCompiler | None = None):
        """`grammar_compiler`: the front end's, when the core runs in its process (one cache);
        otherwise the core makes its own."""
        self.executor = make_executor(config)
        config = config.with_kv_pool(self.executor.num_kv_blocks)
        self.config = config
        self.max_model_len = config.model.max_model_len
        self.num_kv_blocks = config.cache.num_kv_blocks
        cache, scheduler, spec = config.cache, config.scheduler, config.speculative
        self.kv_manager = KVCacheManager(
            self.num_kv_blocks, cache.block_size, cache.enable_prefix_caching
        )
        self.speculator = Speculator(spec) if spec is not None else None
        architecture = config.model.architecture
        if grammar_compiler is None:
            grammar_compiler = GrammarCompiler(
                functools.partial(load_tokenizer, config.model.model, config.model.tokenizer),
                architecture.vocab_size,
                architecture.eos_token_ids,
                scheduler.grammar_cache_bytes,
            )
        num_spec = spec.num_speculative_tokens if spec else 0
        self.structured_output = StructuredOutputManager(
            grammar_compiler, scheduler.max_num_seqs * (1 + num_spec)
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
            self.max_model_len,
            num_lookahead_tokens=num_spec,
            kv_connector=(
                None
                if config.kv_transfer is None
                else KVConnectorScheduler(config.kv_transfer.lease_timeout)
            ),
            speculator=self.speculator,
            structured_output=self.structured_output,
            max_loras=0 if config.lora is None else config.lora.max_loras,
            max_steps_in_flight=scheduler.max_steps_in_flight,
            async_scheduling=scheduler.async_scheduling,
        )
        self.max_steps_in_flight = scheduler.max_steps_in_flight
        self._in_flight: deque[_StepInFlight] = deque()
        self._last_step_done = 0.0  # when the last step came back (perf_counter)
        self.most_steps_in_flight = 0  # the most steps ever in flight at once
        self.num_steps = 0  # steps run (that computed something), since start

    def add_request(self, request: Request) -> None:
        """Queues a request; raises GrammarError (a ValueError) for a grammar xgrammar rejects
        (the front end validates before, so this is a cache lookup)."""
        request.grammar = self.structured_output.grammar_for(request.sampling_params)
        self.scheduler.add_request(request)

    def abort_requests(
        self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Ends these sequences (ids unknown to the core are skipped) and frees their blocks."""
        self.scheduler.finish_requests(req_ids, status)

    def abort_all(self) -> None:
        """Ends every sequence, and drops the block copies and the steps in flight of a step
        that failed."""
        self._in_flight.clear()
        self.scheduler.finish_requests(
            list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED
        )
        self.kv_manager.take_copies()

    def has_unfinished_requests(self) -> bool:
        """Whether a step call has work: a request, or a step still in flight (async
        scheduling leaves one behind a request's last token, whose token is dropped)."""
        return self.scheduler.num_unfinished > 0 or bool(self._in_flight)

    def reset_prefix_cache(self) -> None:
        """Forgets the prefix cache's entries for free blocks: later prompts compute from cold."""
        self.kv_manager.reset_prefix_cache()

    def has_kv_transfers(self) -> bool:
        """Whether K/V is being pulled or held for a decode instance: the core must keep
        stepping (with nothing to compute, such a step only moves K/V)."""
        return self.scheduler.has_kv_work

    def stats(self) -> CoreStats:
        scheduler, kv = self.scheduler, self.kv_manager
        lora = self.config.lora is not None
        return CoreStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=kv.usage,
            num_free_kv_blocks=kv.num_free_blocks,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            spec_decoding=None if self.speculator is None else self.speculator.stats,
            kv_transfer=(
                None if scheduler.kv_connector is None else scheduler.kv_connector.snapshot()
            ),
            running_lora_adapters=_lora_names(scheduler.running) if lora else frozenset(),
            waiting_lora_adapters=_lora_names(scheduler.waiting) if lora else frozenset(),
            most_steps_in_flight=self.most_steps_in_flight,
            num_scheduled_ahead=scheduler.num_scheduled_ahead,
        )

    def worker_states(self) -> list[WorkerState]:
        return self.executor.worker_states()

    def idle_problems(self) -> list[str]:
        """What keeps the core from being idle, in words (none when idle): a request running,
        waiting, waiting for K/V or leased; a KV block not free (the KV manager's books, checked
        first, hold a block free exactly when its ref count is 0); on any rank, a request in the
        worker's batch or draft state other than those the next step tells it to drop.
        Raises AssertionError if the KV manager's books disagree."""
        scheduler, kv = self.scheduler, self.kv_manager
        kv.check_invariants()
        problems = []
        for name, ids in [
            ("running", [r.request_id for r in scheduler.running]),
            ("waiting", [r.request_id for r in scheduler.waiting]),
            ("waiting for K/V", list(scheduler.waiting_for_kv)),
            ("leased to a decode instance", list(scheduler.leased)),
        ]:
            if ids:
                problems.append(f"{len(ids)} request(s) {name} ({', '.join(ids)})")
        if self._in_flight:
            problems.append(f"{len(self._in_flight)} step(s) in flight")
        if kv.num_free_blocks != kv.num_blocks:
            holders = ", ".join(sorted(kv.req_blocks)) or "no request"
            problems.append(
                f"{kv.num_blocks - kv.num_free_blocks} of {kv.num_blocks} KV blocks not free "
                f"(held by {holders})"
            )
        dropping = set(scheduler.pending_drops)
        for state in self.executor.worker_states():
            for what, ids in [
                ("in its batch", state.request_ids),
                ("in its draft state", state.draft_request_ids),
            ]:
                if kept := sorted(set(ids) - dropping):
                    problems.append(f"rank {state.rank} holds request(s) {kept} {what}")
        return problems

    def step(self) -> list[EngineCoreOutput]:
        """One iteration: submits steps while there is room in flight and something to run,
        then takes the oldest step's result; an output for every sequence that made progress
        in it (none when nothing could be scheduled and nothing is in flight)."""
        while len(self._in_flight) < self.max_steps_in_flight and self._submit():
            pass
        if not self._in_flight:
            return []
        step = self._in_flight.popleft()
        try:
            runner_output = step.future.result()
        except BaseException:
            self._in_flight.clear()  # the executor ended its workers: these never come back
            raise
        scheduler_output, start = step.output, step.start
        if not scheduler_output.is_empty:
            self.num_steps += 1
        requests = self.scheduler.requests
        # Where each prompt-logprob chunk starts, read before update advances the counts.
        prompt_starts = {
            req_id: requests[req_id].num_computed_tokens for req_id in runner_output.prompt_logprobs
        }
        updated = self.scheduler.update(scheduler_output, runner_output)
        now = time.perf_counter()
        if self.speculator is not None:  # with steps in flight, a step costs from the last one
            self.speculator.record_step(
                scheduler_output, runner_output, now - max(start, self._last_step_done)
            )
        self._last_step_done = now
        outputs: dict[str, EngineCoreOutput] = {}
        for request, token_ids in updated:
            outputs[request.request_id] = self._output(request, token_ids, runner_output.logprobs)
        for req_id, top in runner_output.prompt_logprobs.items():
            request = requests.get(req_id)
            if request is None:  # finished by this very step: its output is already there
                output = outputs[req_id]
            else:
                output = outputs.setdefault(req_id, self._output(request, [], {}))
            output.prompt_logprobs, output.prompt_logprobs_start = top, prompt_starts[req_id]
        while self._in_flight and not self.scheduler.requests:
            # Steps past every request's end (async scheduling ran one beyond a stop token):
            # taken back now, so an engine with nothing to do has nothing in flight.
            stale = self._in_flight.popleft()
            self.scheduler.update(stale.output, stale.future.result())
        return list(outputs.values())

    def _submit(self) -> bool:
        """Schedules a step and hands it to the executor; whether it computes anything (a step
        that only moves K/V is submitted too, but then stops the filling of the queue)."""
        start = time.perf_counter()
        kv_work = self.scheduler.has_kv_work
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not (kv_work or self.scheduler.has_kv_work):
            return False
        future = self.executor.submit(scheduler_output)
        self._in_flight.append(_StepInFlight(scheduler_output, future, start))
        self.most_steps_in_flight = max(self.most_steps_in_flight, len(self._in_flight))
        return not scheduler_output.is_empty

    @staticmethod
    def _output(
        request: Request, token_ids: list[int], logprobs: dict[str, TopLogprobs]
    ) -> EngineCoreOutput:
        top = logprobs.get(request.request_id) if token_ids and logprobs else None
        if top is not None and len(top.ranks) > len(token_ids):  # tokens after a stop dropped
            n = len(token_ids)
            top = TopLogprobs(top.token_ids[:n], top.logprobs[:n], top.ranks[:n])
        return EngineCoreOutput(  # by position: one per sequence and step
            request.request_id,
            request.group_id,
            request.index,
            token_ids,  # new_token_ids
            top,  # logprobs
            None,  # prompt_logprobs
            0,  # prompt_logprobs_start
            request.status,
            request.stop_reason,
            max(request.num_cached_tokens, 0),
            request.first_scheduled_time,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()


def _lora_names(requests: Iterable[Request]) -> frozenset[str]:
    return frozenset(r.lora_request.lora_name for r in requests if r.lora_request is not None)

"""Serving metrics: Prometheus series with vLLM's names under a `quire:` prefix, one log line per
finished request, and a periodic engine stats line.

`EngineMetrics` is fed by the async engine's step loop (one thread), right after each step and
after each abort; Prometheus reads it from the server thread (prometheus_client locks its values).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from quire.engine.llm_engine import LLMEngine
from quire.engine.speculator import SpecDecodingStats
from quire.kv_transfer.scheduler_connector import KVTransferStats
from quire.outputs import RequestOutput

logger = logging.getLogger(__name__)

_PREFIX = "quire:"
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass
class _RequestState:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float
    last_token_time: float
    num_output_tokens: int = 0


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        log_requests: bool = True,
        log_stats_interval_s: float | None = 10.0,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.log_requests = log_requests
        self.log_stats_interval_s = log_stats_interval_s
        names = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(_PREFIX + name, doc, names, buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(_PREFIX + name, doc, names, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(_PREFIX + name, doc, names, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between a request's token steps.", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _REQUEST_BUCKETS
        )
        self.num_requests_running = gauge("num_requests_running", "Sequences being computed.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting to run.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Preemptions of running sequences.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache.")
        self._request_success = Counter(
            _PREFIX + "request_success",
            "Finished requests, by finish reason (stop, length, abort, error).",
            names + ["finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Steps x requests that verified speculative tokens."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative tokens accepted."
        )
        self._spec_decode_accepted_per_pos = Counter(
            _PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by position in the proposal (0 = the first).",
            names + ["position"],
            registry=self.registry,
        )
        # Prefill/decode disaggregation (zero without --disaggregation-mode).
        self.kv_transfer_requests = counter(
            "kv_transfer_requests", "Requests whose prompt's KV arrived from a prefill instance."
        )
        self.kv_transfer_failures = counter(
            "kv_transfer_failures", "Requests whose KV pull failed (refused, lost, timed out)."
        )
        self.kv_transfer_blocks = counter("kv_transfer_blocks", "KV blocks received.")
        self.kv_transfer_bytes = counter(
            "kv_transfer_bytes", "KV bytes received (blocks x bytes per block)."
        )
        self.kv_transfer_seconds = counter(
            "kv_transfer_seconds", "Time spent pulling KV, summed over requests."
        )
        self.num_requests_waiting_for_kv = gauge(
            "num_requests_waiting_for_kv", "Requests waiting for their prompt's KV."
        )
        self.num_kv_leases = gauge(
            "num_kv_leases", "Prompts whose KV blocks are held for a decode instance."
        )
        # Multi-LoRA (set only with enable_lora): vLLM's info gauge, one series whose labels name
        # the adapters of running and of waiting requests (comma-joined) and the slots; its
        # value is the time of the update.
        self._lora_info = Gauge(
            _PREFIX + "lora_requests_info",
            "Running stats on LoRA requests.",
            names + ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=self.registry,
        )
        self._lora_requests = Counter(
            _PREFIX + "lora_requests",
            "Requests received, by the adapter they run (base-model requests not counted).",
            names + ["lora_name"],
            registry=self.registry,
        )

        self._requests: dict[str, _RequestState] = {}
        # Engine counters already exported, to add only what each step changed.
        self._seen_preemptions = 0
        self._seen_cache_queries = 0
        self._seen_cache_hits = 0
        self._seen_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self._seen_kv = KVTransferStats()
        self._interval = _IntervalStats()
        self._last_log_time: float | None = None

    # ---- called by the step loop -----------------------------------------------------------
    def record_step(self, engine: LLMEngine, outputs: list[RequestOutput], now: float) -> None:
        """Everything one engine step changed: tokens, latencies, finished requests, gauges."""
        for output in outputs:
            self._record_output(output, now)
        self._record_engine_counters(engine)
        self.update_gauges(engine)

    def record_aborted(self, request_ids: Iterable[str], now: float, reason: str = "abort") -> None:
        """Requests that ended without a final output: aborted (client gone) or failed."""
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            self._request_success.labels(self._model_name, reason).inc()
            if self.log_requests:
                num_tokens = state.num_output_tokens if state else 0
                start = state.arrival_time if state else now
                logger.info(
                    "Request %s ended (%s) after %d output tokens, %.1f ms",
                    request_id,
                    reason,
                    num_tokens,
                    (now - start) * 1e3,
                )

    def record_lora_request(self, lora_name: str) -> None:
        """A request the engine accepted, running adapter `lora_name`."""
        self._lora_requests.labels(self._model_name, lora_name).inc()

    def update_gauges(self, engine: LLMEngine) -> None:
        stats = engine.core_stats()
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.kv_transfer is not None:
            self.num_requests_waiting_for_kv.set(stats.kv_transfer.num_waiting)
            self.num_kv_leases.set(stats.kv_transfer.num_leased)
        if engine.lora_config is not None:
            running, waiting = engine.lora_adapters_in_use()
            self._lora_info.clear()  # one series: the state now
            self._lora_info.labels(
                self._model_name,
                ",".join(running),
                ",".join(waiting),
                str(engine.lora_config.max_loras),
            ).set_to_current_time()

    def log_stats_if_due(self, engine: LLMEngine, now: float) -> None:
        """Logs the engine stats line every `log_stats_interval_s` while there is work."""
        if self.log_stats_interval_s is None:
            return
        if self._last_log_time is None:
            self._last_log_time = now
            return
        elapsed = now - self._last_log_time
        if elapsed <= 0.0 or elapsed < self.log_stats_interval_s:
            return
        stats, self._interval = self._interval, _IntervalStats()
        self._last_log_time = now
        core = engine.core_stats()
        running, waiting = core.num_running, core.num_waiting
        if not (stats.active or running or waiting):
            return
        hit_rate = stats.cache_hits / stats.cache_queries if stats.cache_queries else 0.0
        spec = ""
        if stats.spec_drafts:
            spec = (
                f"; spec decode acceptance rate "
                f"{stats.spec_accepted_tokens / stats.spec_draft_tokens:.1%}, mean accepted "
                f"length {1 + stats.spec_accepted_tokens / stats.spec_drafts:.2f}"
            )
        logger.info(
            "Engine: %d running, %d waiting; KV cache %.1f%% used; prompt %.1f tokens/s, "
            "generation %.1f tokens/s; prefix cache hit rate %.1f%%; %d preemptions%s",
            running,
            waiting,
            core.kv_cache_usage * 100,
            stats.prompt_tokens / elapsed,
            stats.generation_tokens / elapsed,
            hit_rate * 100,
            stats.preemptions,
            spec,
        )

    # ---- details ---------------------------------------------------------------------------
    def _record_output(self, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        state = self._requests.get(output.request_id)
        if state is None:
            arrival = output.metrics["arrival_time"]
            state = _RequestState(arrival, len(output.prompt_token_ids), now, now)
            self._requests[output.request_id] = state
            self.time_to_first_token.observe(now - arrival)
            scheduled = output.metrics.get("first_scheduled_time")
            if scheduled is not None:
                self.request_queue_time.observe(scheduled - arrival)
            self.prompt_tokens.inc(state.num_prompt_tokens)
            self._interval.prompt_tokens += state.num_prompt_tokens
        elif num_tokens > state.num_output_tokens:
            self.inter_token_latency.observe(now - state.last_token_time)
            state.last_token_time = now
        new_tokens = num_tokens - state.num_output_tokens
        state.num_output_tokens = num_tokens
        self.generation_tokens.inc(new_tokens)
        self._interval.generation_tokens += new_tokens
        self._interval.active = True
        if output.finished:
            del self._requests[output.request_id]
            self._record_finished(output, state, now)

    def _record_finished(self, output: RequestOutput, state: _RequestState, now: float) -> None:
        reason = output.outputs[0].finish_reason or "stop"
        self._request_success.labels(self._model_name, reason).inc()
        self.e2e_request_latency.observe(now - state.arrival_time)
        if self.log_requests:
            logger.info(
                "Finished request %s (%s): %d prompt tokens, %d output tokens, "
                "TTFT %.1f ms, total %.1f ms",
                output.request_id,
                reason,
                state.num_prompt_tokens,
                state.num_output_tokens,
                (state.first_token_time - state.arrival_time) * 1e3,
                (now - state.arrival_time) * 1e3,
            )

    def _record_engine_counters(self, engine: LLMEngine) -> None:
        core = engine.core_stats()
        preemptions = core.num_preemptions - self._seen_preemptions
        queries = core.prefix_cache_queries - self._seen_cache_queries
        hits = core.prefix_cache_hits - self._seen_cache_hits
        self._seen_preemptions += preemptions
        self._seen_cache_queries += queries
        self._seen_cache_hits += hits
        self.num_preemptions.inc(preemptions)
        self.prefix_cache_queries.inc(queries)
        self.prefix_cache_hits.inc(hits)
        self._interval.preemptions += preemptions
        self._interval.cache_queries += queries
        self._interval.cache_hits += hits
        spec = engine.spec_decoding_stats
        if spec is not None:
            self._record_spec_decoding(spec)
        if core.kv_transfer is not None:
            self._record_kv_transfer(core.kv_transfer)

    def _record_kv_transfer(self, kv: KVTransferStats) -> None:
        seen = self._seen_kv
        self.kv_transfer_requests.inc(kv.num_pulled - seen.num_pulled)
        self.kv_transfer_failures.inc(kv.num_failed - seen.num_failed)
        self.kv_transfer_blocks.inc(kv.num_blocks - seen.num_blocks)
        self.kv_transfer_bytes.inc(kv.num_bytes - seen.num_bytes)
        self.kv_transfer_seconds.inc(kv.seconds - seen.seconds)
        self._seen_kv = kv

    def _record_spec_decoding(self, spec: SpecDecodingStats) -> None:
        drafts, draft_tokens, accepted, per_pos = self._seen_spec
        self.spec_decode_num_drafts.inc(spec.num_drafts - drafts)
        self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens - draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens - accepted)
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            seen = per_pos[position] if position < len(per_pos) else 0
            self._spec_decode_accepted_per_pos.labels(self._model_name, str(position)).inc(
                count - seen
            )
        self._interval.spec_drafts += spec.num_drafts - drafts
        self._interval.spec_draft_tokens += spec.num_draft_tokens - draft_tokens
        self._interval.spec_accepted_tokens += spec.num_accepted_tokens - accepted
        self._seen_spec = (
            spec.num_drafts,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
            list(spec.num_accepted_tokens_per_pos),
        )


@dataclass
class _IntervalStats:
    """Totals since the last stats line."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    cache_queries: int = 0
    cache_hits: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    active: bool = False

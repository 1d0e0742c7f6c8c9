"""Scheduler: continuous batching under one token budget per step.

Each step, running requests are served first, in arrival order: a decode takes one token of the
budget (a replay, below, several), an unfinished prefill takes the next chunk of its prompt. When
the pool has no block for a running request, the newest running request is preempted (its blocks
are freed, it goes back to the front of the waiting queue and is recomputed later, reusing
whatever prefix stayed cached). Then, if nothing was preempted, waiting requests are admitted in
order with chunked prefill until the token budget or `max_num_seqs` is spent.

Recompute replays: a resumed request computes the rest of its prompt in chunks, as any prompt,
then its generated tokens in chunks of their own (`num_new_tokens`), which the runner runs as one
decode per token, each over the context up to it. Their K/V then come from the decode kernels,
as they did the first time, so its later tokens are the bits it would have had without the
preemption; recomputed as part of a prompt chunk, they would go through the prefill kernels,
which round differently. A replay step holds at most `max_num_seqs` of them (no more decode
sequences than a full decode batch), and a resumed request is only admitted when all its known
tokens fit in the pool: admitted on its prompt alone, its replay would preempt it again.
Each replayed token reads its whole context, as a decode does, where a prompt chunk shares the
reads: the price of the bits, paid only after a preemption.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from quire.engine.kv_manager import KVCacheManager
from quire.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]

    @property
    def is_decode(self) -> bool:
        """Generated tokens to compute: one (a decode), or several when a resumed request
        replays them; each runs as a decode of its own. A prompt chunk, even of one token, is
        not a decode: prompt tokens always go through the prefill kernels, so a prompt's K/V and
        first token do not depend on where chunking or a prefix-cache hit left its last chunk."""
        return self.request.num_computed_tokens >= self.request.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """Whether this step computes the request's last known token, so it samples a new one."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes first, then prefill chunks
    forked: list[tuple[Request, Request]]  # (child, parent): child samples from parent's logits
    block_copies: list[tuple[int, int]]  # (src, dst) copy-on-write block copies, before forward
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def num_new_tokens(request: Request, num_computed: int, budget: int, max_replay: int) -> int:
    """How many of a request's tokens to compute this step, from `num_computed` on, up to the
    budget: a chunk never holds both prompt and generated tokens, and a replay of generated
    tokens is at most `max_replay` of them (see the module docstring)."""
    if num_computed < request.num_prompt_tokens:
        return min(request.num_prompt_tokens - num_computed, budget)
    return min(request.num_tokens - num_computed, budget, max_replay)


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission and removal -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests (abort, stop string) wherever they are; frees their blocks at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self.kv_manager.free(request)
            finished.append(request)
        return finished

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- the step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        forked: list[tuple[Request, Request]] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = num_new_tokens(
                request, request.num_computed_tokens, budget, self.max_num_seqs
            )
            while not self.kv_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new, forked))
                budget -= num_new
                index += 1
                continue
            break

        if not preempted:
            budget = self._admit_waiting(budget, scheduled, forked)

        self.running.extend(child for child, _ in forked)
        scheduled.sort(key=lambda s: not s.is_decode)  # decodes first (stable)
        return SchedulerOutput(scheduled, forked, self.kv_manager.take_copies(), preempted)

    def _admit_waiting(
        self,
        budget: int,
        scheduled: list[ScheduledRequest],
        forked: list[tuple[Request, Request]],
    ) -> int:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            num_seqs = len(self.running) + len(forked) + 1 + request.num_forks_pending
            if num_seqs > self.max_num_seqs:
                break
            hits = self.kv_manager.get_computed_blocks(request)
            num_cached = len(hits) * self.kv_manager.block_size
            num_new = num_new_tokens(request, num_cached, budget, self.max_num_seqs)
            if request.num_output_tokens and not self.kv_manager.can_allocate(
                request, request.num_tokens - num_cached, hits
            ):
                break  # resumed: wait until its replay fits too, or it would preempt itself
            if not self.kv_manager.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new, forked))
            budget -= num_new
        return budget

    def _scheduled(
        self, request: Request, num_new: int, forked: list[tuple[Request, Request]]
    ) -> ScheduledRequest:
        entry = ScheduledRequest(
            request, num_new, self.kv_manager.get_block_ids(request.request_id)
        )
        if entry.samples and request.num_forks_pending:
            for i in range(1, request.num_forks_pending + 1):
                child = request.fork(request.index + i)
                self.kv_manager.fork(request, child)
                self.requests[child.request_id] = child
                forked.append((child, request))
            request.num_forks_pending = 0
        return entry

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances computed-token counts, appends each sampled token and applies the stop rules
        that need no text (EOS, stop ids, max_tokens, max_model_len). Returns the requests that
        got a new token; finished ones are already removed and their blocks freed."""
        for entry in output.scheduled:
            entry.request.num_computed_tokens += entry.num_new_tokens
        for child, parent in output.forked:
            child.num_computed_tokens = parent.num_computed_tokens
        updated = []
        for request_id, token_id in sampled.items():
            request = self.requests[request_id]
            request.append_token(token_id)
            updated.append(request)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.finish_requests([request_id], status)
        return updated

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.all_stop_token_ids:
                request.stop_reason = token_id if token_id in params.stop_token_ids else None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

"""Scheduler: continuous batching under one token budget per step.

Each step, running requests are served first, in arrival order: a decode takes one token of the
budget (plus its speculative tokens, if a proposer gave it some; a replay, below, several), an
unfinished prefill takes the next chunk of its prompt. When the pool has no block for a running
request, the newest running request is preempted (its blocks are freed, it goes back to the front
of the waiting queue and is recomputed later, reusing whatever prefix stayed cached). Then, if
nothing was preempted, waiting requests are admitted in order with chunked prefill until the token
budget or `max_num_seqs` is spent.

What the step computes goes to the worker as plain data (`quire.messages.SchedulerOutput`): a
request the worker does not hold yet in full, one it holds as a delta (new tokens, block-table
changes, computed count). The scheduler remembers what it sent each request (`_SentState`), so a
delta is exact whatever happened in between (copy-on-write, blocks given back).

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

Several steps may be in flight at once (`max_steps_in_flight`, the engine core's batch queue:
pipeline stages each run one): a step is scheduled before the one before it came back, so it
takes only requests with no step in flight (a prompt's next chunk waits for its previous one),
never preempts one, and holds at most its share of the unfinished sequences (the others are left
for the next step, so every stage gets work). `update` takes steps back in the order they were
scheduled.

Async scheduling (vLLM's --async-scheduling; two steps in flight on one stage): a request whose
step in flight samples a plain token (no grammar, no speculation, no fork: `plain_step_tokens`)
is scheduled again before that step returns, one token on the token it samples, which the worker
appends itself (`CachedRequestData.takes_sampled_token`): the engine's scheduling, updates and
outputs then run while the worker computes. Its counts in the message are what the step in
flight will have made of it; its slot is allocated without preempting anyone (no slot: it waits
for its step). The stop rules apply when each step returns, so a stop token found then ends the
request and the token of the step scheduled past it is dropped, its blocks freed at once (the
worker runs steps in order, so nothing reads them after). It is scheduled ahead only when that
token leaves room for another under max_tokens and max_model_len.

`update` takes each request's list of new tokens (several when speculative tokens were verified),
appends them one by one under the stop rules (tokens after a stop are dropped), and gives back the
slots of rejected speculative tokens. A request with a grammar (structured outputs) advances its
matcher with each token it keeps, and stops when the matcher terminates.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from quire.engine.kv_manager import KVCacheManager
from quire.engine.request import Request, RequestStatus
from quire.engine.speculator import Speculator
from quire.kv_transfer.scheduler_connector import (
    KVConnectorScheduler,
    remote_decode,
    remote_prefill,
)
from quire.messages import (
    CachedRequestData,
    ForkedRequestData,
    KVConnectorOutput,
    KVLoadSpec,
    KVSaveSpec,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TopLogprobs,
)
from quire.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class _SentState:
    """What the worker holds of a request: its first `num_tokens` tokens and this block table."""

    num_tokens: int
    block_ids: list[int]


def num_new_tokens(request: Request, num_computed: int, budget: int, max_replay: int) -> int:
    """How many of a request's known tokens to compute this step, from `num_computed` on, up to
    the budget: a chunk never holds both prompt and generated tokens, and a replay of generated
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
        num_lookahead_tokens: int = 0,
        kv_connector: KVConnectorScheduler | None = None,
        speculator: Speculator | None = None,
        structured_output: StructuredOutputManager | None = None,
        max_loras: int = 0,
        max_steps_in_flight: int = 1,
        async_scheduling: bool = False,
    ):
        """`speculator`: the proposals to verify and the draft lengths each step asks;
        `structured_output`: the step's grammar bitmask. The scheduler asks both while it
        writes the step's SchedulerOutput, its only author."""
        self.kv_manager = kv_manager
        self.speculator = speculator
        self.structured_output = structured_output
        # Multi-LoRA: the most distinct adapters among running requests (so in any step).
        self.max_loras = max_loras
        # Prefill/decode disaggregation (kv_transfer/scheduler_connector.py): requests waiting
        # for their prompt's K/V (decode instance), finished requests whose blocks are leased
        # until a decode instance has pulled them, by transfer id (prefill instance).
        self.kv_connector = kv_connector
        self.waiting_for_kv: dict[str, Request] = {}
        self.leased: dict[str, Request] = {}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # Slots reserved past a decode's tokens each step, for the speculative tokens that a
        # proposer may add before the next one (its KV lands there when verified).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.max_steps_in_flight = max_steps_in_flight
        # Async scheduling: a request whose step in flight samples a plain token is scheduled
        # again before that step returns (see the module docstring). Not with a proposer: its
        # proposals need the token.
        self.async_scheduling = async_scheduling and speculator is None and kv_connector is None
        # requests of a step scheduled and not yet updated -> how many such steps (2 at most)
        self.in_flight: dict[str, int] = {}
        self.num_scheduled_ahead = 0  # since start
        self._sent: dict[str, _SentState] = {}
        self._finished_ids: list[str] = []  # dropped since the last step, for the worker
        # The last message's drops (finished, preempted) until `update` confirms its step ran: a
        # step that failed, or was never run (nothing scheduled), sends them again.
        self._unconfirmed_drops: list[str] = []

    # ---- admission and removal -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        params = request.sampling_params.kv_transfer_params
        if params:
            if self.kv_connector is None:
                raise ValueError(
                    "kv_transfer_params need an instance started with --disaggregation-mode "
                    "(or --kv-transfer-config)."
                )
            request.remote_prefill = remote_prefill(params)
            request.remote_decode_id = remote_decode(params)
            sampling = request.sampling_params
            if (request.remote_prefill or request.remote_decode_id) and sampling.prompt_logprobs:
                raise ValueError(
                    "prompt_logprobs do not go through the disaggregated path yet: send such a "
                    "request without kv_transfer_params."
                )
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests (abort, stop string) wherever they are; frees their blocks at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            self.in_flight.pop(request_id, None)  # its steps' tokens are dropped on return
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.waiting_for_kv[request_id]
                self.kv_connector.cancel_load(request_id)
            else:
                self.waiting.remove(request)
            request.status = status
            if request.kv_saved:  # prefill instance: held until the decode instance pulled it
                self.leased[request.remote_decode_id] = request
                self.kv_connector.lease(request.remote_decode_id)
            else:
                self.kv_manager.free(request)
            if self._sent.pop(request_id, None) is not None:
                self._finished_ids.append(request_id)
            finished.append(request)
        return finished

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def pending_drops(self) -> list[str]:
        """Requests the workers may still hold that the next step's message tells them to drop:
        finished since the last step, or dropped by a message whose step did not run."""
        return [*self._unconfirmed_drops, *self._finished_ids]

    # ---- the step ------------------------------------------------------------------------
    @property
    def has_kv_work(self) -> bool:
        """Whether the KV connector needs the worker this step even with nothing to compute."""
        return self.kv_connector is not None and self.kv_connector.has_work

    def schedule(self) -> SchedulerOutput:
        if self.kv_connector is not None:
            for transfer_id in self.kv_connector.expired():
                logger.warning(
                    "KV lease %s ran out before a decode instance pulled it", transfer_id
                )
                self.kv_manager.free(self.leased.pop(transfer_id))
        if self.speculator is not None:
            self._set_spec_tokens()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        forked: list[tuple[Request, Request]] = []  # (child, parent)
        preempted: list[Request] = []
        max_seqs = self._max_seqs_this_step()
        ahead: dict[str, int] = {}  # async: request -> the tokens of its step in flight

        # A plain decode (its next token, no proposals, nothing reserved past it, nothing to
        # fork or save) whose slot fits its blocks takes the short way; the rest are planned
        # in full. Async scheduling marks each step's kind, so it plans every request in full.
        plain_decodes = not (self.num_lookahead_tokens or self.async_scheduling)
        allocate_slots = self.kv_manager.allocate_slots
        running, in_flight = self.running, self.in_flight
        index = num_fast = 0
        while index < len(running) and budget > 0 and len(scheduled) < max_seqs:
            request = running[index]
            if (
                plain_decodes
                and request.num_computed_tokens + 1 == request.num_tokens
                and request.num_computed_tokens >= request.num_prompt_tokens
                and not request.spec_token_ids
                and request.request_id not in in_flight
                and allocate_slots(request, 1)
            ):
                scheduled.append((request, 1))
                budget -= 1
                index += 1
                num_fast += 1
                continue
            if request.request_id in in_flight:
                if self._schedule_ahead(request):
                    ahead[request.request_id] = request.plain_step_tokens
                    request.plain_step_tokens = 1
                    scheduled.append((request, 1))
                    budget -= 1
                index += 1
                continue
            num_new = num_new_tokens(
                request, request.num_computed_tokens, budget, self.max_num_seqs
            )
            if request.spec_token_ids and request.num_prompt_tokens <= request.num_computed_tokens:
                num_new += self._trim_spec_tokens(request, budget - num_new)
            lookahead = self._lookahead(request, request.num_computed_tokens + num_new)
            while not self.kv_manager.allocate_slots(request, num_new, num_lookahead=lookahead):
                victim = self._preemption_victim()
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                self._schedule(request, num_new, scheduled, forked)
                budget -= num_new
                index += 1
                continue
            break

        num_plain = len(scheduled) if index == num_fast else -1  # all of them plain decodes
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, forked, max_seqs)

        self.running.extend(child for child, _ in forked)
        for request, _ in scheduled:
            in_flight[request.request_id] = in_flight.get(request.request_id, 0) + 1
        for child, _ in forked:
            in_flight[child.request_id] = 1
        # Decodes first (stable): the runner lays a step out as decodes, then prompt chunks.
        if num_plain != len(scheduled):  # (a leading run of plain decodes stays where it is)
            start = max(num_plain, 0)
            scheduled[start:] = sorted(
                scheduled[start:],
                key=lambda entry: (
                    entry[0].request_id not in ahead
                    and entry[0].num_computed_tokens < entry[0].num_prompt_tokens
                ),
            )
        self.num_scheduled_ahead += len(ahead)
        return self._message(scheduled, forked, preempted, ahead)

    def _schedule_ahead(self, request: Request) -> bool:
        """Async scheduling: whether `request`, in flight, runs this step too on the token its
        step in flight samples. That step must be its only one in flight and a plain one
        (`plain_step_tokens`), the token must leave room for another under max_tokens and
        max_model_len (only a stop token can end it unseen: that step's token is then dropped
        on return), and its slot must fit without preempting anything."""
        num_ahead = request.plain_step_tokens
        if (
            not self.async_scheduling
            or num_ahead is None
            or self.in_flight[request.request_id] != 1
            or request.num_output_tokens + 2 > request.max_tokens
            or request.num_tokens + 2 > self.max_model_len
        ):
            return False
        return self.kv_manager.allocate_slots(request, num_ahead + 1)

    def _max_seqs_this_step(self) -> int:
        """The most sequences this step takes: with several pipeline steps in flight, an equal
        share of the unfinished ones, so that each step in flight has some (async scheduling
        runs each step over every request instead)."""
        if self.max_steps_in_flight == 1 or self.async_scheduling:
            return self.max_num_seqs
        unfinished = len(self.running) + len(self.waiting)
        return max(1, -(-unfinished // self.max_steps_in_flight))

    def _preemption_victim(self) -> Request:
        """The newest running request with no step in flight (the one being scheduled has
        none, so there is one)."""
        return next(r for r in reversed(self.running) if r.request_id not in self.in_flight)

    def _lookahead(self, request: Request, num_computed_after: int) -> int:
        """Slots to reserve past the step's tokens: for a request that samples this step (its
        tokens all computed after it), room for the speculative tokens proposed next (a draft
        model writes their K/V there), never past max_model_len (so a lone request still fits).
        None for a request that forks this step: nothing proposes for it or its children until
        the next step, and forks must share no block past the partial one, which copy-on-write
        replaces as the table's last (kv_manager.py)."""
        if (
            not self.num_lookahead_tokens
            or num_computed_after < request.num_tokens
            or request.num_forks_pending
        ):
            return 0
        return max(min(self.num_lookahead_tokens, self.max_model_len - num_computed_after), 0)

    def _set_spec_tokens(self) -> None:
        """Gives every running request the speculator's proposals for this step (none: no
        proposals), cut at the first its grammar rejects."""
        proposals = self.speculator.proposals(self.running, self.in_flight)
        for request in self.running:
            if request.request_id in self.in_flight:
                continue  # verifying what its step in flight proposed comes after it
            spec = proposals.get(request.request_id, [])
            if spec and request.grammar is not None:
                del spec[request.grammar.num_valid_tokens(spec) :]
            request.spec_token_ids = spec

    def _trim_spec_tokens(self, request: Request, budget: int) -> int:
        """Cuts the request's speculative tokens to what the budget, max_model_len and its
        max_tokens leave room for; returns how many stay."""
        room = min(
            budget,
            self.max_model_len - request.num_tokens,
            request.max_tokens - request.num_output_tokens - 1,
        )
        del request.spec_token_ids[max(room, 0) :]
        return len(request.spec_token_ids)

    def _admit_waiting(
        self,
        budget: int,
        scheduled: list[tuple[Request, int]],
        forked: list[tuple[Request, Request]],
        max_seqs: int,
    ) -> int:
        adapters = self._running_adapters() if self.max_loras else set()
        while self.waiting and budget > 0 and len(scheduled) + len(forked) < max_seqs:
            request = self.waiting[0]
            lora = request.lora_request
            if lora is not None and lora.lora_name not in adapters:
                if len(adapters) >= self.max_loras:
                    # Its adapter waits for a slot; nothing passes it, so it is next when one
                    # frees (the running adapters' requests finish: none is admitted meanwhile).
                    break
            num_seqs = len(self.running) + len(forked) + 1 + request.num_forks_pending
            # requests waiting for their K/V run as soon as it arrives, their forks with them
            num_seqs += sum(1 + r.num_forks_pending for r in self.waiting_for_kv.values())
            if num_seqs > self.max_num_seqs:
                break
            if request.remote_prefill is not None and not request.num_output_tokens:
                if not self._admit_remote_prefill(request):
                    break
                continue
            hits = self.kv_manager.get_computed_blocks(request)
            num_cached = len(hits) * self.kv_manager.block_size
            num_new = num_new_tokens(request, num_cached, budget, self.max_num_seqs)
            if request.num_output_tokens and not self.kv_manager.can_allocate(
                request, request.num_tokens - num_cached, hits
            ):
                break  # resumed: wait until its replay fits too, or it would preempt itself
            lookahead = self._lookahead(request, num_cached + num_new)
            if not self.kv_manager.allocate_slots(request, num_new, hits, lookahead):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora is not None:
                adapters.add(lora.lora_name)
            self._schedule(request, num_new, scheduled, forked)
            budget -= num_new
        return budget

    def _running_adapters(self) -> set[str]:
        return {r.lora_request.lora_name for r in self.running if r.lora_request is not None}

    def _admit_remote_prefill(self, request: Request) -> bool:
        """Decode instance: allocates blocks for the request's whole prompt (its local
        prefix-cache hits included, not transferred again) and asks for the rest's K/V. The new
        blocks are hashed only once their K/V has arrived. False if the pool is too full."""
        hits = self.kv_manager.get_computed_blocks(request)
        num_cached = len(hits) * self.kv_manager.block_size
        num_new = request.num_prompt_tokens - num_cached
        if not self.kv_manager.allocate_slots(request, num_new, hits, cache=False):
            return False
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_cached_tokens = num_cached
        request.first_scheduled_time = time.monotonic()
        self.waiting_for_kv[request.request_id] = request
        remote = request.remote_prefill
        spec = KVLoadSpec(
            transfer_id=remote.transfer_id,
            host=remote.host,
            port=remote.port,
            block_ids=self.kv_manager.get_block_ids(request.request_id)[len(hits) :],
            skip_blocks=len(hits),
            seed=request.sampling_params.seed,
        )
        self.kv_connector.add_load(request.request_id, spec)
        return True

    def _kv_arrived(
        self, output: KVConnectorOutput, logprobs: dict[str, TopLogprobs]
    ) -> list[tuple[Request, list[int]]]:
        """Requests whose prompt's K/V arrived start decoding: each of their n sequences (forked
        now, sharing the blocks) with the first token the prefill instance sampled for it,
        appended under the stop rules (its logprobs added to `logprobs`). Those whose pull
        failed end with the reason as their stop reason."""
        self.kv_connector.record(output)
        for transfer_id in self.kv_connector.end_leases(output.sent):
            self.kv_manager.free(self.leased.pop(transfer_id))
        updated = []
        for request_id, loaded in output.loaded.items():
            request = self.waiting_for_kv.pop(request_id, None)
            if request is None:  # aborted meanwhile
                continue
            if len(loaded.first_token_ids) != 1 + request.num_forks_pending:
                output.failed[request_id] = (
                    f"the prefill instance sampled {len(loaded.first_token_ids)} first tokens "
                    f"for a request of n = {1 + request.num_forks_pending}"
                )
                self.waiting_for_kv[request_id] = request  # failed below
                continue
            request.num_computed_tokens = request.num_prompt_tokens
            self.kv_manager.cache_blocks(request, request.num_prompt_tokens)
            sequences = [request]
            for i in range(1, request.num_forks_pending + 1):
                child = request.fork(request.index + i)
                self.kv_manager.fork(request, child)
                self.requests[child.request_id] = child
                sequences.append(child)
            request.num_forks_pending = 0
            for sequence, token_id, top in zip(
                sequences, loaded.first_token_ids, loaded.first_logprobs
            ):
                sequence.status = RequestStatus.RUNNING
                self.running.append(sequence)
                if top is not None:
                    logprobs[sequence.request_id] = top
                kept, status = self._append_tokens(sequence, [token_id])
                updated.append((sequence, kept))
                if status is not None:
                    self.finish_requests([sequence.request_id], status)
        for request_id, error in output.failed.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                continue
            request.stop_reason = f"KV transfer failed: {error}"
            self.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
            updated.append((request, []))
        return updated

    def _schedule(
        self,
        request: Request,
        num_new: int,
        scheduled: list[tuple[Request, int]],
        forked: list[tuple[Request, Request]],
    ) -> None:
        """Adds the request to the step; when this step samples its first token, forks the other
        n - 1 sequences of its group (they share its blocks and sample from its logits)."""
        scheduled.append((request, num_new))
        if self.async_scheduling:
            plain = (
                request.num_computed_tokens + num_new == request.num_tokens
                and not request.spec_token_ids
                and not request.num_forks_pending
                and request.grammar is None
                and request.remote_decode_id is None
            )
            request.plain_step_tokens = num_new if plain else None
        if request.remote_decode_id is None and not request.num_forks_pending:
            return  # the usual case: nothing to save for a decode instance, nothing to fork
        samples = request.num_computed_tokens + num_new >= request.num_tokens
        if samples and request.remote_decode_id is not None and not request.kv_saved:
            # Prefill instance: its first token is sampled now; its prompt's blocks are leased.
            num_blocks = self.kv_manager.blocks_needed(request.num_prompt_tokens)
            spec = KVSaveSpec(
                transfer_id=request.remote_decode_id,
                block_ids=self.kv_manager.get_block_ids(request.request_id)[:num_blocks],
                num_prompt_tokens=request.num_prompt_tokens,
                seed=request.sampling_params.seed,
            )
            self.kv_connector.add_save(request.request_id, spec)
            request.kv_saved = True
        if samples and request.num_forks_pending:
            for i in range(1, request.num_forks_pending + 1):
                child = request.fork(request.index + i)
                self.kv_manager.fork(request, child)
                self.requests[child.request_id] = child
                forked.append((child, request))
            request.num_forks_pending = 0

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _message(
        self,
        scheduled: list[tuple[Request, int]],
        forked: list[tuple[Request, Request]],
        preempted: list[Request],
        ahead: dict[str, int],
    ) -> SchedulerOutput:
        """The step as plain data, each request as new or as a delta from what was sent (a
        request scheduled ahead: from what its step in flight will have made of it)."""
        preempted_ids = [r.request_id for r in preempted if self._sent.pop(r.request_id, None)]
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        sent_states, table_end = self._sent, self.kv_manager.table_end
        for request, num_new in scheduled:
            request_id = request.request_id
            num_scheduled[request_id] = num_new
            if request.spec_token_ids:
                spec_tokens[request_id] = list(request.spec_token_ids)
            sent = sent_states.get(request_id)
            if sent is None:
                block_ids = self.kv_manager.get_block_ids(request_id)
                new_reqs.append(
                    NewRequestData(
                        req_id=request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=request.output_token_ids,
                        sampling_params=request.sampling_params,
                        index=request.index,
                        block_ids=block_ids,
                        num_computed_tokens=request.num_computed_tokens,
                        lora_request=request.lora_request,
                    )
                )
                sent_states[request_id] = _SentState(request.num_tokens, block_ids)
                continue
            # Tables only grow or shrink at their end, and copy-on-write replaces their last
            # block, so a table of the same length and last block is unchanged: most decode
            # steps build no list.
            num_blocks, last_block = table_end(request_id)
            sent_blocks = sent.block_ids
            if num_blocks == len(sent_blocks) and (
                num_blocks == 0 or last_block == sent_blocks[-1]
            ):
                start, new_block_ids = num_blocks, []
            else:
                start, new_block_ids = self._block_table_delta(request_id, sent)
            num_ahead = ahead.get(request_id) if ahead else None
            cached_reqs.append(
                CachedRequestData(  # by position: one per request and step
                    request_id,
                    request.token_ids[sent.num_tokens :],  # new_token_ids
                    start,  # block_ids_start
                    new_block_ids,
                    request.num_computed_tokens + (num_ahead or 0),
                    num_ahead is not None,  # takes_sampled_token
                )
            )
            # the worker appends the token it sampled itself
            sent.num_tokens = request.num_tokens + (num_ahead is not None)
        forks = []
        for child, parent in forked:
            parent_sent = self._sent[parent.request_id]
            self._sent[child.request_id] = _SentState(
                parent_sent.num_tokens, list(parent_sent.block_ids)
            )
            forks.append(ForkedRequestData(child.request_id, parent.request_id, child.index))
        finished_ids, self._finished_ids = self.pending_drops, []
        self._unconfirmed_drops = [*finished_ids, *preempted_ids]
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            forked_reqs=forks,
            scheduled_spec_decode_tokens=spec_tokens,
            block_copies=self.kv_manager.take_copies(),
            finished_req_ids=finished_ids,
            preempted_req_ids=preempted_ids,
            kv_connector_metadata=None
            if self.kv_connector is None
            else self.kv_connector.metadata(),
        )
        if self.speculator is not None:
            output.num_draft_tokens = self.speculator.draft_lengths
        if self.structured_output is not None:
            output.grammar_bitmask, output.structured_output_request_ids = (
                self.structured_output.bitmask(output, self.requests)
            )
        return output

    def _block_table_delta(self, request_id: str, sent: _SentState) -> tuple[int, list[int]]:
        """(first changed index, the table from there on) since `sent`, a table that changed;
        updates `sent`."""
        block_ids = self.kv_manager.get_block_ids(request_id)
        start = _first_difference(sent.block_ids, block_ids)
        sent.block_ids = block_ids
        return start, block_ids[start:]

    def update(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Advances computed-token counts, then appends each request's new tokens one by one,
        applying the stop rules that need no text (EOS, stop ids, max_tokens, max_model_len) to
        each: tokens after a stop are dropped. A request that verified speculative tokens keeps
        the KV of the accepted ones and gives back the slots of the rest. Returns each request
        that got tokens with the tokens it kept; finished ones are already removed and freed.
        Requests whose prompt's K/V arrived from a prefill instance get their first token."""
        delivered = {*output.finished_req_ids, *output.preempted_req_ids}
        self._unconfirmed_drops = [d for d in self._unconfirmed_drops if d not in delivered]
        returned = self._step_returned
        requests = self.requests  # less those finished (aborted) while their step was in flight
        for request_id, num_new in output.num_scheduled_tokens.items():
            returned(request_id)
            request = requests.get(request_id)
            if request is not None:
                request.num_computed_tokens += num_new
        for fork in output.forked_reqs:
            returned(fork.req_id)
        updated = []
        if runner_output.kv_connector_output is not None:
            updated = self._kv_arrived(runner_output.kv_connector_output, runner_output.logprobs)
        for fork in output.forked_reqs:
            child = requests.get(fork.req_id)
            if child is not None:  # forked at its parent's count before the step
                child.num_computed_tokens += output.num_scheduled_tokens[fork.parent_req_id]
        for request_id, token_ids in runner_output.sampled_token_ids.items():
            request = requests.get(request_id)
            if request is None:
                continue
            num_spec = len(output.scheduled_spec_decode_tokens.get(request_id, ()))
            if num_spec:
                # Verified 1 + num_spec positions; the last accepted token's KV is computed next.
                request.num_computed_tokens -= num_spec + 1 - len(token_ids)
                request.spec_token_ids = []
            kept, status = self._append_tokens(request, token_ids)
            updated.append((request, kept))
            if status is not None:
                self.finish_requests([request_id], status)
            elif num_spec:
                # The lookahead slots past the new last token stay: a draft model wrote its
                # proposals' K/V there, reused next step if accepted (spec_decode/draft_model.py).
                num_kept = request.num_computed_tokens + self._lookahead(
                    request, request.num_tokens
                )
                self.kv_manager.truncate(request, num_kept)
        return updated

    def _step_returned(self, request_id: str) -> None:
        """One step of the request's fewer in flight."""
        count = self.in_flight.get(request_id, 0)
        if count > 1:
            self.in_flight[request_id] = count - 1
        else:
            self.in_flight.pop(request_id, None)

    def _append_tokens(
        self, request: Request, token_ids: list[int]
    ) -> tuple[list[int], RequestStatus | None]:
        """Appends tokens up to and including the first that stops the request."""
        for i, token_id in enumerate(token_ids):
            request.append_token(token_id)
            status = self._check_stop(request, token_id)
            if request.grammar is not None:
                status = _check_grammar(request, token_id) or status
            if status is not None:
                return token_ids[: i + 1], status
        return token_ids, None

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.remote_decode_id is not None:
            return RequestStatus.FINISHED_LENGTH  # prefill instance: the first token only
        num_tokens = len(request.token_ids)
        num_output_tokens = num_tokens - request.num_prompt_tokens
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.all_stop_token_ids:
                request.stop_reason = token_id if token_id in params.stop_token_ids else None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= request.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _check_grammar(request: Request, token_id: int) -> RequestStatus | None:
    """Advances the request's matcher: it stops when the grammar is complete (its stop token
    accepted). A token the grammar forbids can only come from a row with nothing allowed (a
    grammar that needs EOS while min_tokens bans it): the request stops there, the token taken
    as its stop token (not text), and finishes "stop", one of OpenAI's finish reasons."""
    grammar = request.grammar
    if not grammar.accept_token(token_id):
        logger.warning(
            "Request %s: token %d is not allowed by its grammar (nothing was: min_tokens bans "
            "the end it needs); stopping it.",
            request.request_id,
            token_id,
        )
        return RequestStatus.FINISHED_STOPPED
    if grammar.is_terminated:
        return RequestStatus.FINISHED_STOPPED
    return None


def _first_difference(old: list[int], new: list[int]) -> int:
    """The first index where the two block tables differ (the shorter one's length if none)."""
    n = len(old)
    if len(new) >= n and new[:n] == old:
        return n  # the usual case: unchanged, or blocks appended
    return next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(n, len(new)))

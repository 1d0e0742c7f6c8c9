"""Speculator: the engine core's side of speculative decoding. The proposers run in the worker
(after each step's sampling, worker/protocols.py) and their proposals come back with the step's
output (`ModelRunnerOutput.draft_token_ids`); the speculator says which of them the next step
verifies, and keeps statistics:

- `proposals`: before each schedule, every running decode ready for proposals gets its proposal
  from the last step, or with adaptive speculation ("auto") the prefix of it the cost model
  chooses (adaptive.py; n-gram proposals are made at the most "auto" verifies, and measure
  acceptance whether verified or not). With a draft model and "auto" it also says how many
  tokens the draft proposes after the step for each request (`draft_lengths`, sent as
  `SchedulerOutput.num_draft_tokens`): 0 runs no draft for it.
- `record_step`: after the step, counts what the worker accepted and, with "auto", feeds the
  step's time to the cost model.

A request is a decode ready for proposals when all its known tokens but the last are computed:
a request still in its prompt, or replaying its tokens after a preemption, gets none. With steps
in flight (pipeline stages' micro-batches) a request whose step is in flight is neither: what it
was when that step was scheduled stays until the step comes back, and each step's proposals
replace only its own requests' ones.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from quire.config import SpeculativeConfig
from quire.engine.request import Request
from quire.messages import ModelRunnerOutput, SchedulerOutput
from quire.spec_decode.adaptive import AdaptiveSpeculation


@dataclass
class SpecDecodingStats:
    """Running totals since the engine started (vLLM's spec_decode_* counters)."""

    num_speculative_tokens: int  # the most a request verifies in one step
    num_drafts: int = 0  # (request, step) pairs that verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step gives a request: the accepted proposals plus one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        drafted = config.method == "draft_model"
        self._draft_token_ids: dict[str, list[int]] = {}  # each request's latest proposals
        self.adaptive = (
            AdaptiveSpeculation(config.num_speculative_tokens, drafted=drafted)
            if config.adaptive
            else None
        )
        self.draft_lengths: dict[str, int] | None = None  # this step's, with a draft and "auto"
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        # the decodes that were ready for proposals when their last step was scheduled
        self._ready: set[str] = set()
        self._running: set[str] = set()  # last step's running requests ("auto")

    def proposals(
        self, running: list[Request], in_flight: Container[str] = ()
    ) -> dict[str, list[int]]:
        """The tokens to verify next step, per running decode ready for them (none for a request
        whose step is `in_flight`)."""
        ids = [r.request_id for r in running]
        present = set(ids)
        drafts = self._draft_token_ids
        for req_id in drafts.keys() - present:  # finished or preempted
            del drafts[req_id]
        self._ready &= present
        ready = []
        for r in running:
            if r.request_id in in_flight:
                continue
            if r.num_prompt_tokens <= r.num_computed_tokens == r.num_tokens - 1:
                ready.append(r)
                self._ready.add(r.request_id)
            else:
                self._ready.discard(r.request_id)
        adaptive = self.adaptive
        if adaptive is None:
            return {r.request_id: list(drafts.get(r.request_id, ())) for r in ready}
        adaptive.drop(self._running - present)
        self._running = present
        if adaptive.drafted:
            self.draft_lengths = dict(zip(ids, adaptive.draft_lengths(ids)))
            return {r.request_id: list(drafts.get(r.request_id, ())) for r in ready}
        for r in ready:
            adaptive.observe(r.request_id, r.token_ids)
        proposals = {}
        for r, k in zip(ready, adaptive.choose([r.request_id for r in ready])):
            proposal = drafts.get(r.request_id, [])
            if adaptive.wants_measurement(r.request_id, k):
                adaptive.start_measurement(r.request_id, r.num_tokens, proposal)
            if k:
                proposals[r.request_id] = proposal[:k]
        return proposals

    def record_step(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput, seconds: float
    ) -> None:
        """Counts the step's accepted proposals; a decode-only step's time goes to the
        adaptive cost model. `seconds`: what the step cost the engine (with steps in flight, the
        time since the step before it came back)."""
        drafts = self._draft_token_ids
        for req_id in output.num_scheduled_tokens:
            drafts.pop(req_id, None)  # proposals for positions this step has computed
        drafts.update(runner_output.draft_token_ids)
        stats, spec = self.stats, output.scheduled_spec_decode_tokens
        for req_id, proposal in spec.items():
            sampled = runner_output.sampled_token_ids.get(req_id)
            if sampled is None:
                continue
            num_accepted = len(sampled) - 1
            if self.adaptive is not None and self.adaptive.drafted:
                self.adaptive.record_verified(req_id, num_accepted, len(proposal))
            stats.num_drafts += 1
            stats.num_draft_tokens += len(proposal)
            stats.num_accepted_tokens += num_accepted
            for i in range(num_accepted):
                stats.num_accepted_tokens_per_pos[i] += 1
        # With a draft, a step measures T(N) when each request's draft proposed after it as
        # many tokens as it verified (adaptive.py): the draft's cost for N is in its time.
        lengths = output.num_draft_tokens
        if self.adaptive is not None and all(
            req_id in self._ready
            and n == 1 + len(spec.get(req_id, ()))
            and (lengths is None or lengths.get(req_id, 0) == n - 1)
            for req_id, n in output.num_scheduled_tokens.items()
        ):
            self.adaptive.record_step(output.total_num_scheduled_tokens, seconds)

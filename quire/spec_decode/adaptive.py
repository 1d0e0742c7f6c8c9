"""Adaptive speculation length (`"num_speculative_tokens": "auto"`): each step, how many proposed
tokens each running decode verifies (0 included), chosen to maximize generated tokens per second.

The model is SmartSpec's (Liu et al. 2024, arXiv 2406.14066): a step's goodput is the tokens it
is expected to generate over the time it is expected to take, both measured, nothing assumed.

Acceptance. a_r(i), the probability that request r's proposal is accepted at position i
(i = 1..max_k; a missing or too short proposal counts as rejected there), is counted per request
with decay (recent text counts most: a request may copy a passage, then write something new) and
shrunk towards the engine-wide rate while the request has few measurements. A proposal's accepted
length is read off the request's later tokens: proposals are deterministic and a request gets the
same tokens with or without speculation (the worker accepts a proposal exactly when it equals the
token sampled at its position), so a proposal made but not verified measures acceptance as well
as a verified one. A request keeps one such measurement open at a time; one that verifies nothing
opens one every `max_k` steps only, which keeps the proposer's cost off the steps that gain nothing.

With a draft model the proposals are drawn, not looked up, and a proposal is accepted by
rejection sampling with a probability no later token shows, so acceptance is counted from the
verifications themselves (`record_verified`): a verification of v positions that accepted a
tells the outcome at positions 1..min(a + 1, v), and nothing past them. What is counted per
position is the acceptance given the positions before it were accepted, and a_r(i) is the
product of those up to i; a position not measured yet takes the one before it (the first: 1, so
that a new engine tries). A request at k = 0 runs no draft at all, and now and then proposes one
token to measure again (a probe). A probe costs a two-position verification and the draft's
catch-up over every position it skipped (for a draft as large as the target, a prefill of them),
so probes back off: the first after `_DRAFT_PROBE` steps at k = 0, each next one after twice as
many (up to `_DRAFT_PROBE_MAX`), new requests starting from the longest interval reached, all
back to `_DRAFT_PROBE` once a choice is k > 0. No probe is made while no acceptance could pay:
when even a request whose every proposal is accepted would generate fewer tokens per second
than a plain step, as the measured T says of a draft as costly as the target.

Cost. T(N): the time of a decode-only step computing N tokens. A verified position is computed
exactly as one more decode (its own row through the weights and its own context read; see
worker/model_runner.py), so the batch size B enters only through N = B + sum_r k_r: steps of B
plain decodes measure T(B), steps with proposals measure larger N, and one table serves every
batch size. Measured N are binned (one bin per N up to 8, then four per octave), each bin an
exponential moving average, trusted from its second step on. T between bins is interpolated;
past the largest bin it is extrapolated from the last two, or, while only one bin is trusted,
taken as that bin's time (optimistic, so that a larger N gets tried and measured). Nothing past
twice the largest measured N is chosen, so the table grows outward a step at a time. At large
batch a step is compute-bound, T grows with N as fast as the tokens do, and the choice is k = 0.

With a draft model the step's time also holds the draft's forwards that propose the next
step's tokens (one per proposed position, in the worker after verification), and k_r is the
number of tokens the draft proposes for the next step, which that step verifies: in a steady
state a step of N = B + sum_r k_r measures the target's verification and the draft's k_r
forwards together, so T carries the draft's cost per proposed token.

Choice. Verifying k_r positions of each request r, a step is expected to generate
B + sum_r sum_{i <= k_r} a_r(i) tokens in T(B + sum_r k_r). Positions are added in order of
decreasing a_r(i) (a_r is non-increasing in i, so each request always verifies a prefix of its
proposal), and the number of positions with the best expected tokens per second wins.

Staleness. Only the N a step chooses is measured, so a bin measured in a slow moment of a
shared machine stays slow until chosen again. For the plain step (k = 0 everywhere, N = B), the
baseline every choice is weighed against, that would keep a loss looking like a gain: every
`_BASELINE_REFRESH`-th choice is a plain step, so the baseline tracks the machine as it is. A
stale speculative bin can only keep k lower than it could be: the safe direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

_REQUEST_DECAY = 0.8  # per measured proposal of the request: about the last five count
_ENGINE_DECAY = 0.98  # per measured proposal of any request: about the last fifty count
_PRIOR_WEIGHT = 2.0  # the engine-wide rate counts as this many of a request's measurements
_COST_EMA = 0.25
_TRUSTED_SAMPLES = 2
_BASELINE_REFRESH = 32  # every this many choices, a plain step re-measures T(B)
# Below this acceptance at the first position for every request, nothing is worth verifying: the
# choice is k = 0 without the cost model (a position gains at most this many tokens a step).
_MIN_ACCEPTANCE = 1e-3
# A draft-model request at k = 0 proposes one token after this many steps (its probe); the
# interval doubles with each probe, up to the cap, and falls back when speculation pays again.
_DRAFT_PROBE = 32
_DRAFT_PROBE_MAX = 512


@dataclass
class _Acceptance:
    """Decayed counts of measured proposals and of those accepted at each position."""

    hits: np.ndarray  # [max_k]
    attempts: float = 0.0

    def add(self, accepted_len: int, decay: float) -> None:
        self.hits *= decay
        self.attempts = self.attempts * decay + 1.0
        self.hits[:accepted_len] += 1.0


@dataclass
class _Verified:
    """Decayed counts, per position, of verifications that reached it and that accepted it."""

    hits: np.ndarray  # [max_k]
    attempts: np.ndarray  # [max_k]

    def add(self, accepted_len: int, num_verified: int, decay: float) -> None:
        self.hits *= decay
        self.attempts *= decay
        self.attempts[: min(accepted_len + 1, num_verified)] += 1.0
        self.hits[:accepted_len] += 1.0


@dataclass
class _RequestState:
    acceptance: _Acceptance
    pending: list[int] = field(default_factory=list)  # the open measurement's proposal
    pending_start: int = 0  # the token position its first token proposes
    steps_since_measured: int = 0
    verified: _Verified | None = None  # a draft model's requests
    probe_interval: int = _DRAFT_PROBE  # a draft model's requests: steps at k = 0 to a probe


class StepCostModel:
    """T(N): the measured time of a decode-only step computing N tokens (see the module doc)."""

    def __init__(self) -> None:
        self._bins: dict[int, list[float]] = {}  # bin -> [samples, mean N, mean seconds]

    @staticmethod
    def _bin(num_tokens: int) -> int:
        return num_tokens if num_tokens <= 8 else 8 + round(4 * math.log2(num_tokens / 8))

    def record(self, num_tokens: int, seconds: float) -> None:
        entry = self._bins.get(self._bin(num_tokens))
        if entry is None:
            self._bins[self._bin(num_tokens)] = [1, float(num_tokens), seconds]
            return
        entry[0] += 1
        weight = max(_COST_EMA, 1.0 / entry[0])  # a plain mean until the average settles
        entry[1] += weight * (num_tokens - entry[1])
        entry[2] += weight * (seconds - entry[2])

    def predict(self, num_tokens: np.ndarray) -> np.ndarray:
        """Expected seconds of a step of each of these token counts; inf where none is known
        (nothing measured yet, or past twice the largest measured N)."""
        trusted = sorted((n, t) for count, n, t in self._bins.values() if count >= _TRUSTED_SAMPLES)
        if not trusted:
            return np.full(num_tokens.shape, np.inf)
        xs = np.array([n for n, _ in trusted])
        ys = np.array([t for _, t in trusted])
        seconds = np.interp(num_tokens, xs, ys)
        if len(xs) >= 2:
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            past = num_tokens > xs[-1]
            seconds[past] = ys[-1] + slope * (num_tokens[past] - xs[-1])
        seconds[num_tokens > 2 * xs[-1]] = np.inf
        return seconds


class AdaptiveSpeculation:
    def __init__(self, max_k: int, drafted: bool = False):
        """`drafted`: proposals come from a draft model (acceptance from `record_verified`)."""
        self.max_k = max_k
        self.drafted = drafted
        self.cost = StepCostModel()
        self._engine = _Acceptance(np.zeros(max_k))
        self._engine_verified = _Verified(np.zeros(max_k), np.zeros(max_k))
        self._requests: dict[str, _RequestState] = {}
        self._num_choices = 0
        self._probe_start = _DRAFT_PROBE  # a new draft-model request's probe interval
        self._rates: dict[str, np.ndarray] = {}  # `acceptance`, until a measurement changes it

    # ---- acceptance ------------------------------------------------------------------------
    def observe(self, req_id: str, token_ids: list[int]) -> None:
        """Closes the request's open measurement if its tokens now tell the accepted length."""
        state = self._state(req_id)
        state.steps_since_measured += 1
        if not state.pending:
            return
        start, proposal = state.pending_start, state.pending
        known = token_ids[start : start + len(proposal)]
        accepted = next((i for i, (p, t) in enumerate(zip(proposal, known)) if p != t), len(known))
        if accepted == len(known) < len(proposal):
            return  # every known token matched; the rest is still to come
        self._measured(state, accepted)

    def wants_measurement(self, req_id: str, k: int) -> bool:
        """Whether a proposal made now for this request should open a measurement."""
        state = self._state(req_id)
        return not state.pending and (k > 0 or state.steps_since_measured >= self.max_k)

    def start_measurement(self, req_id: str, num_tokens: int, proposal: list[int]) -> None:
        state = self._state(req_id)
        state.steps_since_measured = 0
        if proposal:
            state.pending, state.pending_start = proposal, num_tokens
        else:
            self._measured(state, 0)  # nothing proposed: rejected at every position

    def record_verified(self, req_id: str, accepted_len: int, num_verified: int) -> None:
        """A draft model's proposal of which the first `num_verified` tokens were verified and
        `accepted_len` accepted."""
        state = self._state(req_id)
        state.steps_since_measured = 0
        state.verified.add(accepted_len, num_verified, _REQUEST_DECAY)
        self._engine_verified.add(accepted_len, num_verified, _ENGINE_DECAY)
        self._rates.clear()

    def draft_lengths(self, req_ids: list[str]) -> list[int]:
        """How many tokens the draft model proposes after this step for each of these requests
        (the next step verifies them): the choice, or one token to measure again (a probe) for
        a request that has been at 0 for its probe interval, if some acceptance could make
        speculation pay at this batch size (`_could_pay`). Each probe doubles the interval (up
        to `_DRAFT_PROBE_MAX`), and new requests start from the longest interval reached; a
        choice of k > 0 puts both back to `_DRAFT_PROBE`."""
        could_pay = self._could_pay(len(req_ids))
        if could_pay:
            lengths = self.choose(req_ids)
        else:  # no acceptance pays: k = 0 for every request, without weighing each one's rates
            self._num_choices += 1
            lengths = [0] * len(req_ids)
        for i, req_id in enumerate(req_ids):
            state = self._state(req_id)
            state.steps_since_measured += 1
            if lengths[i]:
                state.steps_since_measured = 0
                state.probe_interval = self._probe_start = _DRAFT_PROBE
            elif could_pay and state.steps_since_measured >= state.probe_interval:
                lengths[i] = 1
                state.steps_since_measured = 0
                state.probe_interval = min(2 * state.probe_interval, _DRAFT_PROBE_MAX)
                self._probe_start = max(self._probe_start, state.probe_interval)
        return lengths

    def _could_pay(self, num_decodes: int) -> bool:
        """Whether a step verifying some number of proposals (up to max_k a request), all of
        them accepted, would generate more tokens per second than a plain step; True while T(B)
        is not known yet. When no acceptance pays (a draft about as costly as the target), the
        choice is k = 0 whatever is measured, and a probe only costs the draft's catch-up over
        the positions it skipped."""
        counts = np.arange(num_decodes * self.max_k + 1)
        seconds = self.cost.predict(num_decodes + counts)
        if not np.isfinite(seconds[0]):
            return True
        return bool(np.any((num_decodes + counts[1:]) / seconds[1:] > num_decodes / seconds[0]))

    def acceptance(self, req_id: str) -> np.ndarray:
        """a_r(i) for i = 1..max_k: this request's acceptance rate by position (kept until a
        measurement of any request changes the engine-wide rates it is shrunk towards)."""
        rates = self._rates.get(req_id)
        if rates is None:
            rates = self._rates[req_id] = (
                self._verified_acceptance(req_id)
                if self.drafted
                else self._lookup_acceptance(req_id)
            )
        return rates

    def _lookup_acceptance(self, req_id: str) -> np.ndarray:
        """`acceptance` from the proposals' measured accepted lengths (module doc)."""
        engine = self._engine
        prior = engine.hits / engine.attempts if engine.attempts else np.zeros(self.max_k)
        own = self._state(req_id).acceptance
        return (own.hits + _PRIOR_WEIGHT * prior) / (own.attempts + _PRIOR_WEIGHT)

    def _verified_acceptance(self, req_id: str) -> np.ndarray:
        """`acceptance` from verifications: the product of the conditional rates (module doc)."""
        engine, own = self._engine_verified, self._state(req_id).verified
        m = int(np.count_nonzero(engine.attempts))  # positions measured: a prefix of them
        rates = np.ones(self.max_k)
        prior = engine.hits[:m] / engine.attempts[:m]
        rates[:m] = (own.hits[:m] + _PRIOR_WEIGHT * prior) / (own.attempts[:m] + _PRIOR_WEIGHT)
        if m:
            rates[m:] = rates[m - 1]
        return np.cumprod(rates)

    def _first_acceptance(self, req_id: str) -> float:
        """a_r(1), the largest of the request's rates (they do not grow with the position):
        `acceptance` for the first position alone, in plain floats."""
        if self.drafted:
            return float(self.acceptance(req_id)[0])
        engine, own = self._engine, self._state(req_id).acceptance
        prior = engine.hits[0] / engine.attempts if engine.attempts else 0.0
        return (own.hits[0] + _PRIOR_WEIGHT * prior) / (own.attempts + _PRIOR_WEIGHT)

    def _measured(self, state: _RequestState, accepted_len: int) -> None:
        state.pending = []
        state.acceptance.add(accepted_len, _REQUEST_DECAY)
        self._engine.add(accepted_len, _ENGINE_DECAY)
        self._rates.clear()

    def _state(self, req_id: str) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _RequestState(_Acceptance(np.zeros(self.max_k)))
            if self.drafted:
                state.verified = _Verified(np.zeros(self.max_k), np.zeros(self.max_k))
                state.probe_interval = self._probe_start
        return state

    def drop(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)
            self._rates.pop(req_id, None)

    # ---- the choice ------------------------------------------------------------------------
    def choose(self, req_ids: list[str]) -> list[int]:
        """How many proposed tokens each of these decodes (the step's) should verify."""
        num_decodes = len(req_ids)
        self._num_choices += 1
        # A draft's length is verified a step later: two plain choices make one plain step.
        refresh = self._num_choices % _BASELINE_REFRESH < (2 if self.drafted else 1)
        if not num_decodes or refresh:
            return [0] * num_decodes
        if max(self._first_acceptance(r) for r in req_ids) < _MIN_ACCEPTANCE:
            return [0] * num_decodes  # nothing is accepted: skip the numpy below (~0.1 ms)
        accept = np.stack([self.acceptance(r) for r in req_ids])  # [num_decodes, max_k]
        order = np.argsort(-accept, axis=None, kind="stable")  # each row's positions in order
        gains = accept.ravel()[order]
        num_positive = int(np.count_nonzero(gains > 0))
        counts = np.arange(num_positive + 1)  # positions verified
        expected = num_decodes + np.concatenate(([0.0], np.cumsum(gains[:num_positive])))
        goodput = expected / self.cost.predict(num_decodes + counts)  # 0 where T is unknown
        best = int(np.argmax(goodput))  # the first best: fewer positions on a tie
        chosen = np.bincount(order[:best] // self.max_k, minlength=num_decodes)
        return chosen.tolist()

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """The measured time of a decode-only step of `num_tokens` tokens."""
        self.cost.record(num_tokens, seconds)

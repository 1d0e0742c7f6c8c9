"""The `cost_model` policy: nanoPD's per-request choice between a collocated instance and the
disaggregated path (a prefill instance, then a decode instance), from measured parameters.

The parameters (`CostProfile`, written by `quire bench pd-profile`) describe one instance:

  prefill    P(n) = prefill.base_s + alpha * n           a lone prompt of n tokens, to its first token
  decode     D(b, c) = beta0 + beta_seq * max(0, b - b*) + beta_ctx * b * c
             one decode step of b sequences of mean context c; below b* (the batch where decode
             turns compute-bound) adding a sequence costs only its attention
  gamma      seconds a prefill token adds to the decode steps it shares an instance with
  transfer   T(n) = transfer.base_s + n * kv_bytes_per_token / bytes_per_s
             the hand-off of an n-token prompt's KV to a decode instance (second hop, pull, write)

and the loads come from the router's own ledger of what it sent where and has not seen answered:
per instance the prompt tokens still to prefill (Q), the sequences decoding (b, mean context c)
and the rate of prompt tokens arriving to be prefilled there (lambda, tokens/s over the last
`rate_window_s`). For a request of L prompt tokens and O expected output tokens:

  collocated      TTFT = P(Q + L) + ceil((Q + L) / chunk) * (D(b, c) - beta0)
                  ITL  = D(b + 1, c') / (1 - min(0.9, gamma * lambda))
  disaggregated   TTFT = P(Qp + L) + ceil((Qp + L) / chunk) * (D(bp, cp) - beta0) + T(L)
                         + (D(bd, cd) - beta0)
                  ITL  = D(bd + 1, cd') / (1 - min(0.9, gamma * lambda_d))

(c' is the mean context with the new request at L + O/2; bp is 0 on a prefill-only instance,
not on one started kv_both). The objective, minimized over every collocated instance and every
(prefill, decode) pair of two instances, is the request's predicted end-to-end latency plus the
delay it adds to the requests already decoding where it goes:

  cost = TTFT + (O - 1) * ITL + gamma * L * b_prefilling + (O - 1) * b_decoding * (D(b+1) - D(b))

(b_prefilling: the decodes on the instance that computes the prompt, b_decoding: on the one
that decodes it.)

so a long prompt is kept off an instance with many running decodes (its prefill would stall all
of them), while a short prompt on idle instances stays collocated (no transfer, one hop).

O comes from `OutputLengthPredictor`: the mean output of recent requests of similar prompt length
(buckets by powers of two), else of all recent requests, else the request's max_tokens, capped
at max_tokens. Text prompts are counted in tokens with the characters per token the answers'
usage reports have shown (4 until one has).
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quire.router.policies import Instance, Policy

PROFILE_FORMAT = "quire-pd-profile/1"
DEFAULT_OUTPUT_TOKENS = 128  # expected output when nothing was observed and no max_tokens given
DEFAULT_CHARS_PER_TOKEN = 4.0


class CostProfileError(ValueError):
    """The cost profile is missing, unreadable or incomplete."""


@dataclass(frozen=True)
class CostProfile:
    prefill_base_s: float
    alpha_s_per_token: float
    chunk_tokens: int  # prefill tokens per step (the instances' max_num_batched_tokens)
    decode_base_s: float  # beta0
    decode_per_seq_s: float  # beta_seq, above the compute-bound batch
    decode_per_context_token_s: float  # beta_ctx
    compute_bound_batch: float  # b*
    gamma_s_per_prefill_token: float
    transfer_base_s: float
    transfer_bytes_per_s: float
    kv_bytes_per_token: float

    _FIELDS = {  # JSON section -> {key: (attribute, lowest allowed value)}
        "prefill": {
            "base_s": ("prefill_base_s", 0.0),
            "alpha_s_per_token": ("alpha_s_per_token", 1e-12),
            "chunk_tokens": ("chunk_tokens", 1),
        },
        "decode": {
            "base_s": ("decode_base_s", 1e-12),
            "per_seq_s": ("decode_per_seq_s", 0.0),
            "per_context_token_s": ("decode_per_context_token_s", 0.0),
            "compute_bound_batch": ("compute_bound_batch", 0.0),
        },
        "interference": {"gamma_s_per_prefill_token": ("gamma_s_per_prefill_token", 0.0)},
        "transfer": {
            "base_s": ("transfer_base_s", 0.0),
            "bytes_per_s": ("transfer_bytes_per_s", 1e-12),
            "kv_bytes_per_token": ("kv_bytes_per_token", 1e-12),
        },
    }

    @classmethod
    def from_dict(cls, data: Any, source: str = "the cost profile") -> CostProfile:
        """The profile in `data` (the JSON `quire bench pd-profile` writes); CostProfileError
        naming the first missing or bad field."""
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise CostProfileError(
                f"{source} is not a {PROFILE_FORMAT} file: write one with `quire bench "
                "pd-profile --prefill URL --decode URL --output profile.json`."
            )
        values: dict[str, Any] = {}
        for section, keys in cls._FIELDS.items():
            for key, (attribute, lowest) in keys.items():
                value = (data.get(section) or {}).get(key)
                integral = isinstance(lowest, int)
                kind = (int,) if integral else (int, float)
                if (
                    isinstance(value, bool)
                    or not isinstance(value, kind)
                    or not math.isfinite(value)
                    or value < lowest
                ):
                    bound = f">= {lowest}" if lowest <= 0 or integral else "> 0"
                    raise CostProfileError(
                        f"{source}: {section}.{key} must be a finite number {bound}; got "
                        f"{value!r}. Measure the instances again with `quire bench pd-profile`."
                    )
                values[attribute] = value
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        own = asdict(self)
        out: dict[str, Any] = {"format": PROFILE_FORMAT}
        for section, keys in self._FIELDS.items():
            out[section] = {key: own[attribute] for key, (attribute, _) in keys.items()}
        return out


def load_profile(path: str | Path) -> CostProfile:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as error:
        raise CostProfileError(
            f"The cost profile {path} does not exist: measure the instances with `quire bench "
            "pd-profile --prefill URL --decode URL --output PATH`."
        ) from error
    except (OSError, ValueError) as error:
        raise CostProfileError(f"Cannot read the cost profile {path}: {error}") from error
    return CostProfile.from_dict(data, f"The cost profile {path}")


# ---- predictions -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """What an instance is busy with, as the router's ledger sees it."""

    queued_prefill_tokens: int = 0  # Q
    num_decoding: int = 0  # b
    mean_context: float = 0.0  # c
    prefill_token_rate: float = 0.0  # lambda, tokens/s


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    itl_s: float
    imposed_s: float  # delay added to the requests already decoding there

    def cost(self, output_tokens: float) -> float:
        return self.ttft_s + max(output_tokens - 1, 0) * self.itl_s + self.imposed_s


class CostModel:
    """The formulas of the module docstring over one profile; pure functions of their inputs."""

    def __init__(self, profile: CostProfile):
        self.profile = profile

    def prefill_time(self, tokens: float) -> float:
        p = self.profile
        return p.prefill_base_s + p.alpha_s_per_token * tokens

    def step_time(self, batch: float, context: float) -> float:
        p = self.profile
        return (
            p.decode_base_s
            + p.decode_per_seq_s * max(0.0, batch - p.compute_bound_batch)
            + p.decode_per_context_token_s * batch * context
        )

    def transfer_time(self, tokens: float) -> float:
        p = self.profile
        return p.transfer_base_s + tokens * p.kv_bytes_per_token / p.transfer_bytes_per_s

    def _decode_itl(self, load: Load, context: float) -> tuple[float, float]:
        """(ITL of a new sequence of `context` joining `load`, added step time for the others)."""
        b, c = load.num_decoding, load.mean_context
        joined = (b * c + context) / (b + 1)
        slowdown = 1.0 - min(0.9, self.profile.gamma_s_per_prefill_token * load.prefill_token_rate)
        added = self.step_time(b + 1, joined) - self.step_time(b, c) if b else 0.0
        return self.step_time(b + 1, joined) / slowdown, added

    def _prefill(self, load: Load, prompt_tokens: int) -> tuple[float, float]:
        """(seconds until a prompt is computed on an instance of `load`, after the prompts queued
        there and beside its decodes; the stall that adds to those decodes)."""
        queued = load.queued_prefill_tokens + prompt_tokens
        steps = math.ceil(queued / self.profile.chunk_tokens)
        seconds = self.prefill_time(queued) + steps * self._decode_work(load)
        return seconds, load.num_decoding * self.profile.gamma_s_per_prefill_token * prompt_tokens

    def _decode_work(self, load: Load) -> float:
        """What the decodes running on an instance add to each of its steps."""
        return self.step_time(load.num_decoding, load.mean_context) - self.profile.decode_base_s

    def collocated(self, load: Load, prompt_tokens: int, output_tokens: float) -> Prediction:
        ttft, stall = self._prefill(load, prompt_tokens)
        itl, added = self._decode_itl(load, prompt_tokens + output_tokens / 2)
        imposed = stall + load.num_decoding * max(output_tokens - 1, 0) * added
        return Prediction(ttft, itl, imposed)

    def disaggregated(
        self, prefill: Load, decode: Load, prompt_tokens: int, output_tokens: float
    ) -> Prediction:
        """The prefill instance may decode too (kv_both): its decodes are stalled the same."""
        prefilled, stall = self._prefill(prefill, prompt_tokens)
        ttft = prefilled + self.transfer_time(prompt_tokens) + self._decode_work(decode)
        itl, added = self._decode_itl(decode, prompt_tokens + output_tokens / 2)
        imposed = stall + decode.num_decoding * max(output_tokens - 1, 0) * added
        return Prediction(ttft, itl, imposed)


# ---- what the router learns from answers -------------------------------------------------------
class OutputLengthPredictor:
    """Expected output tokens from recent requests, bucketed by prompt length (powers of two)."""

    def __init__(self, window: int = 64, min_samples: int = 4):
        self.min_samples = min_samples
        self.buckets: dict[int, deque[int]] = defaultdict(lambda: deque(maxlen=window))
        self.recent: deque[int] = deque(maxlen=window)

    @staticmethod
    def bucket(prompt_tokens: int) -> int:
        return max(prompt_tokens, 1).bit_length()

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        self.buckets[self.bucket(prompt_tokens)].append(output_tokens)
        self.recent.append(output_tokens)

    def predict(self, prompt_tokens: int, max_tokens: int | None) -> float:
        same = self.buckets.get(self.bucket(prompt_tokens))
        if same is not None and len(same) >= self.min_samples:
            expected = sum(same) / len(same)
        elif self.recent:
            expected = sum(self.recent) / len(self.recent)
        else:
            expected = max_tokens or DEFAULT_OUTPUT_TOKENS
        return float(min(expected, max_tokens) if max_tokens else expected)


class StreamTally:
    """Reads a relayed SSE stream as it passes: when its first text came, how many text events
    it had, and the usage report if the stream carried one. A stream coalesces tokens into
    fewer events when its reader falls behind, so the router asks the instance for the usage
    report (`stream_options.include_usage`) and, with `strip_usage`, keeps that report, which
    the client did not ask for, out of what it relays."""

    def __init__(self, strip_usage: bool = False) -> None:
        self.first_at: float | None = None
        self.end_at: float | None = None
        self.text_events = 0
        self.usage: dict[str, int] | None = None
        self.strip_usage = strip_usage
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """Tallies the chunk's complete events; returns what to relay: the chunk as it came, or
        with `strip_usage` its complete events less the usage report (a part event waits for
        its end)."""
        events = (self._pending + chunk).split(b"\n\n")
        self._pending = events.pop()
        relayed = []
        for event in events:
            if event.startswith(b"data: {"):
                if b'"prompt_tokens"' in event:
                    report = json.loads(event[6:])
                    self.usage = report.get("usage") or self.usage
                    if self.strip_usage and not report.get("choices"):
                        continue
                if _has_text(event):
                    self.text_events += 1
                    if self.first_at is None:
                        self.first_at = time.monotonic()
            relayed.append(event + b"\n\n")
        self.end_at = time.monotonic()
        return b"".join(relayed) if self.strip_usage else chunk

    def output_tokens(self) -> int:
        return self.usage["completion_tokens"] if self.usage else self.text_events


def _has_text(event: bytes) -> bool:
    """Whether an SSE event of a completion or chat stream carries non-empty text."""
    return any(
        f'"{key}":"'.encode() in event and f'"{key}":""'.encode() not in event
        for key in ("text", "content")
    )


# ---- the router's side: ledger, choice, accounting ---------------------------------------------
@dataclass
class Flight:
    """A request the router sent to an instance and has not seen answered."""

    body: dict  # held so that its id stays this request's while in the ledger
    work: str  # what the instance does for it: "prefill", "decode" or "both"
    prompt_tokens: int
    output_tokens: float  # expected
    sent_at: float = 0.0
    first_token_at: float = 0.0  # predicted
    prompt_chars: int | None = None  # a text prompt's characters (None: token ids)
    path: str = "collocated"
    predicted: Prediction | None = None
    tally: StreamTally | None = None  # the relayed stream, once it started

    def prefilling(self, now: float) -> bool:
        """Whether its prompt is (still) to be computed on this instance: a prefill-only one
        until answered, a collocated one until its stream's first text (or, not streamed, its
        predicted first token)."""
        if self.work != "both":
            return self.work == "prefill"
        if self.tally is not None:
            return self.tally.first_at is None
        return now < self.first_token_at


@dataclass
class _Accuracy:
    """Predicted against observed TTFT and ITL, summed over the requests of one path."""

    requests: int = 0
    predicted_ttft_s: float = 0.0
    observed_ttft_s: float = 0.0
    itl_requests: int = 0
    predicted_itl_s: float = 0.0
    observed_itl_s: float = 0.0


@dataclass
class CostModelRouting:
    """The cost model's state in one router: the ledger of requests in flight per instance, the
    output-length predictor, the characters per token seen, and prediction accuracy."""

    model: CostModel
    rate_window_s: float = 10.0
    flights: dict[str, dict[int, Flight]] = field(default_factory=lambda: defaultdict(dict))
    arrivals: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    outputs: OutputLengthPredictor = field(default_factory=OutputLengthPredictor)
    prompt_chars: int = 0
    prompt_tokens: int = 0
    planned_decode: dict[int, Any] = field(default_factory=dict)  # id(body) -> decode Instance
    accuracy: dict[str, _Accuracy] = field(default_factory=lambda: defaultdict(_Accuracy))
    choices: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    # ---- request shape ----
    def prompt_length(self, body: dict, text: str) -> int:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        per_token = (
            self.prompt_chars / self.prompt_tokens
            if self.prompt_tokens
            else DEFAULT_CHARS_PER_TOKEN
        )
        return max(1, round(len(text) / per_token))

    @staticmethod
    def max_tokens(body: dict) -> int | None:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is None and "messages" not in body:
            return 16  # the completions API's default
        return limit if isinstance(limit, int) and limit > 0 else None

    # ---- loads ----
    def load(self, url: str, now: float) -> Load:
        queued, contexts = 0, []
        for flight in self.flights[url].values():
            if flight.prefilling(now):
                queued += flight.prompt_tokens
            elif flight.work != "prefill":
                contexts.append(flight.prompt_tokens + flight.output_tokens / 2)
        arrivals = self.arrivals[url]
        while arrivals and arrivals[0][0] < now - self.rate_window_s:
            arrivals.popleft()
        rate = sum(tokens for _, tokens in arrivals) / self.rate_window_s
        mean = sum(contexts) / len(contexts) if contexts else 0.0
        return Load(queued, len(contexts), mean, rate)

    # ---- the choice ----
    def choose_first(self, candidates: list, decodes: list, body: dict, text: str):
        """The collocated or prefill instance for `body` (a prefill one meaning disaggregated,
        with the decode instance remembered for `choose_decode`)."""
        now = time.monotonic()
        length = self.prompt_length(body, text)
        expected = self.outputs.predict(length, self.max_tokens(body))
        loads = {i.url: self.load(i.url, now) for i in candidates + decodes}
        options = []
        for instance in candidates:
            if instance.role == "prefill":
                for decode in decodes:
                    if decode.url == instance.url:  # an instance of both roles: collocated
                        continue
                    prediction = self.model.disaggregated(
                        loads[instance.url], loads[decode.url], length, expected
                    )
                    options.append((prediction.cost(expected), instance, decode, prediction))
            else:
                prediction = self.model.collocated(loads[instance.url], length, expected)
                options.append((prediction.cost(expected), instance, None, prediction))
        if not options:  # prefill instances but no decode instance alive: any candidate
            return candidates[0]
        _, first, decode, prediction = min(options, key=lambda option: option[0])
        ttft_at = now + prediction.ttft_s
        prompt = body.get("prompt")
        chars = None if isinstance(prompt, list) else len(text)

        def record(instance, work: str, path: str, predicted: Prediction | None) -> None:
            self.flights[instance.url][id(body)] = Flight(
                body, work, length, expected, now, ttft_at, chars, path, predicted
            )
            if work != "decode":  # its prompt is computed there
                self.arrivals[instance.url].append((now, length))

        if decode is None:
            path = "collocated" if first.role == "collocated" else "decode_only"
            record(first, "both", path, prediction)
        else:
            path = "disaggregated"
            record(first, "prefill", path, None)
            record(decode, "decode", path, prediction)
            self.planned_decode[id(body)] = decode
        self.choices[path] += 1
        return first

    def choose_decode(self, decodes: list, body: dict):
        planned = self.planned_decode.pop(id(body), None)
        if planned in decodes:
            return planned
        now = time.monotonic()
        return min(decodes, key=lambda i: self.load(i.url, now).num_decoding)

    # ---- answers ----
    def relaying(self, instance, body: dict, tally: StreamTally) -> None:
        """The answer of `instance` to `body` streams through `tally` from now on."""
        flight = self.flights[instance.url].get(id(body))
        if flight is not None:
            flight.tally = tally

    def done(self, instance, body: dict, tally: StreamTally | None, usage: dict | None) -> None:
        """`instance` answered `body` (or failed): it leaves the ledger; its observed lengths
        and latencies feed the predictor and the accuracy report."""
        self.planned_decode.pop(id(body), None)
        flight = self.flights[instance.url].pop(id(body), None)
        usage = usage or (tally.usage if tally else None)
        if flight is None or flight.work == "prefill":
            return
        prompt_tokens = flight.prompt_tokens
        if usage and usage.get("prompt_tokens"):
            prompt_tokens = usage["prompt_tokens"]
            if flight.prompt_chars is not None:
                self.prompt_chars += flight.prompt_chars
                self.prompt_tokens += prompt_tokens
        output = usage["completion_tokens"] if usage else tally.output_tokens() if tally else 0
        if output:
            self.outputs.observe(prompt_tokens, output)
        if tally is None or tally.first_at is None or flight.predicted is None:
            return
        accuracy = self.accuracy[flight.path]
        accuracy.requests += 1
        accuracy.predicted_ttft_s += flight.predicted.ttft_s
        accuracy.observed_ttft_s += tally.first_at - flight.sent_at
        if output and output > 1 and tally.end_at is not None:
            accuracy.itl_requests += 1
            accuracy.predicted_itl_s += flight.predicted.itl_s
            accuracy.observed_itl_s += (tally.end_at - tally.first_at) / (output - 1)

    def report(self) -> dict[str, Any]:
        """Requests per path and, per path, mean predicted and observed TTFT and ITL (seconds)."""
        paths = {}
        for path, a in self.accuracy.items():
            paths[path] = {
                "requests": a.requests,
                "mean_predicted_ttft_s": a.predicted_ttft_s / a.requests,
                "mean_observed_ttft_s": a.observed_ttft_s / a.requests,
                "mean_predicted_itl_s": a.predicted_itl_s / max(a.itl_requests, 1),
                "mean_observed_itl_s": a.observed_itl_s / max(a.itl_requests, 1),
            }
        return {"choices": dict(self.choices), "accuracy": paths}


class CostModelPolicy(Policy):
    """The router's first choice (collocated or prefill instance) or second (decode instance),
    both made by one shared `CostModelRouting`."""

    def __init__(self, routing: CostModelRouting, instances: list[Instance], stage: str):
        self.routing = routing
        self.instances = instances
        self.stage = stage

    def choose(self, instances: list[Instance], text: str, body: dict | None = None) -> Instance:
        body = {} if body is None else body
        if self.stage == "decode":
            return self.routing.choose_decode(instances, body)
        decodes = [i for i in self.instances if i.role == "decode" and i.healthy]
        return self.routing.choose_first(instances, decodes, body, text)

    def relaying(self, instance: Instance, body: dict, tally: StreamTally) -> None:
        self.routing.relaying(instance, body, tally)

    def done(
        self,
        instance: Instance,
        body: dict,
        tally: StreamTally | None = None,
        usage: dict | None = None,
    ) -> None:
        self.routing.done(instance, body, tally, usage)

    def describe(self) -> dict[str, Any]:
        return self.routing.report()


def cost_model_policies(
    profile: CostProfile, instances: list[Instance]
) -> tuple[CostModelPolicy, CostModelPolicy]:
    """The router's (first, second) policies for --policy cost_model."""
    routing = CostModelRouting(CostModel(profile))
    return (
        CostModelPolicy(routing, instances, "first"),
        CostModelPolicy(routing, instances, "decode"),
    )

"""The plain data that crosses engine -> executor -> worker each step, and back.

Neutral ground: the engine builds these and the worker reads them, and neither side imports the
other. Everything here is a dataclass of ints, strings, lists and `SamplingParams`, so a step can
be pickled to a worker process (or a TP rank) as it is.

The worker keeps its own copy of each running request (worker/input_batch.py), built from
`NewRequestData` when the request is first scheduled (or resumed after a preemption) and moved
forward by `CachedRequestData` deltas. Token by token it knows whether a token is a prompt token
(position < len(prompt_token_ids)) or a generated one: the preemption replay and bf16 batch
invariance depend on it (prompt tokens go through the prefill kernels, generated ones through the
decode kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from quire.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker does not hold yet: admitted for the first time, or resumed after a
    preemption (then `output_token_ids` holds what it generated before)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    index: int  # which of its group's n completions: part of its sampling noise's key
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits: their K/V is already in the blocks


@dataclass
class CachedRequestData:
    """What changed for a request the worker holds since it was last scheduled."""

    req_id: str
    new_token_ids: list[int]  # accepted since (sampled by the last step, after the stop rules)
    # The block table from index `block_ids_start` on is `new_block_ids` (blocks appended, a
    # block replaced by copy-on-write, or blocks given back): table[start:] = new_block_ids.
    block_ids_start: int
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class ForkedRequestData:
    """A new sequence of an n > 1 request: a copy of its parent once this step's inputs are
    applied, sharing its blocks, sampling its first token from the parent's logits row."""

    req_id: str
    parent_req_id: str
    index: int


@dataclass
class KVConnectorMetadata:
    """A step's KV transfers, for a connector that moves K/V between engine instances
    (prefill/decode disaggregation): built by the connector's engine side, carried out by its
    worker side through `KVCache.read_blocks` / `write_blocks` around the forward."""

    # req id -> the request's block ids to fill from elsewhere before the forward
    load: dict[str, list[int]] = field(default_factory=dict)
    # req id -> block ids whose K/V is final after this step and goes elsewhere
    save: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # Tokens to compute per request, in the step's layout order: decodes first, then prompt
    # chunks. A decode with speculative tokens computes 1 + len(spec) of them.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    forked_reqs: list[ForkedRequestData] = field(default_factory=list)
    # Proposed tokens per request, verified after its last known token (speculative decoding).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), CoW
    # Requests the worker must drop before this step: finished since the last step, or
    # preempted (a preempted request comes back later as NewRequestData).
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Structured outputs: one row of allowed tokens per sampled position of the requests in
    # `structured_output_request_ids` (req id -> its first row; a request verifying k speculative
    # tokens has k + 1 consecutive rows). Packed bits, 32 tokens per int32, as xgrammar writes.
    grammar_bitmask: np.ndarray | None = None  # [num_rows, ceil(vocab / 32)] int32
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # None unless a KV connector is configured (no connector ships yet).
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class TopLogprobs:
    """Per position: column 0 the chosen token, then the top-k alternatives."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the chosen token, 1 = most likely


@dataclass
class ModelRunnerOutput:
    # Per request that sampled: its new tokens in order (one for a decode; up to 1 + k for a
    # request verifying k speculative tokens: the accepted proposals, then one more).
    sampled_token_ids: dict[str, list[int]]
    # For requests that asked for logprobs (raw distribution), one row per sampled token.
    logprobs: dict[str, TopLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, TopLogprobs] = field(default_factory=dict)  # this step's chunk
    # A draft model's proposals for the next step, per request that sampled (speculative
    # decoding); the engine core hands them to the scheduler as the request's spec tokens.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

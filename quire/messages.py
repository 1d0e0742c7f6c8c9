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

from quire.lora_request import LoRARequest
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
    lora_request: LoRARequest | None = None  # the adapter it runs (its name versioned)


@dataclass(slots=True)
class CachedRequestData:
    """What changed for a request the worker holds since it was last scheduled."""

    req_id: str
    new_token_ids: list[int]  # accepted since (sampled by the last step, after the stop rules)
    # The block table from index `block_ids_start` on is `new_block_ids` (blocks appended, a
    # block replaced by copy-on-write, or blocks given back): table[start:] = new_block_ids.
    block_ids_start: int
    new_block_ids: list[int]
    num_computed_tokens: int
    # Async scheduling: the step was scheduled before the one before it came back, so this
    # request's next token is the one the worker sampled for it in that step (first appended,
    # then computed), which the engine does not know yet.
    takes_sampled_token: bool = False


@dataclass
class ForkedRequestData:
    """A new sequence of an n > 1 request: a copy of its parent once this step's inputs are
    applied, sharing its blocks, sampling its first token from the parent's logits row."""

    req_id: str
    parent_req_id: str
    index: int


@dataclass
class KVLoadSpec:
    """Fill a request's blocks with K/V computed by a prefill instance (disaggregation)."""

    transfer_id: str  # the prefill instance's name for the request's leased blocks
    host: str  # the prefill instance's KV endpoint
    port: int
    block_ids: list[int]  # where the received blocks go: the request's blocks past its local hits
    skip_blocks: int  # leading blocks found in this instance's prefix cache, not transferred
    seed: int | None  # the request's seed here: the prefill instance's must be the same


@dataclass
class KVSaveSpec:
    """Lease a request's prompt blocks once this step has computed them (and sampled its first
    token), until a decode instance has pulled them or the lease runs out."""

    transfer_id: str
    block_ids: list[int]
    num_prompt_tokens: int
    seed: int | None  # what decoding needs besides the blocks travels with them


@dataclass
class KVConnectorMetadata:
    """A step's KV transfers, for a connector that moves K/V between engine instances
    (prefill/decode disaggregation): built by the connector's scheduler side
    (kv_transfer/scheduler_connector.py), carried out by its worker side
    (kv_transfer/worker_connector.py) through `KVCache.read_blocks` / `write_blocks`."""

    load: dict[str, KVLoadSpec] = field(default_factory=dict)  # req id -> blocks to pull
    save: dict[str, KVSaveSpec] = field(default_factory=dict)  # req id -> blocks to lease
    # Loads to drop before anything is written (the request was aborted: its blocks may
    # already belong to another request).
    cancel_loads: list[str] = field(default_factory=list)
    # Leases given up (expired): stop serving them before their blocks are reused.
    release: list[str] = field(default_factory=list)  # transfer ids


@dataclass
class KVLoaded:
    """A finished pull: the request's K/V is in its blocks, and the first token of each of its
    n sequences came with it (index order), with its logprobs when the request asked."""

    first_token_ids: list[int]
    first_logprobs: list[TopLogprobs | None]
    num_blocks: int
    num_bytes: int
    seconds: float


@dataclass
class KVConnectorOutput:
    """What the connector's worker side finished since the last step."""

    loaded: dict[str, KVLoaded] = field(default_factory=dict)  # req id -> result
    failed: dict[str, str] = field(default_factory=dict)  # req id -> why its pull failed
    sent: list[str] = field(default_factory=list)  # transfer ids pulled and acknowledged


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
    # A draft model under adaptive speculation: how many tokens to propose after this step per
    # request (0: the draft does not run for it). None: every request that samples proposes k.
    num_draft_tokens: dict[str, int] | None = None
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
    # None unless a KV connector is configured (--disaggregation-mode).
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
    kv_connector_output: KVConnectorOutput | None = None  # with a KV connector

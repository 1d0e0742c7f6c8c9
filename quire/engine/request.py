"""Request: one sequence being generated, with its tokens, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from quire.lora_request import LoRARequest
from quire.outputs import PositionLogprobs
from quire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from quire.kv_transfer.scheduler_connector import RemotePrefill
    from quire.structured_output.manager import RequestGrammar


class RequestStatus(enum.Enum):
    # in this order: the statuses from FINISHED_STOPPED on are the finished ones
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # blocks allocated, its prompt's K/V being pulled
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed (its K/V never arrived): stop_reason says why

    @property
    def is_finished(self) -> bool:
        return self._value_ >= _FIRST_FINISHED  # a plain attribute: hashing a member is slow

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED.value  # the finished statuses come last
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """One sequence. A prompt with `n > 1` starts as one request that is forked into `n` once its
    prompt is computed; the forks share its KV blocks (see KVCacheManager.fork)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what fits in max_model_len
    group_id: str = ""  # the id of the caller's request; forks share it
    index: int = 0  # which of the group's n completions this is
    arrival_time: float = field(default_factory=time.monotonic)
    # The adapter it runs (multi-LoRA): its name carries the load's version ("sql@2"), so a
    # reload is another adapter to the workers and the prefix cache.
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling; -1 until then
        self.num_forks_pending = self.sampling_params.n - 1
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[PositionLogprobs] | None = (
            [] if self.sampling_params.logprobs is not None else None
        )
        # Proposed tokens to verify after the last known one (speculative decoding); never part
        # of token_ids until accepted.
        self.spec_token_ids: list[int] = []
        # Async scheduling: the tokens of its newest scheduled step when that step samples one
        # token that only the stop rules read (no grammar, no speculation, no fork), so a step
        # after it may be scheduled before it returns; None otherwise.
        self.plain_step_tokens: int | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Structured outputs: the matcher of its grammar, advanced with each accepted token
        # (set by the engine core when it takes the request).
        self.grammar: RequestGrammar | None = None
        # Prefill/decode disaggregation (set by the scheduler from its kv_transfer_params):
        # where its prompt's K/V comes from (decode instance), or the transfer id its blocks
        # are leased under once its first token is sampled (prefill instance).
        self.remote_prefill: RemotePrefill | None = None
        self.remote_decode_id: str | None = None
        self.kv_saved = False  # its blocks are promised to a lease (prefill instance)
        # The root of its prefix-cache hashes: the same tokens under another adapter (or another
        # load of one) share no block.
        lora = self.lora_request
        self.prefix_key: int | None = (
            None
            if lora is None
            else xxhash.xxh3_64_intdigest(f"{lora.lora_name}\0{lora.lora_path}".encode())
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, index: int) -> Request:
        """A copy at the same progress that will generate the group's completion `index`."""
        child = Request(
            request_id=f"{self.group_id}#{index}",
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            max_tokens=self.max_tokens,
            group_id=self.group_id,
            index=index,
            arrival_time=self.arrival_time,
            lora_request=self.lora_request,
        )
        child.token_ids = list(self.token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_forks_pending = 0
        child.first_scheduled_time = self.first_scheduled_time
        if self.grammar is not None:
            child.grammar = self.grammar.fork()
        return child

"""RequestOutput / CompletionOutput: what callers get back, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the chosen token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless the request asked for logprobs (as vLLM)
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine (`LLM.stats()`): its KV pool and queues now, its counters since
    it started, and the fast paths its worker runs (rank 0's, under tensor parallelism)."""

    num_kv_blocks: int
    num_free_kv_blocks: int
    num_running: int
    num_waiting: int
    num_steps: int  # steps that computed tokens
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    # Speculative decoding (0 when it is off): (request, step) pairs that verified proposals,
    # tokens proposed, tokens accepted.
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    c_decode_step: bool  # decode steps run the fused C step
    cuda_graphs: bool  # decode steps replay CUDA graphs
    gemv_path: str  # the bf16 matmul kernel's loop ("amx", "avx512-bf16", ... or "off")
    qmatmul_path: str  # the GGUF block kernel's loop ("avx512-vnni", "avx2", "c" or "off")
    weight_bytes: tuple[int, ...]  # the model weights each rank holds, in rank order
    most_steps_in_flight: int  # the most steps in flight at once since start (batch queue)
    # async scheduling: (request, step) pairs scheduled before the step before them came back
    num_scheduled_ahead: int = 0

"""What the worker calls on the plug-ins it is handed: a proposer of speculative tokens and a KV
connector. Their implementations live above the worker (spec_decode/, kv_transfer/) and are built
by the executor (executor/plugins.py), so the worker imports none of them.

Step order: the runner applies the step's deltas and block copies (the proposer's cache copies
the same blocks), asks the connector to land pulled K/V (`before_forward`), runs the forward and
samples, hands the sampled tokens to the connector (`after_forward`), and last asks the proposer
for the next step's proposals (`propose`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from quire.messages import (
    ForkedRequestData,
    KVConnectorMetadata,
    KVConnectorOutput,
    TopLogprobs,
)
from quire.sample.step_sampler import Draft
from quire.worker.input_batch import RequestState
from quire.worker.kv_cache import KVCache
from quire.worker.step_inputs import Step, StepInputs


@dataclass
class SampledStep:
    """A step after sampling, as a proposer sees it."""

    step: Step  # the step's requests and tokens computed, in order
    inputs: StepInputs
    sampled: dict[str, list[int]]  # per request that sampled: its accepted tokens
    requests: Mapping[str, RequestState]  # every request the worker holds
    block_table: np.ndarray  # [rows, width] int32, the InputBatch's
    num_blocks: np.ndarray  # [rows] int32: each row's allocated blocks
    forking: set[str]  # the step's forks and their parents
    # Per request, how many tokens to propose after this step (0: none); None: the most each.
    num_draft_tokens: dict[str, int] | None


class Proposer(Protocol):
    """Proposes speculative tokens for the next step of each request that sampled."""

    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes one KV block of its own cache takes (0: it keeps no cache); its cache is
        indexed by the target's block ids, so the pool is sized for both."""
        ...

    def allocate_kv(
        self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, huge_pages: bool
    ) -> None: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forgets finished and preempted requests."""
        ...

    @property
    def req_ids(self) -> set[str]:
        """The requests it keeps state for (none once every request has been dropped)."""
        ...

    def propose(self, sampled: SampledStep) -> dict[str, list[int]]:
        """The proposals for the next step, per request that sampled."""
        ...

    @property
    def drafts(self) -> Mapping[str, Draft]:
        """The last proposals of requests whose q the rejection sampler needs (a draft
        model's sampling requests); empty for a proposer of point masses."""
        ...


class KVConnector(Protocol):
    """Moves K/V between engine instances (prefill/decode disaggregation)."""

    def register_kv_cache(self, kv_cache: KVCache, model: torch.nn.Module) -> None:
        """The cache it reads and writes, once allocated, and the model that fills it."""
        ...

    def before_forward(self, metadata: KVConnectorMetadata | None) -> KVConnectorOutput: ...

    def after_forward(
        self,
        metadata: KVConnectorMetadata | None,
        sampled: dict[str, list[int]],
        logprobs: dict[str, TopLogprobs],
        forked: list[ForkedRequestData],
    ) -> None: ...

    def close(self) -> None: ...

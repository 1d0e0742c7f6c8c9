"""InputBatch: the worker's own copy of every running request, moved forward by each step's
SchedulerOutput deltas (quire/messages.py), never read from engine objects.

A request holds a row of the block table, kept from step to step: a decode step reads its rows
instead of rebuilding a table from lists. Rows of removed requests are reused; a row's entries
past its `num_blocks` are stale but always valid block ids (kernels read only the first
ceil(seq_len / block_size) of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from quire.lora_request import LoRARequest
from quire.messages import CachedRequestData, NewRequestData, SchedulerOutput
from quire.sampling_params import SamplingParams

# Block-table widths are kept a multiple of this, so a decode step's table (as wide as its
# longest context, rounded up to it) is always a slice of the stored one.
TABLE_WIDTH_STEP = 16


@dataclass
class RequestState:
    req_id: str
    row: int  # of InputBatch.block_table
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt, then generated tokens: what the scheduler sent
    sampling_params: SamplingParams
    index: int  # which of its group's completions: part of its sampling noise's key
    num_computed_tokens: int
    # Whether this request's prompt logprobs are returned from this worker: asked for, not a
    # fork (its parent returns them), not resumed after its prompt was done.
    returns_prompt_logprobs: bool
    spec_token_ids: list[int] = field(default_factory=list)  # this step's proposals
    lora_request: LoRARequest | None = None  # the adapter it runs
    argmax_only: bool = False  # sampling_params.argmax_only (the params never change here)
    # The last token this worker sampled for it: async scheduling sends a step that computes it
    # before the engine has seen it (CachedRequestData.takes_sampled_token).
    last_sampled: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_decode(self) -> bool:
        """Whether this step computes generated tokens (a decode, a replay after preemption or
        a verification of speculative tokens) rather than prompt tokens."""
        return self.num_computed_tokens >= len(self.prompt_token_ids)

    def input_token_ids(self, num_new: int) -> list[int]:
        """The tokens this step computes: known tokens from num_computed_tokens on, then the
        speculative ones."""
        start = self.num_computed_tokens
        ids = self.token_ids[start : start + num_new]
        if len(ids) < num_new:
            ids += self.spec_token_ids[: num_new - len(ids)]
        return ids


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int):
        width = -(-max(max_blocks_per_req, 1) // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP
        self.block_table = np.zeros((max(max_num_reqs, 1), width), np.int32)
        self.num_blocks = np.zeros(max(max_num_reqs, 1), np.int32)
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(self.block_table.shape[0] - 1, -1, -1))

    def update(self, output: SchedulerOutput) -> list[tuple[RequestState, int]]:
        """Applies a step's deltas; returns the step's (request, tokens to compute) in layout
        order."""
        for req_id in (*output.finished_req_ids, *output.preempted_req_ids):
            self._remove(req_id)
        for new in output.scheduled_new_reqs:
            self._add(new)
        for cached in output.scheduled_cached_reqs:
            self._apply(cached)
        for fork in output.forked_reqs:
            self._fork(fork.req_id, fork.parent_req_id, fork.index)
        spec = output.scheduled_spec_decode_tokens
        requests = self.requests
        step = []
        for req_id, num_new in output.num_scheduled_tokens.items():
            state = requests[req_id]
            state.spec_token_ids = spec.get(req_id, [])
            step.append((state, num_new))
        return step

    def record_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """Keeps each request's last sampled token, for a step scheduled before this one's
        output reached the engine (async scheduling)."""
        requests = self.requests
        for req_id, token_ids in sampled_token_ids.items():
            state = requests.get(req_id)
            if state is not None and token_ids:
                state.last_sampled = token_ids[-1]

    def block_ids(self, state: RequestState) -> list[int]:
        return self.block_table[state.row, : self.num_blocks[state.row]].tolist()

    def _take_row(self) -> int:
        if not self._free_rows:  # more requests than max_num_seqs (never expected): grow
            old = self.block_table.shape[0]
            self.block_table = np.pad(self.block_table, ((0, old), (0, 0)))
            self.num_blocks = np.pad(self.num_blocks, (0, old))
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _set_blocks(self, row: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            width = -(-end // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP
            self.block_table = np.pad(self.block_table, ((0, 0), (0, width - end)))
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _add(self, new: NewRequestData) -> None:
        row = self._take_row()
        self._set_blocks(row, 0, new.block_ids)
        params = new.sampling_params
        self.requests[new.req_id] = RequestState(
            req_id=new.req_id,
            row=row,
            prompt_token_ids=new.prompt_token_ids,
            token_ids=[*new.prompt_token_ids, *new.output_token_ids],
            sampling_params=params,
            index=new.index,
            num_computed_tokens=new.num_computed_tokens,
            returns_prompt_logprobs=params.prompt_logprobs is not None and not new.output_token_ids,
            lora_request=new.lora_request,
            argmax_only=params.argmax_only,
        )

    def _apply(self, cached: CachedRequestData) -> None:
        state = self.requests[cached.req_id]
        state.token_ids.extend(cached.new_token_ids)
        if cached.takes_sampled_token:
            state.token_ids.append(state.last_sampled)
        state.num_computed_tokens = cached.num_computed_tokens
        if cached.new_block_ids or cached.block_ids_start != self.num_blocks[state.row]:
            self._set_blocks(state.row, cached.block_ids_start, cached.new_block_ids)
        if state.num_computed_tokens >= state.num_prompt_tokens:
            state.returns_prompt_logprobs = False

    def _fork(self, req_id: str, parent_id: str, index: int) -> None:
        parent = self.requests[parent_id]
        row = self._take_row()
        num_blocks = self.num_blocks[parent.row]
        self._set_blocks(row, 0, self.block_table[parent.row, :num_blocks].tolist())
        self.requests[req_id] = RequestState(
            req_id=req_id,
            row=row,
            prompt_token_ids=parent.prompt_token_ids,
            token_ids=list(parent.token_ids),
            sampling_params=parent.sampling_params,
            index=index,
            num_computed_tokens=parent.num_computed_tokens,
            returns_prompt_logprobs=False,
            lora_request=parent.lora_request,
            argmax_only=parent.argmax_only,
        )

    def _remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.num_blocks[state.row] = 0
            self._free_rows.append(state.row)

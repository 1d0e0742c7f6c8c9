"""The draft-model proposer (`"method": "draft_model"`): a smaller model of the target's
vocabulary proposes k tokens per running request, sampled from its own processed distribution q,
which the worker keeps until the target verifies them (sample/rejection_sampler.py).

It lives in the worker beside the target and owns the draft's weights and KV cache. The draft's
KV tensors are indexed by the same block ids as the target's: a block holds the same tokens at
the same positions in both caches, so the scheduler's block tables, slot mapping, prefix-cache
hits, copy-on-write and the rollback of rejected slots serve both, with no allocator of its own.
Each step:

1. `catch_up` runs the draft over the step's own inputs (prompt chunks, decodes, the verified
   positions), writing its K/V where the target writes its own. The draft's KV of a position is
   therefore final exactly when the target's is; what it wrote past that (rejected proposals,
   step 2's scratch) is overwritten before anything reads it, as the target's is.
2. `propose`, for each request that sampled, decodes k tokens one position at a time from its
   last token, into the lookahead slots the scheduler reserves past a sampling request's tokens
   (never past its allocated blocks or max_model_len). Each proposal is drawn from q with the
   request's sampling parameters (penalties see the proposals before it, min_tokens bans stop
   tokens) and noise keyed (seed, index, position, STREAM_DRAFT): a seeded request gets the same
   proposals in any batch. A greedy request proposes the draft's argmax and keeps no q.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from quire.attention.backend import AttentionBackend, AttentionMetadata
from quire.attention.forward_context import forward_context
from quire.config import EngineConfig
from quire.model.loader import load_model, load_model_config
from quire.model.model_config import ModelConfig
from quire.sample.sampler import (
    STREAM_DRAFT,
    SamplingBatch,
    banned_token_ids,
    exponential_race,
    greedy,
    noise_seed,
    sampling_probs,
)
from quire.sampling_params import SamplingParams
from quire.worker import kv_cache
from quire.worker.cpu_step import CpuStepRunner

logger = logging.getLogger(__name__)


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The target's engine config with the draft model in place of the target."""
    return dataclasses.replace(config, model=config.speculative_config.model, tokenizer=None)


@dataclasses.dataclass
class Draft:
    """One request's proposals and, for a sampling request, q at each of them."""

    token_ids: list[int]
    probs: torch.Tensor | None  # [len(token_ids), V] float32; None for greedy requests


@dataclasses.dataclass
class _Proposing:
    """A request being proposed for: its tokens so far (known, then proposals)."""

    req_id: str
    row: int  # of the block table
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    index: int
    num_slots: int  # proposals it has room for
    probs: list[torch.Tensor]


class DraftModelProposer:
    def __init__(self, config: EngineConfig, dtype: torch.dtype, max_model_len: int):
        draft_config = draft_engine_config(config)
        self.model_config: ModelConfig = load_model_config(draft_config)
        self.k = config.speculative_config.num_speculative_tokens
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        # Proposals reach k positions past the last token the target may verify.
        self.model = load_model(draft_config, self.model_config, dtype, max_model_len + self.k)
        self.kv_cache: kv_cache.KVCache | None = None
        self.cpu_step: CpuStepRunner | None = None
        self.drafts: dict[str, Draft] = {}

    def allocate(self, num_blocks: int, kv_dtype: torch.dtype, huge_pages: bool) -> None:
        """The draft's KV cache, as many blocks as the target's (the same block ids), in the
        target's KV dtype (quantized with it: the pool is sized for both alike)."""
        cfg = self.model_config
        self.kv_cache = kv_cache.KVCache.allocate(
            cfg.num_hidden_layers,
            num_blocks,
            self.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            kv_dtype,
            self.device,
            huge_pages,
        )
        self.cpu_step = CpuStepRunner.for_model(self.model, self.kv_cache)

    def drop(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.drafts.pop(req_id, None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if self.cpu_step is not None and self.cpu_step.takes(metadata, input_ids.shape[0]):
            return self.cpu_step.forward(input_ids, positions, metadata)
        with forward_context(metadata, self.kv_cache.layers, backend):
            return self.model(input_ids, positions)

    def catch_up(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> None:
        """The draft's K/V of the step's tokens, in the target's slots (see the module doc)."""
        self.forward(input_ids, positions, metadata, backend)

    def propose(
        self,
        requests: list[_Proposing],
        block_table: np.ndarray,  # [rows, width] int32, the InputBatch's
        backend: AttentionBackend,
    ) -> dict[str, list[int]]:
        """Up to k proposals for each request (fewer where its slots run out); keeps q."""
        for j in range(self.k):
            active = [r for r in requests if r.num_slots > j]
            if not active:
                break
            positions = np.array([len(r.token_ids) - 1 for r in active], np.int64)
            rows = np.array([r.row for r in active], np.int64)
            metadata = self._decode_metadata(block_table[rows], positions)
            ids = torch.tensor([r.token_ids[-1] for r in active], device=self.device)
            pos = torch.from_numpy(positions).to(self.device)
            for r, token_id in zip(active, self._sample(active, ids, pos, metadata, backend)):
                r.token_ids.append(token_id)
        proposals = {}
        for r in requests:
            num = min(r.num_slots, self.k)
            proposal = r.token_ids[len(r.token_ids) - num :] if num else []
            probs = torch.stack(r.probs) if r.probs else None
            self.drafts[r.req_id] = Draft(proposal, probs)
            proposals[r.req_id] = proposal
        return proposals

    def _sample(
        self,
        active: list[_Proposing],
        ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> list[int]:
        """Each request's next proposal from the draft's processed distribution."""
        banned = [banned_token_ids(r.params, len(r.token_ids) - r.prompt_len) for r in active]
        argmax_only = all(r.params.argmax_only for r in active) and not any(banned)
        if argmax_only and self.cpu_step is not None:
            if self.cpu_step.takes_argmax(metadata, len(active)):
                return self.cpu_step.argmax_tokens(ids, positions, metadata)
        logits = self.model.compute_logits(self.forward(ids, positions, metadata, backend))
        if argmax_only:
            return greedy(logits).tolist()
        batch = SamplingBatch.from_params(
            [r.params for r in active],
            [r.token_ids[r.prompt_len :] if r.params.uses_penalties else [] for r in active],
            [r.token_ids[: r.prompt_len] for r in active],
            [_noise_key(r) for r in active],
            banned,
            self.device,
        )
        probs = sampling_probs(logits, batch)  # [R, V], one-hot rows for greedy requests
        token_ids = exponential_race(probs, batch.noise_seeds).tolist()
        for i, r in enumerate(active):
            if not r.params.is_greedy:
                r.probs.append(probs[i])
        return token_ids

    def _decode_metadata(
        self,
        block_tables: np.ndarray,  # [R, width]
        positions: np.ndarray,  # [R]
    ) -> AttentionMetadata:
        """One decode token per request at `positions`."""
        n, block_size, dev = len(positions), self.block_size, self.device
        slots = block_tables[np.arange(n), positions // block_size] * block_size
        slots = slots.astype(np.int64) + positions % block_size
        seq_lens = (positions + 1).astype(np.int32)
        width = int(-(-seq_lens.max() // block_size))
        query_start_loc = list(range(n + 1))
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables[:, :width])).to(dev),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens.tolist(),
            num_decodes=n,
            num_decode_tokens=n,
        )

    def proposing(
        self,
        req_id: str,
        row: int,
        num_blocks: int,
        prompt_token_ids: list[int],
        token_ids: list[int],
        params: SamplingParams,
        index: int,
    ) -> _Proposing:
        """A request to propose for after its tokens `token_ids` (prompt, outputs, this step's
        new ones), with `num_blocks` blocks allocated."""
        last = len(token_ids) - 1
        room = min(num_blocks * self.block_size - last, self.max_model_len - 1 - last)
        return _Proposing(
            req_id=req_id,
            row=row,
            prompt_len=len(prompt_token_ids),
            token_ids=list(token_ids),
            params=params,
            index=index,
            num_slots=max(min(room, self.k), 0),
            probs=[],
        )


def _noise_key(r: _Proposing) -> int | None:
    seed = r.params.seed
    return None if seed is None else noise_seed(seed, r.index, len(r.token_ids), STREAM_DRAFT)

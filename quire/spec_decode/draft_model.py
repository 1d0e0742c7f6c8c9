"""The draft-model proposer (`"method": "draft_model"`): a smaller model of the target's
vocabulary proposes k tokens per running request, sampled from its own processed distribution q,
which the worker keeps until the target verifies them (sample/rejection_sampler.py).

It runs in the worker after each step's sampling (worker/protocols.py's Proposer, built by the
executor) and owns the draft's ModelForward: its weights, KV cache and fast path, the same class
that runs the target (worker/model_forward.py). The draft's KV tensors are indexed by the same block ids as the target's: a block holds the same tokens at
the same positions in both caches, so the scheduler's block tables, slot mapping, prefix-cache
hits, copy-on-write and the rollback of rejected slots serve both, with no allocator of its own.
Each step:

1. Catch-up: the draft's K/V of the step's tokens that are now final (prompt chunks, decodes,
   the accepted positions), in the target's slots. The draft's KV of a position is therefore
   final exactly when the target's is; what it wrote past that (rejected proposals, step 2's
   scratch) is overwritten before anything reads it, as the target's is. In a step of decodes
   only, a position the draft's own proposing wrote last step, with the same token into the same
   slot, is already final and is skipped (`_catch_up`): with every proposal accepted
   that leaves one position a request (the last proposal), with a rejection none. The rest ride
   along in the first forward of step 2, so a step costs the draft k forwards, not k + 1. A step
   with prompt chunks runs the draft over all the step's inputs first.
2. Proposing (`_propose`), for each request that sampled, decodes k tokens one position at a time from its
   last token, into the lookahead slots the scheduler reserves past a sampling request's tokens
   (never past its allocated blocks or max_model_len). Each proposal is drawn from q with the
   request's sampling parameters (penalties see the proposals before it, min_tokens bans stop
   tokens) and noise keyed (seed, index, position, STREAM_DRAFT): a seeded request gets the same
   proposals in any batch. A greedy request proposes the draft's argmax and keeps no q.

A slot the proposals wrote is trusted only in the very next step, and only if the request's
block table still maps that position to the same block: a lookahead block the scheduler gave
back and handed out again (to this request or another) fails the check, and its positions are
computed again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from quire.attention.backend import AttentionMetadata
from quire.config import QuireConfig
from quire.model.model_config import ModelConfig, load_model_config
from quire.sample.sampler import (
    STREAM_DRAFT,
    SamplingBatch,
    banned_token_ids,
    categorical,
    greedy,
    noise_seed,
    sampling_probs,
)
from quire.sample.step_sampler import Draft
from quire.sampling_params import SamplingParams
from quire.worker.model_forward import ModelForward, make_backend
from quire.worker.protocols import SampledStep
from quire.worker.step_inputs import decode_metadata

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Written:
    """What one request's proposing wrote into the draft's cache: a token at each position from
    `start` on, each into its slot."""

    start: int
    token_ids: list[int]
    slots: list[int]


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
    """Implements worker/protocols.py's Proposer with a draft model: a ModelForward of its
    own, over a KV cache indexed by the target's block ids."""

    def __init__(self, config: QuireConfig):
        target, spec = config.model, config.speculative
        draft = dataclasses.replace(target, model=spec.model, tokenizer=None)
        self.model_config: ModelConfig = load_model_config(draft)
        self.k = spec.num_speculative_tokens
        self.device = torch.device(config.device.device)
        self.block_size = config.cache.block_size
        self.max_model_len = target.max_model_len
        # Proposals reach k positions past the last token the target may verify.
        self.draft = ModelForward.load(
            dataclasses.replace(draft, architecture=self.model_config),
            self.max_model_len + self.k,
            make_backend(config.device.attention_backend),
            config.cache.huge_pages,
        )
        self._drafts: dict[str, Draft] = {}
        self._written: dict[str, _Written] = {}  # by the last step's proposing
        self._valid: dict[str, int] = {}  # per request: positions whose draft K/V is final

    # ---- the Proposer protocol ---------------------------------------------------------------
    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return self.draft.kv_block_bytes(block_size, kv_dtype)

    def allocate_kv(
        self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, huge_pages: bool
    ) -> None:
        """The draft's KV cache, as many blocks as the target's (the same block ids), in the
        target's KV dtype (quantized with it: the pool is sized for both alike)."""
        self.draft.allocate_kv(num_blocks, block_size, kv_dtype, huge_pages)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.draft.copy_blocks(copies)

    @property
    def drafts(self) -> Mapping[str, Draft]:
        return self._drafts

    @property
    def req_ids(self) -> set[str]:
        return {*self._drafts, *self._written, *self._valid}

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._drafts.pop(req_id, None)
            self._written.pop(req_id, None)
            self._valid.pop(req_id, None)

    def propose(self, sampled: SampledStep) -> dict[str, list[int]]:
        """The draft catches up on the step's final tokens, then proposes for every request that
        sampled this step, after its new tokens; none for a fork or its parent this step (they
        share a partial block the proposals would write into)."""
        inputs, num_draft = sampled.inputs, sampled.num_draft_tokens
        computed = not inputs.decode_only  # prompt chunks: all rows at once
        if not computed and num_draft is not None and not any(num_draft.values()):
            # "auto" chose k = 0 for every request: no draft row to compute or keep up.
            return self._propose_nothing(sampled.sampled, sampled.forking)
        with torch.inference_mode():  # entered only when the draft computes: ~20 us each way
            if computed:  # the draft over all the step's inputs, in the target's slots
                self.draft.forward(inputs.input_ids, inputs.positions, inputs.metadata)
            ids = inputs.input_ids.tolist()
            entries = []
            for (s, n), first in zip(sampled.step, inputs.first_rows):
                tokens = sampled.sampled.get(s.req_id)
                num_final = n  # less the rejected proposals, past the accepted ones
                if tokens is not None:
                    num_final -= len(s.spec_token_ids) + 1 - len(tokens)
                final = ids[first : first + num_final]
                entries.append((s.req_id, s.row, s.num_computed_tokens, s.token_ids, final))
            keep_up = None if num_draft is None else {r for r, k in num_draft.items() if k}
            pending = self._catch_up(entries, sampled.block_table, keep_up, computed)
            proposing = []
            for req_id, token_ids in sampled.sampled.items():
                if req_id in sampled.forking:
                    self._drafts.pop(req_id, None)
                    continue
                s = sampled.requests[req_id]
                proposing.append(
                    self._proposing(
                        req_id,
                        s.row,
                        int(sampled.num_blocks[s.row]),
                        s.prompt_token_ids,
                        s.token_ids + token_ids,
                        s.sampling_params,
                        s.index,
                        self.k if num_draft is None else num_draft.get(req_id, 0),
                    )
                )
            return self._propose(proposing, pending, sampled.block_table)

    # ---- catch-up and proposing ------------------------------------------------------------
    def _catch_up(
        self,
        entries: list[tuple[str, int, int, list[int], list[int]]],
        block_table: np.ndarray,  # [rows, width] int32, the InputBatch's
        keep_up: set[str] | None,
        computed: bool,
    ) -> list[tuple[int, int, int]]:
        """The step's rows whose draft K/V is still to compute, as (row, position, token id).

        `entries`: per request (req_id, row, first position, its known tokens, the step's final
        tokens). `keep_up`: the requests whose draft K/V must be final after this step (those
        that propose next); None: all. `computed`: the draft already ran over all the step's
        inputs. A request's K/V is final up to `_valid`; a position the proposing wrote last
        step, with the same token into the same slot, is final too; a request not kept up is
        skipped, and catches up from `_valid` when it proposes again."""
        written, self._written = self._written, {}
        pending = []
        for req_id, row, start, known, final in entries:
            end = start + len(final)
            valid = self._valid.get(req_id, start)
            if valid == start and computed:
                valid = end
            elif keep_up is not None and req_id not in keep_up:
                continue
            w = written.get(req_id)
            if valid == start and w is not None and w.start == start:
                slots = self._slots(block_table[row], start, len(w.slots))
                for token_id, w_token, slot, w_slot in zip(final, w.token_ids, slots, w.slots):
                    if token_id != w_token or slot != w_slot:
                        break
                    valid += 1
            pending.extend(
                (row, p, known[p] if p < start else final[p - start]) for p in range(valid, end)
            )
            self._valid[req_id] = end
        return pending

    def _propose_nothing(self, req_ids: Iterable[str], forking: set[str]) -> dict[str, list[int]]:
        """What `_catch_up` and `_propose` leave when no request proposes this step and none is
        kept up (every k 0, decodes only), without building their rows: an empty proposal for
        each request that sampled (none for a fork or its parent), and no position trusted as
        written by last step's proposals."""
        self._written = {}
        proposals = {}
        for req_id in req_ids:
            if req_id in forking:
                self._drafts.pop(req_id, None)
                continue
            self._drafts[req_id] = Draft([], None)
            proposals[req_id] = []
        return proposals

    def _slots(self, table: np.ndarray, start: int, num: int) -> list[int]:
        """The cache slots of positions start..start+num-1 under this block table row."""
        positions = np.arange(start, start + num)
        blocks = table[positions // self.block_size].astype(np.int64)
        return (blocks * self.block_size + positions % self.block_size).tolist()

    def _propose(
        self,
        requests: list[_Proposing],
        pending: list[tuple[int, int, int]],  # (row, position, token id), from `_catch_up`
        block_table: np.ndarray,  # [rows, width] int32, the InputBatch's
    ) -> dict[str, list[int]]:
        """Up to k proposals for each request (fewer where its slots run out); keeps q. The
        pending catch-up rows go through the first forward with the first proposals."""
        for j in range(self.k):
            active = [r for r in requests if r.num_slots > j]
            if not (active or pending):
                break
            rows = [row for row, _, _ in pending] + [r.row for r in active]
            positions = np.array(
                [pos for _, pos, _ in pending] + [len(r.token_ids) - 1 for r in active], np.int64
            )
            metadata = decode_metadata(block_table[rows], positions, self.block_size, self.device)
            ids = [token_id for _, _, token_id in pending] + [r.token_ids[-1] for r in active]
            ids = torch.tensor(ids, device=self.device)
            pos = torch.from_numpy(positions).to(self.device)
            if not active:
                self.draft.forward(ids, pos, metadata)
                break
            sampled = self._sample(active, ids, pos, metadata, len(pending))
            for r, token_id in zip(active, sampled):
                r.token_ids.append(token_id)
            pending = []
        proposals = {}
        for r in requests:
            num = min(r.num_slots, self.k)
            proposal = r.token_ids[len(r.token_ids) - num :] if num else []
            probs = torch.stack(r.probs) if r.probs else None
            self._drafts[r.req_id] = Draft(proposal, probs)
            proposals[r.req_id] = proposal
            if num:  # the tokens fed: the last known one and every proposal but the last
                start = len(r.token_ids) - num - 1
                fed = r.token_ids[start:-1]
                self._written[r.req_id] = _Written(
                    start, fed, self._slots(block_table[r.row], start, num)
                )
        return proposals

    def _sample(
        self,
        active: list[_Proposing],
        ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        skip: int,
    ) -> list[int]:
        """Each request's next proposal from the draft's processed distribution; the first
        `skip` rows (catch-up) are computed and not sampled."""
        banned = [banned_token_ids(r.params, len(r.token_ids) - r.prompt_len) for r in active]
        argmax_only = all(r.params.argmax_only for r in active) and not any(banned)
        if argmax_only:
            token_ids = self.draft.argmax_tokens(ids, positions, metadata)
            if token_ids is not None:
                return token_ids[skip:]
        hidden = self.draft.forward(ids, positions, metadata)[skip:]
        logits = self.draft.compute_logits(hidden)
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
        token_ids = categorical(probs, batch.noise_seeds).tolist()
        for i, r in enumerate(active):
            if not r.params.is_greedy:
                r.probs.append(probs[i])
        return token_ids

    def _proposing(
        self,
        req_id: str,
        row: int,
        num_blocks: int,
        prompt_token_ids: list[int],
        token_ids: list[int],
        params: SamplingParams,
        index: int,
        num_draft: int,
    ) -> _Proposing:
        """A request to propose up to `num_draft` tokens for after its tokens `token_ids`
        (prompt, outputs, this step's new ones), with `num_blocks` blocks allocated."""
        last = len(token_ids) - 1
        room = min(num_blocks * self.block_size - last, self.max_model_len - 1 - last)
        return _Proposing(
            req_id=req_id,
            row=row,
            prompt_len=len(prompt_token_ids),
            token_ids=list(token_ids),
            params=params,
            index=index,
            num_slots=max(min(room, num_draft), 0),
            probs=[],
        )


def _noise_key(r: _Proposing) -> int | None:
    seed = r.params.seed
    return None if seed is None else noise_seed(seed, r.index, len(r.token_ids), STREAM_DRAFT)

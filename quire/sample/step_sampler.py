"""StepSampler: a step's logits rows in, each request's accepted tokens and their logprobs out.

Each logits row belongs to a request and sits `offset` positions past its known tokens: 0 for a
request that samples its next token, 0..k for a request verifying k speculative tokens. The
sampler masks the rows a grammar constrains, then either takes the argmax (every row greedy,
unpenalized, nothing banned: the same token the full sampler would give) or runs the sampler
(sampler.py) over the batch's sampling tensors.

Speculative tokens are verified position by position: the token sampled after the known tokens
and the first j proposals is kept if every proposal before it matched what was sampled at its
position. Each position samples with its own noise (`noise_seed`) and sees the proposals before
it as generated tokens (penalties, min_tokens), so a request gets the tokens it would get without
speculation. That exact match is rejection sampling for proposals that are point masses (n-gram
ones, a draft model's for a greedy request); a sampling request verifying a draft model's
proposals goes through the rejection sampler with the draft's q instead (rejection_sampler.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from quire.messages import TopLogprobs
from quire.sample.rejection_sampler import rejection_sample
from quire.sample.sampler import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_SAMPLE,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_token_bitmask,
    banned_token_ids,
    compute_topk_logprobs,
    greedy,
    noise_seed,
    sampling_probs,
    uniform_noise,
)
from quire.sampling_params import SamplingParams


class SamplingRequest(Protocol):
    """What the sampler reads of a request (the worker's RequestState)."""

    req_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt, then generated tokens
    spec_token_ids: list[int]  # this step's proposals
    index: int  # which of its group's completions: part of its noise's key
    argmax_only: bool  # sampling_params.argmax_only, read once

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...


Row = tuple[SamplingRequest, int]  # a logits row's request, and its offset past the known tokens


@dataclass
class Draft:
    """A request's proposals and, for a sampling request, q at each of them (a draft model's)."""

    token_ids: list[int]
    probs: torch.Tensor | None  # [len(token_ids), V] float32; None for greedy requests


@dataclass
class GrammarMask:
    """The step's structured-output rows: one row of allowed tokens per sampled position of
    each constrained request, from its first row on (packed bits, 32 tokens per int32)."""

    bitmask: np.ndarray  # [num_rows, ceil(vocab / 32)] int32
    first_rows: dict[str, int]  # req id -> its first row


@dataclass
class StepSample:
    accepted: dict[str, list[int]]  # per request: its new tokens, in order
    logprobs: dict[str, TopLogprobs] = field(default_factory=dict)  # for those that asked


def takes_argmax(request: SamplingRequest, offset: int) -> bool:
    """Whether the request's token `offset` positions past its known ones is the argmax of the
    raw logits: greedy, unpenalized, no logprobs, nothing banned."""
    if not request.argmax_only:
        return False
    if request.num_output_tokens + offset >= request.sampling_params.min_tokens:
        return True  # past min_tokens nothing is banned
    return not _banned_tokens(request, offset)


def accept(rows: list[Row], token_ids: list[int]) -> dict[str, list[int]]:
    """Each request's new tokens from its rows' tokens: the token after its known tokens, then,
    while the token sampled at a position equals the proposal there, the token after that."""
    accepted: dict[str, list[int]] = {}
    done: set[str] = set()  # requests whose proposal at an earlier position was rejected
    for (s, offset), token_id in zip(rows, token_ids):
        if not s.spec_token_ids:  # nothing proposed: its one row
            accepted[s.req_id] = [token_id]
            continue
        if s.req_id in done:
            continue
        accepted.setdefault(s.req_id, []).append(token_id)
        if offset >= len(s.spec_token_ids) or token_id != s.spec_token_ids[offset]:
            done.add(s.req_id)
    return accepted


class StepSampler:
    def __init__(self, device: torch.device):
        self.device = device
        self.sampler = Sampler()

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] float32, one per entry of `rows`
        rows: list[Row],
        grammar: GrammarMask | None = None,
        drafts: Mapping[str, Draft] | None = None,
    ) -> StepSample:
        if grammar is not None:
            logits = self._apply_grammar(logits, rows, grammar)
        if all(takes_argmax(s, offset) for s, offset in rows):
            # The sampler would take the same argmax (of the masked logits, under a grammar); its
            # per-row batch costs ~0.1 ms of Python with the caches cold from the weights.
            return StepSample(accept(rows, greedy(logits).tolist()))
        batch = self._sampling_batch(rows, seeded=True)
        drafted = _drafted(rows, drafts or {})
        num_logprobs = batch.max_num_logprobs
        if drafted:  # logprobs of the tokens the rejection sampler emits, computed below
            batch.max_num_logprobs = None
        out = self.sampler(logits, batch)
        accepted = accept(rows, out.sampled_token_ids.tolist())
        if drafted:
            row_tokens = self._rejection_sample(
                rows, drafted, logits, out.sampled_token_ids, accepted
            )
            if num_logprobs is not None:
                ids, lps, ranks = compute_topk_logprobs(
                    logits.log_softmax(dim=-1), row_tokens, num_logprobs
                )
                out = SamplerOutput(row_tokens, lps[:, 0], ids, lps, ranks)
        result = StepSample(accepted)
        if out.logprob_token_ids is not None:
            result.logprobs = _sampled_logprobs(rows, accepted, out)
        return result

    def _sampling_batch(self, rows: list[Row], seeded: bool) -> SamplingBatch:
        """The sampling parameters of these rows, with their sampling noise's keys if
        `seeded`."""
        return SamplingBatch.from_params(
            [s.sampling_params for s, _ in rows],
            # Only penalized rows read their history: no per-step copy of every output.
            [_seen_outputs(s, offset) for s, offset in rows],
            [s.prompt_token_ids for s, _ in rows],
            [_noise_key(s, offset) if seeded else None for s, offset in rows],
            [_banned_tokens(s, offset) for s, offset in rows],
            self.device,
        )

    def _rejection_sample(
        self,
        rows: list[Row],
        drafted: dict[int, Draft],
        logits: torch.Tensor,  # [num_rows, vocab]
        sampled_tokens: torch.Tensor,  # [num_rows], the target's sample at each row
        accepted: dict[str, list[int]],  # updated: the drafted requests' emitted tokens
    ) -> torch.Tensor:  # [num_rows]: the token each row emits (the sample where not drafted)
        """Verifies the drafted requests' proposals by rejection sampling, all at once. The
        target's p at each proposal is the distribution its row samples from; the bonus token is
        the row's own sample."""
        firsts = list(drafted)
        states = [rows[i][0] for i in firsts]
        ks = [len(s.spec_token_ids) for s in states]
        batch_size, max_k, dev = len(states), max(ks), self.device
        # [B, K] in row-major order; padding past a request's k repeats its last proposal's row.
        padded = [
            (i, s, min(j, k - 1)) for i, s, k in zip(firsts, states, ks) for j in range(max_k)
        ]
        logit_rows = torch.tensor([i + j for i, _, j in padded], device=dev)
        target_batch = self._sampling_batch([(s, j) for _, s, j in padded], seeded=False)
        target_probs = sampling_probs(logits[logit_rows], target_batch)  # [B * K, V]
        draft_probs = torch.zeros_like(target_probs).view(batch_size, max_k, -1)
        for b, (i, k) in enumerate(zip(firsts, ks)):
            draft_probs[b, :k] = drafted[i].probs[:k]
        keys = [
            (_noise_key(s, j, STREAM_ACCEPT), _noise_key(s, j, STREAM_RESIDUAL))
            for s in states
            for j in range(max_k)
        ]
        proposals = [s.spec_token_ids + [0] * (max_k - k) for s, k in zip(states, ks)]
        out, num_emitted = rejection_sample(
            torch.tensor(proposals, device=dev),
            torch.tensor(ks, device=dev),
            draft_probs,
            target_probs.view(batch_size, max_k, -1),
            sampled_tokens[torch.tensor([i + k for i, k in zip(firsts, ks)], device=dev)],
            uniform_noise([a for a, _ in keys], dev).view(batch_size, max_k),
            [r for _, r in keys],
        )
        emitted = out.tolist()
        for s, tokens, num in zip(states, emitted, num_emitted.tolist()):
            accepted[s.req_id] = tokens[:num]
        positions = torch.arange(max_k + 1, device=dev)
        valid = positions < num_emitted[:, None]
        row_index = torch.tensor(firsts, device=dev)[:, None] + positions
        row_tokens = sampled_tokens.clone()
        row_tokens[row_index[valid]] = out[valid]
        return row_tokens

    def _apply_grammar(
        self, logits: torch.Tensor, rows: list[Row], grammar: GrammarMask
    ) -> torch.Tensor:
        """Masks the tokens each structured-output row's grammar forbids."""
        logit_rows, mask_rows = [], []
        for i, (s, offset) in enumerate(rows):
            first = grammar.first_rows.get(s.req_id)
            if first is not None:
                logit_rows.append(i)
                mask_rows.append(first + offset)
        bitmask = torch.from_numpy(grammar.bitmask[mask_rows]).to(self.device)
        return apply_token_bitmask(logits, bitmask, logit_rows)


def _drafted(rows: list[Row], drafts: Mapping[str, Draft]) -> dict[int, Draft]:
    """The sampling (not greedy) requests verifying a draft model's proposals: the index of each
    one's first row, and its draft (proposals and q)."""
    drafted = {}
    for i, (s, offset) in enumerate(rows):
        draft = drafts.get(s.req_id) if offset == 0 and s.spec_token_ids else None
        if draft is not None and draft.probs is not None:
            drafted[i] = draft
    return drafted


def _sampled_logprobs(
    rows: list[Row], accepted: dict[str, list[int]], out: SamplerOutput
) -> dict[str, TopLogprobs]:
    all_ids = out.logprob_token_ids.tolist()
    all_lps = out.logprobs.tolist()
    ranks = out.sampled_ranks.tolist()
    result: dict[str, TopLogprobs] = {}
    for i, (s, offset) in enumerate(rows):
        k = s.sampling_params.logprobs
        if k is None or offset >= len(accepted[s.req_id]):
            continue
        top = result.setdefault(s.req_id, TopLogprobs([], [], []))
        top.token_ids.append(all_ids[i][: k + 1])
        top.logprobs.append(all_lps[i][: k + 1])
        top.ranks.append(ranks[i])
    return result


def _seen_outputs(request: SamplingRequest, offset: int) -> list[int]:
    """The generated tokens a penalized row sees: its outputs, then the proposals before it."""
    if not request.sampling_params.uses_penalties:
        return []
    return request.token_ids[request.num_prompt_tokens :] + request.spec_token_ids[:offset]


def _noise_key(request: SamplingRequest, offset: int, stream: int = STREAM_SAMPLE) -> int | None:
    seed = request.sampling_params.seed
    if seed is None:
        return None
    return noise_seed(seed, request.index, request.num_tokens + offset, stream)


def _banned_tokens(request: SamplingRequest, offset: int) -> list[int]:
    return banned_token_ids(request.sampling_params, request.num_output_tokens + offset)

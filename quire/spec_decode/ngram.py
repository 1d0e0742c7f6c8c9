"""N-gram prompt lookup (vLLM's `ngram` method): propose the tokens that followed the earlier
occurrence of the context's last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the longest suffix of the request's
tokens (prompt and output) that occurred before wins; among occurrences of that length, the
earliest; the proposal is up to k of the tokens that followed it. This is exactly what vLLM's
KMP search returns (vllm/v1/spec_decode/ngram_proposer.py), found here with numpy: the positions
equal to the last token are the only places a match can end, and each of the up to
`prompt_lookup_max - 1` extension rounds keeps, in one vectorized compare, the candidates whose
match extends by one token, so a proposal costs one pass over the tokens and no Python loop per
token.

Each request's tokens are kept in a numpy buffer that grows as the request does (tokens are only
ever appended: rejected proposals never enter a request's tokens), so a step converts only its
new tokens, not the whole context.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from quire.sample.step_sampler import Draft
from quire.worker.protocols import SampledStep

_EMPTY = np.empty(0, np.int64)


def find_ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix of
    `tokens` of length in [min_n, max_n]; empty if no such suffix occurred before."""
    num_tokens = len(tokens)
    if k <= 0 or num_tokens <= min_n:
        return _EMPTY
    # Ends of earlier matches of the suffix, each followed by a token: first of length 1, then
    # the ones that extend to length 2, 3, ... (ascending, so the first is the earliest).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.size == 0:
        return _EMPTY
    length = 1
    for t in range(1, min(max_n, num_tokens - 1)):
        longer = ends[ends >= t]
        longer = longer[tokens[longer - t] == tokens[num_tokens - 1 - t]]
        if longer.size == 0:
            break
        ends, length = longer, t + 1
    if length < min_n:
        return _EMPTY
    start = int(ends[0]) + 1
    return tokens[start : start + k]


class _TokenBuffer:
    """A request's tokens as a numpy array, extended with what was appended since last time."""

    __slots__ = ("tokens", "length")

    def __init__(self) -> None:
        self.tokens = np.empty(256, np.int64)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        num_tokens = len(token_ids)
        if num_tokens > len(self.tokens):
            grown = np.empty(max(2 * len(self.tokens), num_tokens), np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : num_tokens] = token_ids[self.length : num_tokens]
        self.length = num_tokens
        return self.tokens[:num_tokens]


class NgramProposer:
    """Implements worker/protocols.py's Proposer by prompt lookup: after each step, up to k
    tokens for every request that sampled, from its tokens and the step's new ones. Every rank
    proposes alike from its own copy of the batch. Proposals are point masses (no q) and keep
    no KV cache."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, k: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = k
        self._buffers: dict[str, _TokenBuffer] = {}

    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return 0

    def allocate_kv(
        self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, huge_pages: bool
    ) -> None:
        pass

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    @property
    def drafts(self) -> Mapping[str, Draft]:
        return {}

    def propose(self, sampled: SampledStep) -> dict[str, list[int]]:
        """k tokens (the most "auto" verifies: the engine chooses how many of them to verify)
        for each request that sampled."""
        requests = sampled.requests
        return {
            req_id: self.lookup(req_id, requests[req_id].token_ids + token_ids, self.k)
            for req_id, token_ids in sampled.sampled.items()
        }

    def lookup(self, req_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to k proposed tokens to follow `token_ids` (the request's prompt and output)."""
        buffer = self._buffers.get(req_id)
        if buffer is None:
            buffer = self._buffers[req_id] = _TokenBuffer()
        return find_ngram_proposal(buffer.sync(token_ids), self.min_n, self.max_n, k).tolist()

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forgets these requests' buffers (finished or preempted)."""
        for req_id in req_ids:
            self._buffers.pop(req_id, None)

    @property
    def req_ids(self) -> set[str]:
        return set(self._buffers)

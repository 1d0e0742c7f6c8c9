"""KVCacheManager: block pool, ref counts, chained prefix-cache hashes, LRU reuse, copy-on-write.

The manager is driven the way the scheduler drives it: `allocate_slots` for the tokens a step
computes, then `num_computed_tokens` advances. Block size 4 throughout, so block i of a request
holds its tokens 4i..4i+3.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from quire.engine.kv_manager import KVCacheManager, hash_block
from quire.engine.request import Request
from quire.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, token_ids: list[int], **params) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(**params), max_tokens=16)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> bool:
    """First scheduling: reuse the cached prefix, allocate for `num_new` more tokens (default:
    the rest of the prompt) and mark them computed."""
    hits = kv.get_computed_blocks(request)
    num_cached = len(hits) * kv.block_size
    if num_new is None:
        num_new = request.num_tokens - num_cached
    if not kv.allocate_slots(request, num_new, hits):
        return False
    request.num_computed_tokens = num_cached + num_new
    return True


def compute(kv: KVCacheManager, request: Request, num_new: int) -> bool:
    """A later step of a running request: allocate for `num_new` tokens and mark them computed."""
    if not kv.allocate_slots(request, num_new):
        return False
    request.num_computed_tokens += num_new
    return True


def decode(kv: KVCacheManager, request: Request, token_id: int) -> bool:
    request.append_token(token_id)
    return compute(kv, request, 1)


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [block.ref_count for block in kv.blocks]


def snapshot(kv: KVCacheManager) -> tuple:
    """Everything allocation may change (a request holding no blocks counts as absent)."""
    return (
        list(kv.free_blocks),
        [(b.ref_count, b.block_hash) for b in kv.blocks],
        {h: b.block_id for h, b in kv.cached_blocks.items()},
        {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_blocks.items() if blocks},
        list(kv.pending_copies),
    )


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


# ---- allocation and ref counts -------------------------------------------------------------


def test_new_pool_has_every_block_free_in_id_order():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    assert list(kv.free_blocks) == [0, 1, 2, 3, 4]
    assert ref_counts(kv) == [0, 0, 0, 0, 0]
    assert kv.usage == 0.0


def test_allocation_takes_blocks_from_the_head_of_the_free_list():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", tokens(100, 10))
    assert admit(kv, request)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert ref_counts(kv) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert list(kv.free_blocks) == [3, 4, 5, 6, 7]
    assert kv.usage == 3 / 8


def test_decode_takes_a_new_block_only_when_the_last_one_is_full():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", tokens(100, 6))
    admit(kv, request)
    num_blocks_after_each_decode = []
    for token_id in range(7):  # positions 6..12
        decode(kv, request, token_id)
        num_blocks_after_each_decode.append(len(kv.get_block_ids("a")))
    assert num_blocks_after_each_decode == [2, 2, 3, 3, 3, 3, 4]


def test_chunked_prefill_allocates_only_what_each_chunk_needs():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", tokens(100, 11))
    admit(kv, request, num_new=5)
    assert kv.get_block_ids("a") == [0, 1]
    compute(kv, request, 6)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert request.num_computed_tokens == 11


def test_allocation_that_does_not_fit_returns_false_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_request("a", tokens(100, 8)))
    before = snapshot(kv)
    assert not admit(kv, make_request("b", tokens(200, 9)))  # 3 blocks, 2 free
    assert snapshot(kv) == before
    assert kv.get_block_ids("b") == []


def test_allocation_that_exactly_fits_uses_every_free_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_request("a", tokens(100, 8)))
    assert admit(kv, make_request("b", tokens(200, 8)))
    assert kv.get_block_ids("b") == [2, 3]
    assert kv.num_free_blocks == 0


def test_decode_that_does_not_fit_returns_false_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    request = make_request("a", tokens(100, 8))
    admit(kv, request)
    before = snapshot(kv)
    request.append_token(7)
    assert not kv.allocate_slots(request, 1)
    assert snapshot(kv) == before


def test_cache_hits_in_the_free_list_count_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    first = make_request("a", tokens(100, 9))
    admit(kv, first)
    kv.free(first)
    # 2 hits (both free) + 2 new blocks = 4 blocks of a pool of 3.
    second = make_request("b", tokens(100, 8) + tokens(300, 8))
    before = snapshot(kv)
    assert not admit(kv, second)
    assert snapshot(kv) == before


def test_free_returns_every_block_to_the_pool():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", tokens(100, 10)), make_request("b", tokens(100, 10))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8
    assert ref_counts(kv) == [0] * 8
    assert kv.get_block_ids("a") == kv.get_block_ids("b") == []
    kv.check_invariants()


# ---- prefix cache --------------------------------------------------------------------------


def test_same_prompt_reuses_the_full_blocks_of_a_running_request():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", tokens(100, 10)))
    second = make_request("b", tokens(100, 10))
    hits = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [0, 1]
    kv.allocate_slots(second, 2, hits)
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert ref_counts(kv)[:4] == [2, 2, 1, 1]


def test_freed_blocks_stay_in_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    first = make_request("a", tokens(100, 10))
    admit(kv, first)
    kv.free(first)
    second = make_request("b", tokens(100, 10))
    admit(kv, second)
    assert kv.get_block_ids("b")[:2] == [0, 1]
    assert second.num_computed_tokens == 10


def test_a_block_hits_only_if_every_block_before_it_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", tokens(100, 13)))
    # Same blocks 0 and 2 as "a", different block 1.
    other = make_request("b", tokens(100, 4) + tokens(500, 4) + tokens(108, 5))
    assert [b.block_id for b in kv.get_computed_blocks(other)] == [0]


def test_a_different_first_block_means_no_hit_at_all():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", tokens(100, 13)))
    other = make_request("b", tokens(500, 4) + tokens(104, 9))
    assert kv.get_computed_blocks(other) == []


def test_same_tokens_after_a_different_prefix_hash_differently():
    block = [1, 2, 3, 4]
    parent_a, parent_b = hash_block(None, [5, 6, 7, 8]), hash_block(None, [9, 9, 9, 9])
    assert hash_block(parent_a, block) != hash_block(parent_b, block)
    assert hash_block(parent_a, block) != hash_block(None, block)


def test_block_hash_is_stable_across_calls_and_processes():
    first = hash_block(None, [1, 2, 3, 4])
    assert first == 0x3AFB68A48EDC578A5FA1582D43CC1351
    assert hash_block(first, [5, 6, 7, 8]) == 0x5AD5D4C5012EE1E5077F57EEFA72FBBB
    assert hash_block(None, (1, 2, 3, 4)) == first


def test_generated_tokens_are_found_by_their_request_not_by_a_prompt_holding_them():
    """Generated tokens' KV comes from the decode kernels: a later prompt made of the same tokens
    (a chat's next turn) hits only the blocks its first request computed as prompt, while the
    request itself, resumed after preemption, finds all of its full blocks."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = make_request("a", tokens(100, 6))  # blocks: 4 prompt | 2 prompt + 2 generated | 4
    admit(kv, first)
    for token_id in tokens(900, 7):
        decode(kv, first, token_id)
    assert first.num_computed_tokens == 13
    next_turn = make_request("b", first.token_ids + [7, 7])
    assert [b.block_id for b in kv.get_computed_blocks(next_turn)] == [0]
    kv.free(first)  # preempted: its blocks stay cached
    resumed = make_request("a", tokens(100, 6))
    for token_id in tokens(900, 7):
        resumed.append_token(token_id)
    assert [b.block_id for b in kv.get_computed_blocks(resumed)] == [0, 1, 2]
    later_start = make_request("d", tokens(100, 7))  # generation starts one token later
    for token_id in tokens(901, 6):
        later_start.append_token(token_id)
    assert [b.block_id for b in kv.get_computed_blocks(later_start)] == [0]


def test_prompt_of_exactly_k_full_blocks_reuses_only_k_minus_1():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", tokens(100, 12)))
    same = make_request("b", tokens(100, 12))
    assert [b.block_id for b in kv.get_computed_blocks(same)] == [0, 1]


def test_prompt_one_token_past_k_full_blocks_reuses_all_k():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", tokens(100, 12)))
    longer = make_request("b", tokens(100, 13))
    assert [b.block_id for b in kv.get_computed_blocks(longer)] == [0, 1, 2]


def test_a_partial_block_is_not_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", tokens(100, 6)))
    longer = make_request("b", tokens(100, 9))
    assert [b.block_id for b in kv.get_computed_blocks(longer)] == [0]


def test_a_chunk_caches_only_the_blocks_it_fills():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", tokens(100, 13)), num_new=6)
    longer = make_request("b", tokens(100, 13))
    assert [b.block_id for b in kv.get_computed_blocks(longer)] == [0]


def test_prefix_cache_counts_queried_and_hit_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", tokens(100, 10)))
    admit(kv, make_request("b", tokens(100, 10)))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)


def test_prefix_caching_off_never_hits_and_hashes_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(kv, make_request("a", tokens(100, 10)))
    assert kv.get_computed_blocks(make_request("b", tokens(100, 10))) == []
    assert kv.cached_blocks == {}


def test_request_with_prompt_logprobs_computes_its_whole_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", tokens(100, 10)))
    wants_logprobs = make_request("b", tokens(100, 10), prompt_logprobs=1)
    assert kv.get_computed_blocks(wants_logprobs) == []


# ---- LRU reuse of freed blocks ---------------------------------------------------------------


def test_the_least_recently_freed_cached_block_is_evicted_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = make_request("a", tokens(100, 4)), make_request("b", tokens(200, 4))
    admit(kv, a)  # block 0
    admit(kv, b)  # block 1
    kv.free(a)
    kv.free(b)
    assert list(kv.free_blocks) == [2, 3, 0, 1]
    admit(kv, make_request("c", tokens(300, 12)))
    assert kv.get_block_ids("c") == [2, 3, 0]
    assert kv.get_computed_blocks(make_request("a2", tokens(100, 5))) == []
    assert [x.block_id for x in kv.get_computed_blocks(make_request("b2", tokens(200, 5)))] == [1]


def test_a_cache_hit_takes_its_block_out_of_the_free_list():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    first = make_request("a", tokens(100, 5))
    admit(kv, first)
    kv.free(first)
    assert list(kv.free_blocks) == [1, 2, 3, 0]  # the partial block 1 first, cached 0 last
    admit(kv, make_request("b", tokens(100, 5)))
    assert kv.get_block_ids("b") == [0, 1]
    assert list(kv.free_blocks) == [2, 3]


def test_a_block_freed_again_after_a_hit_moves_to_the_back_of_the_lru():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a, b = make_request("a", tokens(100, 4)), make_request("b", tokens(200, 4))
    admit(kv, a)  # block 0
    admit(kv, b)  # block 1
    kv.free(a)
    kv.free(b)
    reuse = make_request("a2", tokens(100, 4) + [7])
    admit(kv, reuse)  # hits block 0, takes block 2
    kv.free(reuse)
    assert list(kv.free_blocks) == [2, 1, 0]  # 2 holds a partial block: reused first


def test_a_freed_request_loses_its_tail_blocks_before_its_head():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    first = make_request("a", tokens(100, 12))
    admit(kv, first)
    kv.free(first)
    assert list(kv.free_blocks) == [2, 1, 0]
    admit(kv, make_request("b", tokens(900, 4)))
    assert kv.get_block_ids("b") == [2]
    again = make_request("a2", tokens(100, 13))
    assert [b.block_id for b in kv.get_computed_blocks(again)] == [0, 1]


def test_blocks_the_cache_cannot_hit_are_reused_before_blocks_never_written():
    """On CPU a block's pages are faulted in the first time it is written: a pool that hands out
    every block once before reusing any pays that across its whole size. Blocks that hold
    nothing the prefix cache can hit go back to the head of the free list."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    for i in range(5):
        request = make_request(f"r{i}", tokens(100 * i, 10))
        admit(kv, request)
        assert kv.get_block_ids(f"r{i}") == [0, 1, 2]  # the same warm blocks, in order
        kv.free(request)
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = make_request("a", tokens(100, 10))  # blocks 0 and 1 cached, 2 partial
    admit(kv, first)
    kv.free(first)
    assert list(kv.free_blocks)[:2] == [2, 3] and list(kv.free_blocks)[-2:] == [1, 0]
    admit(kv, make_request("b", tokens(900, 3)))
    assert kv.get_block_ids("b") == [2]
    kv.check_invariants()


def test_a_copy_of_a_cached_block_is_reused_before_blocks_never_written():
    """Two running requests with the same prompt compute the same full block twice; only the
    first is in the cache, so the second, freed, can never be hit."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a, b = make_request("a", tokens(100, 5)), make_request("b", tokens(100, 5))
    admit(kv, a)  # blocks 0 (cached) and 1
    assert kv.allocate_slots(b, 5)  # no hit looked up: blocks 2 and 3, 2 a copy of 0
    b.num_computed_tokens = 5
    kv.free(b)
    kv.free(a)
    assert list(kv.free_blocks)[:3] == [1, 2, 3] and list(kv.free_blocks)[-1] == 0
    kv.check_invariants()


def test_reset_prefix_cache_forgets_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    first = make_request("a", tokens(100, 9))
    admit(kv, first)
    kv.free(first)
    kv.reset_prefix_cache()
    assert kv.cached_blocks == {}
    assert kv.get_computed_blocks(make_request("b", tokens(100, 9))) == []


# ---- fork and copy-on-write ------------------------------------------------------------------


def forked_pair(kv: KVCacheManager, prompt: list[int]) -> tuple[Request, Request]:
    parent = make_request("g#0", prompt, n=2)
    admit(kv, parent)
    child = parent.fork(1)
    kv.fork(parent, child)
    return parent, child


def test_fork_shares_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent, child = forked_pair(kv, tokens(100, 6))
    assert kv.get_block_ids(child.request_id) == kv.get_block_ids(parent.request_id) == [0, 1]
    assert ref_counts(kv)[:3] == [2, 2, 0]


def test_first_write_into_a_shared_partial_block_copies_it():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent, child = forked_pair(kv, tokens(100, 6))
    decode(kv, parent, 1)
    assert kv.take_copies() == [(1, 2)]
    assert kv.get_block_ids(parent.request_id) == [0, 2]
    assert kv.get_block_ids(child.request_id) == [0, 1]
    assert ref_counts(kv)[:3] == [2, 1, 1]


def test_take_copies_hands_each_copy_over_once():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent, _ = forked_pair(kv, tokens(100, 6))
    decode(kv, parent, 1)
    kv.take_copies()
    assert kv.take_copies() == []


def test_the_last_holder_of_a_shared_partial_block_writes_in_place():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent, child = forked_pair(kv, tokens(100, 6))
    decode(kv, parent, 1)
    kv.take_copies()
    decode(kv, child, 2)
    assert kv.take_copies() == []
    assert kv.get_block_ids(child.request_id) == [0, 1]


def test_full_shared_blocks_are_never_copied():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent, child = forked_pair(kv, tokens(100, 8))
    decode(kv, parent, 1)
    decode(kv, child, 2)
    assert kv.take_copies() == []
    assert kv.get_block_ids(parent.request_id) == [0, 1, 2]
    assert kv.get_block_ids(child.request_id) == [0, 1, 3]
    assert ref_counts(kv)[:4] == [2, 2, 1, 1]


def test_a_copy_that_does_not_fit_returns_false_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    parent, _ = forked_pair(kv, tokens(100, 6))
    before = snapshot(kv)
    parent.append_token(1)
    assert not kv.allocate_slots(parent, 1)
    assert snapshot(kv) == before


def test_freeing_a_fork_keeps_the_blocks_its_sibling_holds():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent, child = forked_pair(kv, tokens(100, 6))
    kv.free(parent)
    assert ref_counts(kv)[:2] == [1, 1]
    assert kv.num_free_blocks == 6
    kv.free(child)
    assert kv.num_free_blocks == 8
    assert ref_counts(kv) == [0] * 8


# ---- property test: random interleavings keep the books straight -----------------------------


class KVManagerMachine(RuleBasedStateMachine):
    """Requests are admitted (with prefix hits), computed in chunks, decoded, forked, preempted
    (freed and recomputed later) and freed in random order. Alongside, a model of the physical
    cache records which token each slot holds, applying copy-on-write copies before writes as
    the worker does: every computed token of a live request must sit in its block table."""

    @initialize(
        num_blocks=st.integers(1, 16),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def make_pool(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.slots: dict[int, dict[int, int]] = {}  # block id -> slot -> token id
        self.block_tokens: dict[int, tuple[int, ...]] = {}  # block hash -> its tokens
        self.ids = itertools.count()

    def _write(self, request: Request, num_new: int) -> None:
        """Applies the step's copies, then writes `num_new` tokens into their slots."""
        table = self.kv.get_block_ids(request.request_id)
        for src, dst in self.kv.take_copies():
            assert src != dst and dst in table and self.kv.blocks[dst].ref_count == 1
            self.slots[dst] = dict(self.slots.get(src, {}))
        bs = self.kv.block_size
        start = request.num_computed_tokens
        for pos in range(start, start + num_new):
            self.slots.setdefault(table[pos // bs], {})[pos % bs] = request.token_ids[pos]
        request.num_computed_tokens += num_new

    def _allocate(self, request: Request, num_new: int, hits=()) -> bool:
        before = snapshot(self.kv)
        if self.kv.allocate_slots(request, num_new, hits):
            return True
        assert snapshot(self.kv) == before
        return False

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def add(self, prompt: list[int]) -> None:
        self.waiting.append(make_request(f"r{next(self.ids)}", prompt))

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 16))
    def admit(self, pick: int, chunk: int) -> None:
        request = self.waiting[pick % len(self.waiting)]
        hits = self.kv.get_computed_blocks(request)
        assert len(hits) * self.kv.block_size < request.num_tokens
        num_cached = len(hits) * self.kv.block_size
        num_new = min(request.num_tokens - num_cached, chunk)
        if self._allocate(request, num_new, hits):
            request.num_computed_tokens = num_cached
            self._write(request, num_new)
            self.waiting.remove(request)
            self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 16), token_id=st.integers(0, 2))
    def step(self, pick: int, chunk: int, token_id: int) -> None:
        request = self.running[pick % len(self.running)]
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(token_id)
        num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
        if self._allocate(request, num_new):
            self._write(request, num_new)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick: int) -> None:
        parent = self.running[pick % len(self.running)]
        child = parent.fork(next(self.ids))
        self.kv.fork(parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def preempt(self, pick: int) -> None:
        request = self.running.pop(pick % len(self.running))
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.waiting.append(request)

    @precondition(lambda self: self.running or self.waiting)
    @rule(pick=st.integers(0, 99))
    def free(self, pick: int) -> None:
        live = self.running + self.waiting
        request = live[pick % len(live)]
        self.kv.free(request)
        (self.running if request in self.running else self.waiting).remove(request)

    @rule()
    def free_everything(self) -> None:
        self.teardown()

    @invariant()
    def books_balance(self) -> None:
        self.kv.check_invariants()

    @invariant()
    def waiting_requests_hold_no_blocks(self) -> None:
        for request in self.waiting:
            assert self.kv.get_block_ids(request.request_id) == []

    @invariant()
    def running_requests_hold_exactly_the_blocks_their_tokens_need(self) -> None:
        for request in self.running:
            table = self.kv.get_block_ids(request.request_id)
            assert len(table) == self.kv.blocks_needed(request.num_computed_tokens)

    @invariant()
    def every_computed_token_sits_in_its_slot(self) -> None:
        bs = self.kv.block_size
        for request in self.running:
            table = self.kv.get_block_ids(request.request_id)
            for pos in range(request.num_computed_tokens):
                assert self.slots[table[pos // bs]][pos % bs] == request.token_ids[pos]

    @invariant()
    def a_hashed_block_holds_the_tokens_its_hash_chains(self) -> None:
        bs = self.kv.block_size
        for request in self.running:
            parent = None
            for i, block_id in enumerate(self.kv.get_block_ids(request.request_id)):
                block = self.kv.blocks[block_id]
                if (i + 1) * bs > request.num_computed_tokens:
                    assert block.block_hash is None  # partial blocks are never hashed
                    break
                offset = request.num_prompt_tokens - i * bs
                parent = hash_block(
                    parent,
                    request.token_ids[i * bs : (i + 1) * bs],
                    offset if 0 <= offset < bs else None,
                )
                if block.block_hash is not None:
                    assert block.block_hash == parent
                    self.block_tokens[parent] = tuple(request.token_ids[i * bs : (i + 1) * bs])
        for block_hash, block in self.kv.cached_blocks.items():
            if block_hash in self.block_tokens:
                held = tuple(self.slots[block.block_id][s] for s in range(bs))
                assert held == self.block_tokens[block_hash]

    def teardown(self) -> None:
        for request in self.running + self.waiting:
            self.kv.free(request)
        self.running.clear()
        self.waiting.clear()
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert ref_counts(self.kv) == [0] * self.kv.num_blocks


KVManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_manager_random_interleavings = KVManagerMachine.TestCase

"""A cached block is reused only after the same prefix: the same 16 tokens at another position,
or after other tokens, are not a cache hit. Their K/V were computed at other positions over
another context, so a hit there would give other tokens.

The expected hits come from a reference cache written here without hashes: it remembers every
full-block prefix (as a tuple of token ids) that a request computed, and a new prompt hits its
leading blocks whose whole prefix it remembers, never the block holding the prompt's last token.
"""

from __future__ import annotations

import pytest
from conftest import greedy, make_llm
from hypothesis import given, settings
from hypothesis import strategies as st

from quire import SamplingParams
from quire.engine.kv_manager import KVCacheManager
from quire.engine.request import Request

BS = 16
P = list(range(1000, 1000 + BS))  # three distinct blocks of 16 token ids
X = list(range(2000, 2000 + BS))
Y = list(range(3000, 3000 + BS))


class ReferenceCache:
    """Prefix caching as a set of computed prefixes whose length is a multiple of BS."""

    def __init__(self) -> None:
        self.prefixes: set[tuple[int, ...]] = set()

    def hits(self, prompt: list[int]) -> int:  # leading blocks found
        num_hits = 0
        while num_hits < (len(prompt) - 1) // BS:
            if tuple(prompt[: (num_hits + 1) * BS]) not in self.prefixes:
                break
            num_hits += 1
        return num_hits

    def compute(self, prompt: list[int]) -> None:
        for end in range(BS, len(prompt) + 1, BS):
            self.prefixes.add(tuple(prompt[:end]))


def admit(kv: KVCacheManager, request_id: str, prompt: list[int]) -> int:
    """Schedules a whole prompt as the scheduler does; returns its number of cache-hit blocks."""
    request = Request(request_id, prompt, SamplingParams(), max_tokens=16)
    hits = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - len(hits) * BS, hits)
    request.num_computed_tokens = request.num_tokens
    return len(hits)


def hits_after(cached: list[list[int]], prompt: list[int]) -> int:
    """Cache-hit blocks of `prompt` in a manager that has computed the `cached` prompts."""
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    for i, earlier in enumerate(cached):
        admit(kv, f"cached-{i}", earlier)
    return admit(kv, "new", prompt)


def test_a_block_cached_second_is_no_hit_as_a_first_block():
    assert hits_after([P + X + [7]], X + Y + [7]) == 0


def test_a_block_cached_first_is_no_hit_as_a_second_block():
    assert hits_after([X + [7]], P + X + [7]) == 0


def test_the_same_prefix_hits_every_block_of_it():
    assert hits_after([P + X + [7]], P + X + [8]) == 2


def test_a_repeated_block_hits_only_as_often_as_the_cached_prompt_repeated_it():
    assert hits_after([X + X + [7]], X + X + X + [7]) == 2


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=4), st.integers(0, 3)),
        min_size=1,
        max_size=6,
    )
)
def test_hits_match_a_reference_cache_of_prefixes(prompts):
    """Prompts made of the blocks P, X and Y in any order (so the same block often comes at
    other positions and after other prefixes), with a tail of 0..3 tokens."""
    blocks = [P, X, Y]
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    reference = ReferenceCache()
    for i, (block_indices, tail) in enumerate(prompts):
        prompt = [t for b in block_indices for t in blocks[b]] + [5] * tail
        assert admit(kv, str(i), prompt) == reference.hits(prompt)
        reference.compute(prompt)
    kv.check_invariants()


# ---- the engine: a false hit would change the tokens ----------------------------------------
FIRST = [*P, *X, 11, 12, 13]
SAME_BLOCK_FIRST = [*X, *Y, 21, 22]  # X moved from position 16 to position 0
SAME_PREFIX = [*P, *X, 31]  # a true hit of both blocks


@pytest.fixture(scope="module")
def alone(tiny_llama) -> dict[str, list[int]]:
    """Each prompt's tokens in an engine without prefix caching."""
    llm = make_llm(tiny_llama, dtype="float32", enable_prefix_caching=False)
    return {
        name: llm.generate([{"prompt_token_ids": p}], greedy(12), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
        for name, p in [("same_block", SAME_BLOCK_FIRST), ("same_prefix", SAME_PREFIX)]
    }


def test_the_same_block_at_another_position_is_recomputed_and_gives_the_same_tokens(
    tiny_llama, alone
):
    llm = make_llm(tiny_llama, dtype="float32")
    llm.generate([{"prompt_token_ids": FIRST}], greedy(12), use_tqdm=False)
    (moved,) = llm.generate([{"prompt_token_ids": SAME_BLOCK_FIRST}], greedy(12), use_tqdm=False)
    assert moved.outputs[0].token_ids == alone["same_block"]
    assert moved.num_cached_tokens == 0
    (same,) = llm.generate([{"prompt_token_ids": SAME_PREFIX}], greedy(12), use_tqdm=False)
    assert same.num_cached_tokens == 2 * BS
    assert same.outputs[0].token_ids == alone["same_prefix"]

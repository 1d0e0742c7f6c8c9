"""n > 1: the forks of a request share its prompt's blocks, and a fork's first write into the
shared, partly filled last block copies it first, so each fork's K/V and tokens are its own.

Greedy forks write identical K/V into the shared block, so only forks that sample different
tokens can show a missing copy: in the engine each sampled fork must give the tokens it gives
when computed alone, as a request of its own with the fork's seed (vLLM's convention, as
quire's: completion i of a request with seed s draws its noise as a request with seed s + i).
"""

from __future__ import annotations

import pytest
from conftest import make_llm

from quire import SamplingParams
from quire.engine.kv_manager import KVCacheManager
from quire.engine.request import Request

BS = 4
NUM_BLOCKS = 16


def admitted_parent(kv: KVCacheManager, prompt: list[int]) -> Request:
    parent = Request("p", prompt, SamplingParams(n=3), max_tokens=8)
    assert kv.allocate_slots(parent, len(prompt))
    parent.num_computed_tokens = len(prompt)
    return parent


def decode(kv: KVCacheManager, request: Request, token_id: int) -> None:
    request.append_token(token_id)
    assert kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1


def test_forks_share_the_prompt_blocks_and_each_copies_the_partial_block_before_writing():
    kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BS)
    parent = admitted_parent(kv, [10, 11, 12, 13, 14, 15])  # a full block, then 2 of 4 slots
    full, partial = kv.get_block_ids("p")
    forks = [parent, parent.fork(1), parent.fork(2)]
    for child in forks[1:]:
        kv.fork(parent, child)
    assert [kv.get_block_ids(f.request_id) for f in forks] == [[full, partial]] * 3
    assert kv.num_free_blocks == NUM_BLOCKS - 2  # shared, not copied
    assert kv.take_copies() == []

    # Each fork writes its own token at position 6, in the shared partial block.
    decode(kv, forks[0], 100)
    ((source_0, copy_0),) = kv.take_copies()
    decode(kv, forks[1], 101)
    ((source_1, copy_1),) = kv.take_copies()
    assert source_0 == source_1 == partial
    decode(kv, forks[2], 102)  # the last holder of the partial block writes in place
    assert kv.take_copies() == []
    assert [kv.get_block_ids(f.request_id) for f in forks] == [
        [full, copy_0],
        [full, copy_1],
        [full, partial],
    ]
    assert len({partial, copy_0, copy_1}) == 3
    assert kv.num_free_blocks == NUM_BLOCKS - 4
    kv.check_invariants()


def test_shared_blocks_return_to_the_pool_only_with_their_last_holder():
    kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BS)
    parent = admitted_parent(kv, [10, 11, 12, 13, 14, 15])
    forks = [parent, parent.fork(1), parent.fork(2)]
    for child in forks[1:]:
        kv.fork(parent, child)
    for fork, token_id in zip(forks, [100, 101, 102]):
        decode(kv, fork, token_id)
    kv.take_copies()
    freed = []
    for fork in forks:
        before = kv.num_free_blocks
        kv.free(fork)
        freed.append(kv.num_free_blocks - before)
    # Its copy, its copy, then the full block (ref count 3) and the partial one (ref count 1).
    assert freed == [1, 1, 2]
    assert kv.num_free_blocks == NUM_BLOCKS
    kv.check_invariants()


# ---- the engine: each sampled fork equals the same completion computed alone ----------------
PROMPT = {"prompt_token_ids": [(37 * i) % 5000 + 100 for i in range(21)]}  # 16 + 5: partial
SEED = 7
N = 3


def sampled(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_llama) -> list[list[int]]:
    """Completion i computed as a request of its own (seed SEED + i), without prefix caching."""
    llm = make_llm(tiny_llama, dtype="float32", enable_prefix_caching=False)
    outputs = llm.generate([PROMPT] * N, [sampled(SEED + i) for i in range(N)], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_each_sampled_fork_gives_the_tokens_it_gives_alone(tiny_llama, alone):
    # The forks diverge at their first token, written into the shared partial block.
    assert len({tokens[0] for tokens in alone}) == N
    llm = make_llm(tiny_llama, dtype="float32")
    (output,) = llm.generate([PROMPT], sampled(SEED, n=N), use_tqdm=False)
    assert [c.token_ids for c in output.outputs] == alone

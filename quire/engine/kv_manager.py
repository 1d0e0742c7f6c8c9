"""KVCacheManager: the block pool, ref counts, prefix-cache hashes, LRU free list and copy-on-write.

It owns all block bookkeeping; the physical tensors live in the worker (worker/kv_cache.py).

- Each block has a ref count: the number of requests whose block table holds it.
- A full block gets a hash chained from its parent block's hash and its token ids. Prefix caching
  maps hash -> block, so a new request reuses every leading full block of its prompt that is
  cached, except the block holding the prompt's last token (that token is computed for logits).
  The block where a request's generated tokens start also hashes where they start: their KV came
  from the decode kernels, whose bits are not the prompt kernels', so a later prompt holding the
  same tokens (the next turn of a chat) computes them again rather than take other bits; the
  request itself, replaying after preemption, still finds them.
- A freed block (ref count 0) keeps its hash and stays findable until the allocator reuses it:
  the free list is in LRU order, allocation evicts from its head, a cache hit takes it back out.
- `fork` shares a request's blocks with a child (ref count + 1). The first write into a shared,
  partially filled block copies it first (copy-on-write); the copies of a step are handed to the
  worker through `take_copies()`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from quire.engine.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


def hash_block(
    parent_hash: int | None, token_ids: list[int], generated_from: int | None = None
) -> int:
    """128-bit hash of a full block's tokens chained with its parent's hash; `generated_from`:
    the offset of the request's first generated token, in the block that holds it."""
    hasher = xxhash.xxh3_128()
    hasher.update((parent_hash or 0).to_bytes(16, "little"))
    hasher.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if generated_from is not None:
        hasher.update(b"generated from %d" % generated_from)
    return hasher.intdigest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_blocks: dict[int, KVBlock] = {}  # block hash -> block
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_hashes: dict[str, list[int]] = {}
        self.req_num_hashed_blocks: dict[str, int] = {}  # leading blocks already in the cache map
        self.pending_copies: list[tuple[int, int]] = []  # (src block, dst block) for CoW
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def table_end(self, request_id: str) -> tuple[int, int]:
        """(number of blocks, the last block's id or -1) of a request's block table."""
        blocks = self.req_blocks.get(request_id)
        return (len(blocks), blocks[-1].block_id) if blocks else (0, -1)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self.req_block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        first_generated = request.num_prompt_tokens
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else request.prefix_key
            offset = first_generated - i * bs
            hashes.append(
                hash_block(
                    parent,
                    request.token_ids[i * bs : (i + 1) * bs],
                    offset if 0 <= offset < bs else None,
                )
            )
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of leading blocks of `request` found in the prefix cache. Never covers
        the last token, which must be computed to produce logits."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self._block_hashes(request, max_blocks):
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] = (),
        num_lookahead: int = 0,
        cache: bool = True,
    ) -> bool:
        """Make `request`'s blocks cover its computed tokens, `computed_blocks` (prefix-cache
        hits, only on first scheduling), `num_new_tokens` more and `num_lookahead` slots past
        them (for speculative tokens; never hashed). Without `cache`, the new full blocks are
        not hashed (their K/V is still to arrive: `cache_blocks` once it has). Returns False,
        changing nothing, when the pool has too few free blocks."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks and not computed_blocks:
            # The usual decode step: the slots fit the blocks held, and the block written first
            # is the request's own (or starts empty). No block moves; at most one fills.
            num_computed = request.num_computed_tokens
            num_end = num_computed + num_new_tokens
            if num_end + num_lookahead <= len(blocks) * self.block_size and (
                not self._needs_copy_on_write(blocks, num_computed, num_new_tokens + num_lookahead)
            ):
                if self.enable_prefix_caching and cache:
                    self._cache_full_blocks(request, blocks, num_end)
                return True
        if blocks is None:
            blocks = self.req_blocks[request.request_id] = []
        num_computed, num_needed, needs_cow, num_taken = self._demand(
            blocks, request, num_new_tokens + num_lookahead, computed_blocks
        )
        if num_taken > self.num_free_blocks:
            return False
        for block in computed_blocks:
            if block.ref_count == 0:
                del self.free_blocks[block.block_id]
            block.ref_count += 1
            blocks.append(block)
        if needs_cow:
            self._copy_on_write(blocks)
        for _ in range(num_needed):
            blocks.append(self._pop_free_block())
        if self.enable_prefix_caching and cache:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hashes the request's blocks that are full within its first `num_tokens` tokens (K/V
        that arrived from elsewhere) into the prefix cache."""
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, self.req_blocks[request.request_id], num_tokens)

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = ()
    ) -> bool:
        """Whether `allocate_slots` with these arguments would succeed now; changes nothing."""
        blocks = self.req_blocks.get(request.request_id, [])
        num_taken = self._demand(blocks, request, num_new_tokens, computed_blocks)[3]
        return num_taken <= self.num_free_blocks

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Gives back the blocks past the first `num_tokens` slots of `request` (the slots of
        rejected speculative tokens). Only blocks of final tokens were ever hashed, so a given-back
        block carries no hash."""
        blocks = self.req_blocks[request.request_id]
        keep = self.blocks_needed(num_tokens)
        for block in reversed(blocks[keep:]):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release(block)
        del blocks[keep:]

    def _release(self, block: KVBlock) -> None:
        """A block nobody holds back into the free list. One the prefix cache can hit goes to the
        tail (the least recently freed is evicted first); one it cannot (a partial block, any
        block with prefix caching off, a rejected speculative one, a copy of a block cached
        already) to the head, so that the next allocation takes it before a block never written:
        on CPU the KV pool's pages are faulted in (zeroed by the kernel, and on some VMs backed by
        the hypervisor) the first time they are written, and a pool that cycles through every
        block pays that across its whole size however little of it the load needs."""
        self.free_blocks[block.block_id] = block
        if block.block_hash is None or self.cached_blocks.get(block.block_hash) is not block:
            self.free_blocks.move_to_end(block.block_id, last=False)

    def _demand(
        self,
        blocks: list[KVBlock],
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock],
    ) -> tuple[int, int, bool, int]:
        """(tokens computed with the hits, new blocks to pop, whether the last block must be
        copied on write, blocks taken from the free list in all)."""
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens) - len(blocks)
        num_needed = max(num_needed - len(computed_blocks), 0)
        needs_cow = self._needs_copy_on_write(blocks, num_computed, num_new_tokens)
        # Hits sitting in the free list are taken out of it, so they count against free space.
        num_hits_free = (
            sum(1 for b in computed_blocks if b.ref_count == 0) if computed_blocks else 0
        )
        return num_computed, num_needed, needs_cow, num_needed + num_hits_free + needs_cow

    def _needs_copy_on_write(self, blocks: list[KVBlock], num_computed: int, num_new: int) -> bool:
        if num_new == 0 or num_computed % self.block_size == 0:
            return False
        return blocks[num_computed // self.block_size].ref_count > 1

    def _copy_on_write(self, blocks: list[KVBlock]) -> None:
        shared = blocks[-1]
        copy = self._pop_free_block()
        shared.ref_count -= 1
        blocks[-1] = copy
        self.pending_copies.append((shared.block_id, copy.block_id))

    def _pop_free_block(self) -> KVBlock:
        _, block = self.free_blocks.popitem(last=False)
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Registers the blocks that are full once `num_tokens` are computed."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.req_num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            block = blocks[i]
            if block.block_hash is None:
                block.block_hash = hashes[i]
                self.cached_blocks.setdefault(hashes[i], block)
        self.req_num_hashed_blocks[request.request_id] = num_full

    # ---- release and sharing -------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Drops `request`'s hold on its blocks; blocks nobody holds go back to the free list:
        cached ones to its tail, the request's last block first so that its prefix stays cached
        longest; uncached ones (`_release`) to its head."""
        for block in reversed(self.req_blocks.pop(request.request_id, [])):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release(block)
        self.req_block_hashes.pop(request.request_id, None)
        self.req_num_hashed_blocks.pop(request.request_id, None)

    def fork(self, parent: Request, child: Request) -> None:
        blocks = self.req_blocks[parent.request_id]
        for block in blocks:
            block.ref_count += 1
        self.req_blocks[child.request_id] = list(blocks)
        self.req_block_hashes[child.request_id] = list(
            self.req_block_hashes.get(parent.request_id, [])
        )
        self.req_num_hashed_blocks[child.request_id] = self.req_num_hashed_blocks.get(
            parent.request_id, 0
        )

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash of free blocks (for benchmarks that must start cold)."""
        for block in self.free_blocks.values():
            if block.block_hash is not None:
                self.cached_blocks.pop(block.block_hash, None)
                block.block_hash = None

    # ---- invariants (tests) --------------------------------------------------------------
    def check_invariants(self) -> None:
        holders = [0] * self.num_blocks
        for blocks in self.req_blocks.values():
            for block in blocks:
                holders[block.block_id] += 1
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (block, holders[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks), block
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, block

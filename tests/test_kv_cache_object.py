"""KVCache: a request's blocks read and written as data (whole or layer by layer), and the
copy-on-write block copy, against plain tensor indexing."""

from __future__ import annotations

import pytest
import torch

from quire.worker.kv_cache import KVBlocks, KVCache

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 10, 4, 2, 8


def random_cache(seed: int, dtype: torch.dtype = torch.bfloat16) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return KVCache(
        [
            (
                torch.randn(shape, generator=gen).to(dtype),
                torch.randn(shape, generator=gen).to(dtype),
            )
            for _ in range(NUM_LAYERS)
        ]
    )


def test_allocate_gives_zeroed_layers_of_the_documented_shape():
    cache = KVCache.allocate(
        NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu"
    )
    assert cache.num_layers == NUM_LAYERS
    for k, v in cache.layers:
        assert k.shape == v.shape == (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        assert k.dtype == torch.bfloat16 and not k.any() and not v.any()
    assert cache.nbytes == 2 * NUM_LAYERS * NUM_BLOCKS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2


def test_read_blocks_holds_each_layers_k_then_v_in_block_order():
    cache = random_cache(0)
    blocks = cache.read_blocks([7, 2, 5])
    assert blocks.data.shape == (NUM_LAYERS, 2, 3, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    for layer, (k, v) in enumerate(cache.layers):
        for i, block in enumerate([7, 2, 5]):
            assert torch.equal(blocks.data[layer, 0, i], k[block])
            assert torch.equal(blocks.data[layer, 1, i], v[block])
    assert blocks.nbytes == NUM_LAYERS * 2 * 3 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2


def test_blocks_move_between_caches_into_other_block_ids():
    source, target = random_cache(0), random_cache(1)
    untouched = [(k.clone(), v.clone()) for k, v in target.layers]
    target.write_blocks([0, 9, 4], source.read_blocks([7, 2, 5]))
    for (k, v), (src_k, src_v), (old_k, old_v) in zip(target.layers, source.layers, untouched):
        assert torch.equal(k[[0, 9, 4]], src_k[[7, 2, 5]])
        assert torch.equal(v[[0, 9, 4]], src_v[[7, 2, 5]])
        others = [b for b in range(NUM_BLOCKS) if b not in (0, 9, 4)]
        assert torch.equal(k[others], old_k[others]) and torch.equal(v[others], old_v[others])


def test_blocks_move_layer_by_layer():
    source, target = random_cache(0), random_cache(1)
    for layer in range(NUM_LAYERS):
        target.write_blocks(
            [3, 1], source.read_blocks([6, 8], range(layer, layer + 1)), range(layer, layer + 1)
        )
    for (k, v), (src_k, src_v) in zip(target.layers, source.layers):
        assert torch.equal(k[[3, 1]], src_k[[6, 8]]) and torch.equal(v[[3, 1]], src_v[[6, 8]])


@pytest.mark.parametrize(
    "blocks",
    [
        KVBlocks(
            torch.zeros(NUM_LAYERS, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        ),
        KVBlocks(
            torch.zeros(NUM_LAYERS, 2, 3, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.float32)
        ),
        KVBlocks(torch.zeros(NUM_LAYERS, 2, 3, BLOCK_SIZE, 1, HEAD_DIM, dtype=torch.bfloat16)),
    ],
    ids=["block-count", "dtype", "kv-heads"],
)
def test_blocks_that_do_not_fit_are_a_value_error(blocks):
    with pytest.raises(ValueError, match="do not fit"):
        random_cache(0).write_blocks([1, 2, 3], blocks)


def test_copy_blocks_duplicates_each_source_block_into_its_destination_in_every_layer():
    cache = random_cache(0)
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    cache.copy_blocks([(1, 6), (3, 0)])
    for (k, v), (old_k, old_v) in zip(cache.layers, before):
        assert torch.equal(k[6], old_k[1]) and torch.equal(k[0], old_k[3])
        assert torch.equal(v[6], old_v[1]) and torch.equal(v[0], old_v[3])
        assert torch.equal(k[1], old_k[1]) and torch.equal(k[2], old_k[2])

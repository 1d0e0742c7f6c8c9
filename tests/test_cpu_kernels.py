"""The C paged-decode kernel equals the PyTorch gather + SDPA reference."""

from __future__ import annotations

import pytest
import torch
from conftest import load_model_alone

from quire.attention.backend import AttentionMetadata
from quire.attention.torch_backend import gathered_decode
from quire.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no C compiler")


def decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    block_tables = perm.view(len(seq_lens), max_blocks).int()
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=lens,
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(len(seq_lens) + 1)),
        seq_lens_cpu=list(seq_lens),
        num_decodes=len(seq_lens),
        num_decode_tokens=len(seq_lens),
    )
    return query, k_cache, v_cache, metadata


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3), (12, 1), (64, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_decode_matches_gathered_reference_in_float32(
    num_heads, num_kv_heads, head_dim, block_size
):
    seq_lens = [1, 7, 16, 33, 100]  # ragged, partial last blocks, a one-token context
    q, k, v, meta = decode_case(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32
    )
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, scale)
    ref = gathered_decode(q, k, v, meta, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_paged_decode_matches_gathered_reference_in_bfloat16():
    q, k, v, meta = decode_case([5, 64, 300], 9, 3, 64, 16, torch.bfloat16)
    out = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
    ref = gathered_decode(q.float(), k.float(), v.float(), meta, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_unsupported_dtype_is_reported_so_the_backend_falls_back():
    assert not cpu_kernels.supports_paged_decode(torch.float16, 8, 2, 64)
    assert not cpu_kernels.supports_paged_decode(torch.float32, 128, 8, 64)  # > 64 heads


def test_loading_the_kernels_keeps_subnormal_floats_for_the_whole_process():
    cpu_kernels.load_library()
    assert torch.tensor(1e-40, dtype=torch.float32).item() != 0.0


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 9])  # one KV head per task, then whole requests
def test_paged_decode_is_the_same_whatever_the_task_split(num_seqs):
    seq_lens = [5 + 11 * i for i in range(num_seqs)]
    q, k, v, meta = decode_case(seq_lens, 8, 2, 64, 16, torch.float32, seed=num_seqs)
    out = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, gathered_decode(q, k, v, meta, 0.125), atol=1e-5, rtol=1e-5)


def bf16_reference(q, k, v, meta, scale):
    """The float32 reference over the same bfloat16 inputs, rounded to bfloat16 like the kernel."""
    return gathered_decode(q.float(), k.float(), v.float(), meta, scale).to(torch.bfloat16)


# bfloat16 with head_dim a multiple of 32 runs the AVX-512 path where the CPU has it (16 tokens
# per step, register tiles of up to 4 heads x 64 dims); 80 and 48 take the portable code.
@pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (16, 8), (32, 4), (64, 8)]
)  # groups 1, 3, 4, 2, 8, 8
@pytest.mark.parametrize("head_dim", [64, 128, 96, 256, 80, 48])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_matches_gathered_reference_in_bfloat16_for_many_shapes(
    num_heads, num_kv_heads, head_dim, block_size
):
    seq_lens = [1, 15, 17, 1000, 33]  # partial chunks and blocks, one token, a long context
    q, k, v, meta = decode_case(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=head_dim
    )
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, scale)
    torch.testing.assert_close(out, bf16_reference(q, k, v, meta, scale), atol=1e-4, rtol=1.6e-2)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 128])  # chunks spanning several blocks
def test_paged_decode_bfloat16_with_any_block_size(block_size):
    q, k, v, meta = decode_case([3, 40, 129, 257], 8, 2, 64, block_size, torch.bfloat16, seed=7)
    out = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, bf16_reference(q, k, v, meta, 0.125), atol=1e-4, rtol=1.6e-2)


def test_paged_decode_bfloat16_batch_mixing_short_and_long_contexts():
    seq_lens = [1, 2000, 2, 16, 1500, 31, 1, 999, 64, 3, 700, 17]
    q, k, v, meta = decode_case(seq_lens, 9, 3, 64, 16, torch.bfloat16, seed=3)
    out = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, bf16_reference(q, k, v, meta, 0.125), atol=1e-4, rtol=1.6e-2)


def test_paged_decode_bfloat16_with_scores_growing_along_the_context():
    # Keys scaled up with their position (to 32x at the end): the running max moves in almost
    # every chunk, the rescaling of the accumulator and of the sum must keep up, and early
    # numerators underflow to 0.
    block_size = 16
    q, k, v, meta = decode_case([300, 37], 8, 2, 64, block_size, torch.bfloat16, seed=11)
    growth = torch.zeros(k.shape[:2])
    for i, n in enumerate(meta.seq_lens_cpu):
        positions = torch.arange(meta.block_tables.shape[1] * block_size).view(-1, block_size)
        growth[meta.block_tables[i].long()] = 32.0 * positions / n
    k = (k.float() * growth[:, :, None, None]).to(torch.bfloat16)
    out = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, bf16_reference(q, k, v, meta, 0.125), atol=1e-4, rtol=1.6e-2)


@pytest.mark.parametrize("growth_scale", [0.0, 32.0, -32.0])
def test_paged_decode_bfloat16_merges_context_partitions(growth_scale):
    # Contexts over 512 positions are split into partitions of at most 512 (the context's chunks
    # shared out equally: 513 positions are 272 + 241) whose partial softmaxes are merged:
    # lengths on either side of the boundaries, and scores that grow (or shrink) along the
    # context so that the partitions' maxima differ by a lot and the merge must rescale.
    block_size = 16
    seq_lens = [511, 512, 513, 1024, 1025, 1600, 2047]
    q, k, v, meta = decode_case(seq_lens, 9, 3, 64, block_size, torch.bfloat16, seed=13)
    growth = torch.ones(k.shape[:2])
    for i, n in enumerate(meta.seq_lens_cpu):
        positions = torch.arange(meta.block_tables.shape[1] * block_size).view(-1, block_size)
        growth[meta.block_tables[i].long()] = 1.0 + growth_scale * positions / n
    k = (k.float() * growth[:, :, None, None]).to(torch.bfloat16)
    out = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, bf16_reference(q, k, v, meta, 0.125), atol=1e-4, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_paged_decode_gives_zeros_for_empty_contexts(dtype, head_dim):
    q, k, v, meta = decode_case([0, 20, 0, 5], 9, 3, head_dim, 16, dtype, seed=5)
    out = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert out[[1, 3]].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (16, 8)])
def test_paged_decode_results_are_bitwise_the_same_whatever_the_task_split(
    dtype, head_dim, num_heads, num_kv_heads
):
    # A batch of 9 runs one task per request (with up to 4 threads); fewer requests run tasks
    # over narrower ranges of KV heads (one head, or 2 or 4 of 8). All must give the same bits.
    seq_lens = [1, 15, 17, 100, 333, 16, 64, 2, 1000]
    q, k, v, meta = decode_case(
        seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype, seed=head_dim
    )
    batch = cpu_kernels.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
    for size in (1, 2):
        for i in range(0, len(seq_lens) - size + 1, size):
            part = cpu_kernels.paged_decode(
                q[i : i + size],
                k,
                v,
                meta.block_tables[i : i + size],
                meta.seq_lens[i : i + size],
                0.125,
            )
            assert torch.equal(part, batch[i : i + size])


def test_an_engine_with_cpu_kernels_off_runs_without_the_library(tiny_llama, kernel_settings):
    from quire import LLM, SamplingParams
    from quire.layers.linear import PackedLinear

    llm = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=16, cpu_kernels=False)
    assert cpu_kernels.load_library() is None
    stats = llm.stats()
    assert (stats.c_decode_step, stats.gemv_path, stats.qmatmul_path) == (False, "off", "off")
    model = load_model_alone(tiny_llama, dtype="bfloat16", cpu_kernels=False)
    assert all(m.gemv_weight is None for m in model.modules() if isinstance(m, PackedLinear))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_bf16_rows_are_stored_at_their_slots_as_index_copy_stores_them():
    """The C store (kv_quant.c) takes K and V as the qkv buffer holds them: strided tokens, one
    contiguous run of heads each; slots anywhere in the pool, in any order."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 4 + 2 * 2, 64, generator=gen).bfloat16()  # 4 query, 2 KV heads
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([33, 0, 17, 5, 63, 40, 18])
    caches = [torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16) for _ in range(4)]
    cpu_kernels.store_kv(key, value, caches[0], caches[1], slots)
    for cache, rows in ((caches[2], key), (caches[3], value)):
        cache.view(64, 2, 64).index_copy_(0, slots, rows)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])

"""The C paged-decode kernel equals the PyTorch gather + SDPA reference."""

from __future__ import annotations

import pytest
import torch

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

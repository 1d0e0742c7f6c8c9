"""The C prefill-attention kernel equals SDPA over the gathered cache (`gathered_prefill`), in
each loop it has (AVX2, built for x86-64-v3 on any host; AVX-512 BF16 and AMX tiles where this
CPU has them), and a query row's bits depend on nothing but the row and its context."""

from __future__ import annotations

import pytest
import torch
from conftest import use_amx_order

from quire import envs
from quire.attention.backend import AttentionMetadata
from quire.attention.torch_backend import TorchAttentionBackend, gathered_prefill
from quire.kernels import cpu as cpu_kernels
from quire.kernels.cpu import gemv

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no C compiler")

LOOPS = ("off", "avx2", "avx512-bf16")  # prefill_attention_path() of the C library: 0, 1, 2


def native_loop() -> str:
    """The loop this CPU's own build (-march=native) runs where AMX is off."""
    return LOOPS[cpu_kernels.build_library(cpu_kernels._SOURCE_DIR).prefill_attention_path()]


@pytest.fixture(scope="module")
def avx2_library():
    """The kernels built for x86-64-v3 (AVX2 and FMA, no AVX-512): the AVX2 loop, on any host."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(envs, "QUIRE_CPU_MARCH", "x86-64-v3")
        lib = cpu_kernels.build_library.__wrapped__(cpu_kernels._SOURCE_DIR)
    assert lib is not None and lib.prefill_attention_path() == 1
    return lib


@pytest.fixture(params=["avx2", "avx512-bf16", "amx"])
def order(request, kernel_settings, monkeypatch) -> str:
    """Each loop the kernel has: the AVX2 one from an x86-64-v3 build where this CPU's build
    runs another; AVX-512 BF16 and AMX where this CPU has them, set as EngineConfig.cpu_amx sets
    it."""
    if request.param == "avx2":
        use_amx_order(False)
        if native_loop() != "avx2":
            lib = request.getfixturevalue("avx2_library")
            monkeypatch.setattr(cpu_kernels, "load_library", lambda: lib)
    elif native_loop() != "avx512-bf16":
        pytest.skip(f"no AVX-512 BF16 on this CPU (its loop: {native_loop()})")
    else:
        use_amx_order(request.param == "amx")
    assert cpu_kernels.prefill_attention_path() == request.param
    return request.param


def make_step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """A step over a shuffled paged cache; requests with query_len 1 first count as decodes."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    perm = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    block_tables = perm.view(len(seq_lens), max_blocks).int()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen).bfloat16()
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
    )
    return query, k_cache, v_cache, metadata


def reference(query, k_cache, v_cache, metadata, scale) -> torch.Tensor:
    """SDPA in float32 on the bf16 inputs, prefill rows only."""
    out = torch.zeros(query.shape)
    gathered_prefill(query.float(), k_cache.float(), v_cache.float(), metadata, scale, out)
    return out[metadata.num_decode_tokens :]


def run_kernel(query, k_cache, v_cache, metadata, scale) -> torch.Tensor:
    out = torch.zeros_like(query)
    cpu_kernels.prefill_attention(
        query,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale,
        out,
    )
    return out


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 8, 128)]
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prompts_and_chunks_over_cached_prefixes_match_sdpa(
    order, num_heads, num_kv_heads, head_dim, block_size
):
    # Several requests in one call: whole prompts (prefix 0) and chunks after prefixes that are
    # not multiples of the block size, query_len from 1 to 300.
    query_lens = [300, 1, 37, 64, 5, 129]
    prefixes = [0, 0, 21, 100, 250, 3]
    seq_lens = [q + p for q, p in zip(query_lens, prefixes, strict=True)]
    q, k, v, meta = make_step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    out = run_kernel(q, k, v, meta, scale)
    err = (out.float() - reference(q, k, v, meta, scale)).abs().max().item()
    assert err <= 2e-2


@pytest.mark.parametrize("head_dim", [32, 80, 256])
def test_other_head_dims(order, head_dim):
    if head_dim == 80 and order != "avx2":  # AVX-512: 32, 64, 128, 256 only
        assert not cpu_kernels.supports_prefill_attention(torch.bfloat16, 4, 1, head_dim)
        return
    assert cpu_kernels.supports_prefill_attention(torch.bfloat16, 4, 1, head_dim)
    q, k, v, meta = make_step([40, 7], [40, 90], 4, 1, head_dim, 16, seed=1)
    out = run_kernel(q, k, v, meta, 0.1)
    assert (out.float() - reference(q, k, v, meta, 0.1)).abs().max().item() <= 2e-2


def test_backend_prefill_after_decodes_in_a_mixed_step():
    """The backend hands the kernel only the prefill part of a mixed step, through a strided
    query view like the attention layer's split of q and k."""
    query_lens, seq_lens = [1, 1, 50, 17], [30, 70, 50, 60]
    q, k, v, meta = make_step(query_lens, seq_lens, 9, 3, 64, 16, seed=2)
    query = torch.cat([q, torch.zeros(q.shape[0], 3, 64, dtype=q.dtype)], dim=1)[:, :9]
    out = torch.zeros_like(q)
    TorchAttentionBackend()._prefill(query, k, v, meta, 0.125, out)
    assert (out.float()[2:] - reference(q, k, v, meta, 0.125)).abs().max().item() <= 2e-2
    assert not out[:2].any()  # the decode rows are not the prefill path's


def test_results_do_not_depend_on_the_thread_count(order):
    # Fewer threads, longer query tiles per task (32 tokens on one thread, 8 on two here): the
    # rows are independent, so the results are bit for bit the same.
    q, k, v, meta = make_step([100], [130], 4, 1, 64, 16, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_kernel(q, k, v, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(run_kernel(q, k, v, meta, 0.125), one, atol=0, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_rows_bits_do_not_depend_on_its_chunk(order, head_dim):
    """The same query rows computed as part of a whole prompt, as a chunk after a cached prefix
    (other row blocks, other key counts per block), and beside another request give the same
    bits: the key tiles start at position 0 whatever the chunk, and a row adds nothing for the
    keys it does not see."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, meta = make_step([203], [203], 6, 2, head_dim, 16, seed=4)
    whole = run_kernel(q, k, v, meta, 0.1)
    for start in (1, 37, 64, 150, 202):
        _, _, _, chunk = make_step([203 - start], [203], 6, 2, head_dim, 16, seed=4)
        chunk.block_tables = meta.block_tables  # the same cache
        out = run_kernel(q[start:].contiguous(), k, v, chunk, 0.1)
        assert torch.equal(out, whole[start:]), start
    other = torch.randn(40, 6, head_dim, generator=gen).bfloat16()
    mixed = make_step([40, 203 - 90], [60, 203], 6, 2, head_dim, 16, seed=4)[3]
    mixed.block_tables = torch.cat([meta.block_tables.flip(1), meta.block_tables])
    out = run_kernel(torch.cat([other, q[90:]]).contiguous(), k, v, mixed, 0.1)
    assert torch.equal(out[40:], whole[90:])


def test_the_amx_order_runs_where_the_matmul_uses_amx(kernel_settings):
    for amx in (False, True):
        cpu_kernels.configure(cpu_kernels.KernelSettings(enabled=True, gemv_fma=None, amx=amx))
        expected = "amx" if amx and gemv.amx_available() else native_loop()
        assert cpu_kernels.prefill_attention_path() == expected


def test_unsupported_cases_fall_back(order):
    assert not cpu_kernels.supports_prefill_attention(torch.float32, 8, 2, 64)
    assert not cpu_kernels.supports_prefill_attention(torch.float16, 8, 2, 64)
    assert not cpu_kernels.supports_prefill_attention(torch.bfloat16, 8, 2, 84)
    assert not cpu_kernels.supports_prefill_attention(torch.bfloat16, 8, 2, 264)
    assert not cpu_kernels.supports_prefill_attention(torch.bfloat16, 64, 1, 64)  # group > 32
    q, k, v, meta = make_step([10], [5], 4, 1, 64, 16)  # seq_len shorter than the chunk
    with pytest.raises(ValueError):
        run_kernel(q, k, v, meta, 0.125)

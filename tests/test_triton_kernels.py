"""The Triton attention kernels against a float64 reference, and the Triton backend against torch.

Without CUDA the kernels run in Triton's interpreter on small shapes; the tests marked `gpu` run
real shapes in bf16 and skip here. Unused cache slots (the tail of each request's last block, the
block that padded block-table entries point to) hold NaN, so any read past `seq_len` shows up.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, at import

pytest.importorskip("triton")

from quire.attention.backend import AttentionMetadata  # noqa: E402
from quire.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from quire.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from quire.kernels.paged_decode import _paged_decode_kernel, paged_decode  # noqa: E402
from quire.kernels.prefill_paged import prefill_paged  # noqa: E402
from quire.kernels.store_kv import store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(_paged_decode_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "quire.kernels was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (atol, rtol) per dtype. bf16 keeps 8 significant bits: rounding the output alone moves it by up
# to 2^-9 of its value, P is rounded to bf16 before the P @ V dot on GPU, and two bf16 backends
# can land two ulps (2^-7 relative) apart.
TOLERANCE = {
    torch.float32: (1e-5, 0.0),
    torch.float16: (2e-3, 0.0),
    torch.bfloat16: (1e-2, 1e-2),
}

# (num_heads, num_kv_heads): GQA group sizes 1, 2, 4, 8 and 3.
HEAD_LAYOUTS = [(4, 4), (8, 4), (8, 2), (8, 1), (6, 2)]


class PagedCache:
    """A KV cache whose requests own shuffled blocks; block 0 and unused slots hold NaN."""

    def __init__(
        self,
        seq_lens: list[int],
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = 1 + sum(blocks_per_seq) + 2  # block 0 is the padding target; 2 spare
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        owned = (torch.randperm(num_blocks - 1) + 1).tolist()
        self.block_tables = torch.zeros(
            len(seq_lens), max(blocks_per_seq + [1]), dtype=torch.int32, device=DEVICE
        )
        for i, n in enumerate(blocks_per_seq):
            self.block_tables[i, :n] = torch.tensor(owned[:n], dtype=torch.int32)
            owned = owned[n:]
        self.seq_lens = seq_lens
        self.block_size = block_size

    def slots(self, seq: int, start: int, end: int) -> torch.Tensor:  # [end - start] int64
        positions = torch.arange(start, end, device=DEVICE)
        blocks = self.block_tables[seq, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def fill_context(self) -> None:
        """Writes random K/V at every position `[0, seq_len)` of every request."""
        flat_k = self.k_cache.flatten(0, 1)
        flat_v = self.v_cache.flatten(0, 1)
        for i, seq_len in enumerate(self.seq_lens):
            slots = self.slots(i, 0, seq_len)
            flat_k[slots] = torch.randn_like(flat_k[slots])
            flat_v[slots] = torch.randn_like(flat_v[slots])


def reference_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cache: PagedCache,
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] float64
    """Each request's new tokens (the last `query_len` of its context) attend causally, in fp64."""
    out = torch.empty(query.shape, dtype=torch.float64, device=DEVICE)
    group_size = query.shape[1] // cache.k_cache.shape[2]
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens, cache.seq_lens)):
        slots = cache.slots(i, 0, seq_len)
        k = cache.k_cache.flatten(0, 1)[slots].double().repeat_interleave(group_size, dim=1)
        v = cache.v_cache.flatten(0, 1)[slots].double().repeat_interleave(group_size, dim=1)
        q = query[start : start + query_len].double()  # [Q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=DEVICE)
        k_pos = torch.arange(seq_len, device=DEVICE)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start : start + query_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += query_len
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def make_metadata(query_lens: list[int], cache: PagedCache, num_decodes: int) -> AttentionMetadata:
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    slot_mapping = torch.cat(
        [cache.slots(i, s - q, s) for i, (q, s) in enumerate(zip(query_lens, cache.seq_lens))]
    )
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(cache.seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=cache.block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(cache.seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=list(cache.seq_lens),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
    )


def run_decode(
    seq_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_seq_len: int | None = None,
    partition_size: int | None = None,
) -> None:
    """Checks paged_decode against the reference on random data."""
    torch.manual_seed(0)
    cache = PagedCache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    cache.fill_context()
    query = 2 * torch.randn(len(seq_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    out = paged_decode(
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        scale,
        max_seq_len or max(seq_lens),
        partition_size=partition_size,
    )
    assert out.dtype == dtype
    assert_close(out, reference_attention(query, cache, [1] * len(seq_lens), scale), dtype)


def run_prefill(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    """Checks prefill_paged against the reference on random data."""
    torch.manual_seed(0)
    cache = PagedCache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    cache.fill_context()
    query = 2 * torch.randn(sum(query_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    metadata = make_metadata(query_lens, cache, num_decodes=0)
    scale = head_dim**-0.5
    out = prefill_paged(
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale,
        metadata.max_query_len,
    )
    assert out.dtype == dtype
    assert_close(out, reference_attention(query, cache, query_lens, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (3, 128)])
def test_store_kv_writes_each_token_to_its_slot(num_kv_heads, head_dim, dtype):
    torch.manual_seed(0)
    k_cache = torch.zeros(6, 16, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(20, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    value = torch.randn_like(key)
    slot_mapping = torch.randperm(6 * 16, device=DEVICE)[:20]

    store_kv(key, value, k_cache, v_cache, slot_mapping)

    expected_k = torch.zeros_like(k_cache).flatten(0, 1)
    expected_v = torch.zeros_like(v_cache).flatten(0, 1)
    expected_k[slot_mapping] = key
    expected_v[slot_mapping] = value
    assert torch.equal(k_cache.flatten(0, 1), expected_k)
    assert torch.equal(v_cache.flatten(0, 1), expected_v)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 8, 2, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 2, 64, device=DEVICE)
    value = 2 * torch.ones(3, 2, 64, device=DEVICE)

    store_kv(key, value, k_cache, v_cache, torch.tensor([-1, 9, -1], device=DEVICE))

    written = torch.zeros(16, dtype=torch.bool)
    written[9] = True
    assert torch.equal(k_cache.flatten(0, 1)[:, 0, 0].cpu(), written.float())
    assert torch.equal(v_cache.flatten(0, 1)[:, 0, 0].cpu(), 2 * written.float())


def test_store_kv_reads_strided_key_and_value():
    """K and V may be column slices of the fused QKV projection."""
    qkv = torch.randn(5, 3, 2, 64, device=DEVICE)  # [num_tokens, (q, k, v), num_kv_heads, D]
    key, value = qkv[:, 1], qkv[:, 2]
    k_cache = torch.zeros(1, 8, 2, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)

    store_kv(key, value, k_cache, v_cache, torch.arange(5, device=DEVICE))

    assert torch.equal(k_cache[0, :5], key)
    assert torch.equal(v_cache[0, :5], value)


# Context lengths: a single token, exactly one 16-token block, partial last blocks.
DECODE_SEQ_LENS = [1, 16, 37, 100]


@pytest.mark.parametrize("partition_size", [None, 32], ids=["one_partition", "split"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (8, 128)])
def test_paged_decode_matches_reference_fp32(
    block_size, head_dim, num_heads, num_kv_heads, partition_size
):
    run_decode(
        DECODE_SEQ_LENS,
        block_size,
        num_heads,
        num_kv_heads,
        head_dim,
        torch.float32,
        partition_size=partition_size,
    )


def test_paged_decode_ignores_partitions_past_every_context():
    """`max_seq_len` is only a bound: partitions beyond a request's context are skipped."""
    run_decode(DECODE_SEQ_LENS, 16, 8, 2, 64, torch.float32, 200, partition_size=32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paged_decode_matches_reference_low_precision(dtype):
    run_decode(DECODE_SEQ_LENS, 16, 8, 2, 128, dtype, partition_size=32)


@pytest.mark.parametrize("head_dim", [16, 96, 256])
def test_paged_decode_other_head_dims(head_dim):
    """The smallest dot size, a head_dim that is not a power of two, the largest head_dim."""
    run_decode(DECODE_SEQ_LENS, 16, 8, 2, head_dim, torch.float32, partition_size=32)


@pytest.mark.parametrize("partition_size", [None, 32], ids=["one_partition", "split"])
def test_paged_decode_empty_context_gives_zeros(partition_size):
    """A padded request (seq_len 0) reads nothing and outputs zeros."""
    k_cache = torch.randn(4, 16, 2, 64, device=DEVICE)
    query = torch.randn(2, 4, 64, device=DEVICE)
    block_tables = torch.tensor([[1, 2, 3], [0, 0, 0]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)

    out = paged_decode(
        query, k_cache, k_cache, block_tables, seq_lens, 0.125, 40, partition_size=partition_size
    )

    assert torch.equal(out[1], torch.zeros_like(out[1]))


# A fresh 70-token prompt (more than one query block for every group size), a chunk after an
# unaligned prefix, a one-token chunk after a prefix longer than a KV tile, a chunk after a
# prefix that ends on a tile boundary.
PREFILL_QUERY_LENS = [70, 20, 1, 9]
PREFILL_SEQ_LENS = [70, 57, 91, 73]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_LAYOUTS)
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (8, 128)])
def test_prefill_paged_matches_reference_fp32(block_size, head_dim, num_heads, num_kv_heads):
    run_prefill(
        PREFILL_QUERY_LENS,
        PREFILL_SEQ_LENS,
        block_size,
        num_heads,
        num_kv_heads,
        head_dim,
        torch.float32,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_prefill_paged_matches_reference_low_precision(dtype):
    run_prefill(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 16, 8, 2, 128, dtype)


@pytest.mark.parametrize("head_dim", [16, 96, 256])
def test_prefill_paged_other_head_dims(head_dim):
    run_prefill(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 16, 8, 2, head_dim, torch.float32)


def run_backends(
    query_lens: list[int],
    seq_lens: list[int],
    num_decodes: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    """Runs one step through both backends: same caches after it, outputs within tolerance."""
    torch.manual_seed(0)
    cache = PagedCache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    cache.fill_context()  # the prefix; the step overwrites its new tokens' slots
    # Torch's decode masks scores, not values, so a NaN slot would poison its output.
    cache.k_cache.nan_to_num_(0.0)
    cache.v_cache.nan_to_num_(0.0)
    metadata = make_metadata(query_lens, cache, num_decodes)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    value = torch.randn_like(key)
    scale = head_dim**-0.5

    caches = {}
    outputs = {}
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        k_cache, v_cache = cache.k_cache.clone(), cache.v_cache.clone()
        outputs[backend.name] = backend.forward(
            query, key, value, k_cache, v_cache, metadata, scale
        )
        caches[backend.name] = k_cache, v_cache
    assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert torch.equal(caches["triton"][1], caches["torch"][1])
    assert_close(outputs["triton"], outputs["torch"], dtype)


# Three decodes, then a fresh prompt and a chunk after a cached prefix.
BATCHES = {
    "mixed": ([1, 1, 1, 23, 15], [5, 40, 77, 23, 48], 3),
    "decode_only": ([1, 1], [9, 33], 2),
    "prefill_only": ([23, 15], [23, 48], 0),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(4, 4, 16), (8, 2, 8)])
def test_triton_backend_matches_torch_backend(batch, num_heads, num_kv_heads, block_size):
    query_lens, seq_lens, num_decodes = BATCHES[batch]
    run_backends(
        query_lens, seq_lens, num_decodes, num_heads, num_kv_heads, 64, block_size, torch.float32
    )


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_paged_decode_real_shapes_gpu(head_dim):
    """Batch 64 with contexts up to 4k, GQA 4, bf16, partitions picked from the grid."""
    seq_lens = torch.randint(1, 4097, (64,)).tolist()
    seq_lens[0] = 4096
    run_decode(seq_lens, 16, 32, 8, head_dim, torch.bfloat16)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("partition_size", [128, 512])
def test_paged_decode_split_sizes_gpu(partition_size):
    seq_lens = torch.randint(1, 4097, (16,)).tolist()
    run_decode(seq_lens, 16, 32, 8, 128, torch.bfloat16, 4096, partition_size)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (32, 32), (28, 4)])
def test_prefill_paged_real_shapes_gpu(num_heads, num_kv_heads):
    """Prompt chunks of up to 2k tokens after prefixes of up to 2k, bf16."""
    query_lens = [2048, 512, 1000, 1, 77]
    seq_lens = [2048, 2560, 3000, 1500, 4000]
    run_prefill(query_lens, seq_lens, 16, num_heads, num_kv_heads, 128, torch.bfloat16)


@requires_cuda
@pytest.mark.gpu
def test_triton_backend_matches_torch_backend_gpu():
    decode_lens = torch.randint(1, 4097, (48,)).tolist()
    query_lens = [1] * 48 + [1024, 300]
    seq_lens = decode_lens + [1024, 2300]
    run_backends(query_lens, seq_lens, 48, 32, 8, 128, 16, torch.bfloat16)

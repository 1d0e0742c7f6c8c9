"""Huge-page arenas for the weights and the KV cache (worker/host_memory.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import in_process_model, make_llm
from torch import nn

from quire.sampling_params import SamplingParams
from quire.worker import host_memory


@pytest.fixture
def advise(monkeypatch):
    """Huge pages asked for whatever this machine's THP mode (madvise failing is harmless)."""
    monkeypatch.setattr(host_memory, "supported", lambda: True)


def storage_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.nbytes


def test_an_arena_starts_on_a_huge_page_and_carves_aligned_disjoint_tensors(advise):
    specs = [
        ((3, 5), torch.bfloat16),
        ((1000,), torch.float32),
        ((7,), torch.int8),
        ((2, 2), torch.int64),
    ]
    buffer = host_memory.arena(host_memory.arena_bytes(specs), huge_pages=True)
    assert buffer.data_ptr() % host_memory.HUGE_PAGE == 0
    tensors = host_memory.carve(buffer, specs)
    ranges = sorted(storage_range(t) for t in tensors)
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end <= start
    assert ranges[-1][1] <= buffer.data_ptr() + buffer.nbytes
    for t, (shape, dtype) in zip(tensors, specs, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 64 == 0
    zeros = host_memory.zeros(specs, huge_pages=True)
    assert all(torch.count_nonzero(t) == 0 for t in zeros)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4096, 128)  # 2 MiB float32
        self.head = nn.Linear(128, 4096, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("table", torch.randn(512, 1024))  # 2 MiB
        self.packed = torch.randn(300, 1024)  # a plain tensor attribute, 1.2 MB
        self.small = torch.randn(16, 16)  # under the threshold: stays
        base = torch.randn(1024, 1024)
        self.view = base[:512]  # a view into a larger tensor: stays, aliasing intact
        self.base = base


def test_moving_a_module_keeps_values_ties_and_views(advise):
    model = Model()
    before = {
        name: t.clone() for name, t in [*model.state_dict().items(), ("packed", model.packed)]
    }
    small, view, base = model.small, model.view, model.base
    moved = host_memory.move_to_huge_pages(model)
    assert moved == 4096 * 128 * 4 + 512 * 1024 * 4 + 300 * 1024 * 4 + 1024 * 1024 * 4
    assert model.head.weight is model.embed.weight  # still one Parameter
    assert isinstance(model.embed.weight, nn.Parameter)
    assert model.small is small and model.view is view
    # base moved (it is its whole storage); the view keeps pointing at the old one
    assert model.base is not base and torch.equal(model.base, base)
    for name, t in [*model.state_dict().items(), ("packed", model.packed)]:
        assert torch.equal(t, before[name]), name
    # the moved tensors share one storage, the first of them on a huge-page boundary
    moved_tensors = [model.embed.weight, model.table, model.packed, model.base]
    assert len({t.untyped_storage().data_ptr() for t in moved_tensors}) == 1
    assert min(t.data_ptr() for t in moved_tensors) % host_memory.HUGE_PAGE == 0


def test_nothing_moves_where_huge_pages_are_not_supported(monkeypatch):
    monkeypatch.setattr(host_memory, "supported", lambda: False)
    model = Model()
    embed = model.embed.weight.data
    assert host_memory.move_to_huge_pages(model) == 0
    assert model.embed.weight.data.data_ptr() == embed.data_ptr()


@pytest.mark.parametrize("huge_pages", [False, True])
def test_an_arena_is_advised_to_huge_pages_only_when_asked(advise, monkeypatch, huge_pages):
    advised: list[tuple[int, int, int]] = []
    monkeypatch.setattr(host_memory, "_madvise", lambda: lambda *call: advised.append(call) or 0)
    buffer = host_memory.arena(3 * host_memory.HUGE_PAGE, huge_pages)
    expected = [(buffer.data_ptr(), 3 * host_memory.HUGE_PAGE, 14)]  # 14: MADV_HUGEPAGE
    assert advised == (expected if huge_pages else [])


def test_the_engine_keeps_its_weights_where_they_are_without_huge_pages(tiny_llama, advise):
    llm = make_llm(tiny_llama, dtype="float32", huge_pages=False)
    model = in_process_model(llm).model
    big = [p for p in model.parameters() if p.nbytes >= 1 << 20]
    assert big and len({p.untyped_storage().data_ptr() for p in big}) == len(big)


def test_the_engine_gives_the_same_tokens_with_and_without_huge_pages(tiny_llama, advise):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 200, 17, 3]}, {"prompt_token_ids": [44] * 40}]
    llm = make_llm(tiny_llama, dtype="float32", huge_pages=True)
    runner = in_process_model(llm)
    caches = [t for layer in runner.kv_cache.layers for t in layer]
    # The whole KV cache is one zeroed arena: every layer's K and V share its storage.
    assert len({t.untyped_storage().data_ptr() for t in caches}) == 1
    assert all(torch.count_nonzero(t) == 0 for t in caches)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    off_llm = make_llm(tiny_llama, dtype="float32", huge_pages=False)
    off = [o.outputs[0].token_ids for o in off_llm.generate(prompts, params)]
    assert on == off
    assert all(len(t) == 12 for t in on)

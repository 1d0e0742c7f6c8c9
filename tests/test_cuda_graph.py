"""The CUDA-only parts of the worker: decode CUDA graphs and the profiled GPU KV pool size.

Their device-independent logic runs on CPU: the capture-size ladder, the padding of a decode batch
into the graphs' static buffers, and the padded forward a graph captures, run eagerly on the Triton
backend (in the interpreter without CUDA). The tests marked `gpu` capture and replay real graphs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import in_process_model, load_model_alone, make_adapter

from quire import LLM, LoRARequest, SamplingParams
from quire.attention.backend import AttentionMetadata
from quire.attention.forward_context import forward_context
from quire.attention.torch_backend import TorchAttentionBackend
from quire.config import EngineConfig, QuireConfig, resolve_config
from quire.worker import kv_cache
from quire.worker.cuda_graph import (
    CUDAGraphRunner,
    DecodeBuffers,
    capture_sizes,
    pad_decode_batch,
    padded_batch_size,
    use_cuda_graphs,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU_DEVICE = "cpu"

# Five prompts that stop one after another, so decode batches shrink 5, 4, 3, 2, 1.
PROMPT_LENS = (3, 17, 30, 9, 12)
MAX_TOKENS = (2, 3, 4, 5, 6)


def prompts_and_params() -> tuple[list[list[int]], list[SamplingParams]]:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in MAX_TOKENS]
    return prompts, params


def greedy_tokens(llm: LLM) -> list[list[int]]:
    prompts, params = prompts_and_params()
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# Triton runs on CPU tensors only in its interpreter, which conftest turns on where there is no
# GPU; on a GPU machine the Triton-backend tests below run on the GPU instead.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_llm(model: str, **kwargs) -> LLM:
    return LLM(
        **{"model": model, "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64, **kwargs}
    )


# ---- which batches replay which graph --------------------------------------------------------


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (4, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (12, [1, 2, 4, 8, 12]),
        (32, [1, 2, 4, 8, 16, 24, 32]),
    ],
)
def test_capture_sizes_are_1_2_4_then_multiples_of_8_up_to_max_num_seqs(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_stop_at_256():
    assert capture_sizes(1024) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(256) == capture_sizes(1024)


@pytest.mark.parametrize(
    ("batch_size", "expected"), [(1, 1), (3, 4), (4, 4), (5, 8), (12, 16), (16, 16), (17, None)]
)
def test_a_decode_batch_replays_the_smallest_captured_size_that_holds_it(batch_size, expected):
    assert padded_batch_size([1, 2, 4, 8, 16], batch_size) == expected


def test_cuda_graphs_are_used_on_cuda_with_triton_unless_enforce_eager(tiny_llama):
    def config(**kwargs) -> QuireConfig:
        return resolve_config(EngineConfig(model=tiny_llama, **kwargs))

    assert use_cuda_graphs(config(device="cuda"))
    assert not use_cuda_graphs(config(device="cuda", enforce_eager=True))
    assert not use_cuda_graphs(config(device="cuda", attention_backend="torch"))
    assert not use_cuda_graphs(config(device="cpu", attention_backend="triton"))


def test_a_cpu_runner_has_no_cuda_graphs(tiny_llama):
    assert not tiny_llm(tiny_llama, device="cpu").stats().cuda_graphs


# ---- the static buffers ----------------------------------------------------------------------


def decode_metadata(seq_lens: list[int], block_tables: list[list[int]]) -> AttentionMetadata:
    """A decode-only batch: one new token per request, at position seq_len - 1."""
    tables = torch.tensor(block_tables, dtype=torch.int32)
    positions = torch.tensor(seq_lens) - 1
    slots = tables[torch.arange(len(seq_lens)), positions // 16].long() * 16 + positions % 16
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(len(seq_lens) + 1)),
        seq_lens_cpu=seq_lens,
        num_decodes=len(seq_lens),
        num_decode_tokens=len(seq_lens),
    )


def test_fresh_buffers_are_all_padding():
    buffers = DecodeBuffers.allocate(4, 3, CPU_DEVICE)
    assert buffers.slot_mapping.tolist() == [-1] * 4
    assert buffers.seq_lens.tolist() == [0] * 4
    assert buffers.block_tables.tolist() == [[0] * 3] * 4
    assert buffers.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_pad_copies_the_batch_and_pads_up_to_the_captured_size():
    buffers = DecodeBuffers.allocate(8, 4, CPU_DEVICE)
    metadata = decode_metadata([20, 5, 33], [[7, 3, 0], [9, 0, 0], [4, 6, 1]])
    pad_decode_batch(
        buffers, torch.tensor([11, 12, 13]), torch.tensor([19, 4, 32]), metadata, padded_size=4
    )
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [19, 4, 32, 0]
    assert buffers.slot_mapping[:4].tolist() == [3 * 16 + 3, 9 * 16 + 4, 1 * 16 + 0, -1]
    assert buffers.seq_lens[:4].tolist() == [20, 5, 33, 0]
    assert buffers.block_tables[:4].tolist() == [[7, 3, 0, 0], [9, 0, 0, 0], [4, 6, 1, 0], [0] * 4]


def test_pad_turns_rows_left_from_a_larger_batch_back_into_padding():
    buffers = DecodeBuffers.allocate(8, 2, CPU_DEVICE)
    big = decode_metadata([3, 4, 5, 6], [[1, 0], [2, 0], [3, 0], [4, 0]])
    pad_decode_batch(buffers, torch.tensor([1, 2, 3, 4]), torch.tensor([2, 3, 4, 5]), big, 4)
    small = decode_metadata([17], [[5, 8]])
    pad_decode_batch(buffers, torch.tensor([9]), torch.tensor([16]), small, 2)
    assert buffers.input_ids[:2].tolist() == [9, 0]
    assert buffers.positions[:2].tolist() == [16, 0]
    assert buffers.slot_mapping[:2].tolist() == [8 * 16, -1]
    assert buffers.seq_lens[:2].tolist() == [17, 0]
    assert buffers.block_tables[:2].tolist() == [[5, 8], [0, 0]]


def test_captured_metadata_is_a_decode_batch_of_the_size_with_the_max_len_bound():
    buffers = DecodeBuffers.allocate(8, 4, CPU_DEVICE)
    metadata = buffers.metadata(4, max_seq_len=64)
    assert metadata.num_seqs == metadata.num_decodes == metadata.num_decode_tokens == 4
    assert (metadata.max_query_len, metadata.max_seq_len) == (1, 64)
    assert metadata.query_start_loc_cpu == [0, 1, 2, 3, 4]
    assert metadata.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()
    assert metadata.block_tables.shape == (4, 4)


# ---- the padded forward, eagerly on CPU ------------------------------------------------------


class EagerPaddedRunner(CUDAGraphRunner):
    """The graph runner with each graph's captured work run eagerly instead of replayed."""

    def _capture(self) -> None:
        pass

    def _replay(self, size: int) -> None:
        self._forward(size)


def install_checked_runner(llm: LLM, runner: CUDAGraphRunner) -> list[tuple[int, float]]:
    """Routes the engine's decode batches through `runner`, each checked against the eager
    forward. Returns (batch size, max |padded - eager|) per decode batch it ran."""
    model_runner = in_process_model(llm)
    model_runner.cuda_graphs = runner
    checks: list[tuple[int, float]] = []
    run = runner.run

    def checked_run(input_ids, positions, metadata):
        hidden = run(input_ids, positions, metadata).clone()
        with forward_context(metadata, model_runner.kv_cache.layers, model_runner.backend):
            eager = model_runner.model(input_ids, positions)
        checks.append((metadata.num_seqs, (hidden - eager).abs().max().item()))
        return hidden

    runner.run = checked_run
    return checks


def test_padded_decode_forward_matches_eager_and_the_torch_backend_tokens(tiny_llama):
    pytest.importorskip("triton")
    expected = greedy_tokens(tiny_llm(tiny_llama, attention_backend="torch", device="cpu"))
    llm = tiny_llm(tiny_llama, attention_backend="triton", device=TRITON_DEVICE, max_num_seqs=6)
    model_runner = in_process_model(llm)
    runner = EagerPaddedRunner(
        model_runner.model,
        model_runner.kv_cache.layers,
        model_runner.backend,
        llm.engine.quire_config,
    )
    checks = install_checked_runner(llm, runner)
    assert greedy_tokens(llm) == expected
    assert [size for size, _ in checks] == [5, 4, 3, 2, 1]  # padded to 6, 4, 4, 2, 1
    assert max(diff for _, diff in checks) < (1e-4 if TRITON_DEVICE == "cuda" else 1e-5)


# ---- the profiled KV pool size ---------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dummy_step_runs_on_a_one_block_cache_and_leaves_the_kv_cache_alone(tiny_llama, backend):
    pytest.importorskip("triton")
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    llm = tiny_llm(tiny_llama, attention_backend=backend, device=device, max_model_len=32)
    runner = in_process_model(llm)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_cache.layers]
    # 40 tokens > max_model_len 32: two requests, 32 and 8 tokens.
    kv_cache.run_dummy_step(
        runner.model, runner.backend, 16, torch.float32, num_tokens=40, max_num_sampled=4
    )
    for (k, v), (old_k, old_v) in zip(runner.kv_cache.layers, before):
        assert torch.equal(k, old_k) and torch.equal(v, old_v)


def test_gpu_kv_budget_is_the_utilization_share_minus_memory_in_use_and_profiled_peak(
    tiny_llama, monkeypatch
):
    """The sizing arithmetic, with torch.cuda's memory queries faked and the dummy step on CPU."""
    model = load_model_alone(tiny_llama, dtype="float32", device="cpu")
    mib = 2**20
    total, free, baseline, peak = 1000 * mib, 700 * mib, 280 * mib, 330 * mib
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: baseline)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    model_config = model.config
    config = resolve_config(
        EngineConfig(
            model=tiny_llama,
            dtype="float32",
            device="cuda",
            attention_backend="torch",
            block_size=16,
            gpu_memory_utilization=0.9,
            max_num_batched_tokens=64,
            max_num_seqs=8,
        )
    )
    block_bytes = kv_cache.bytes_per_block(model_config, 16, torch.float32)
    num_blocks = kv_cache.num_kv_blocks(config, block_bytes, model, TorchAttentionBackend())
    budget = 900 * mib - 300 * mib - 50 * mib  # share - in use - (peak - baseline)
    assert num_blocks == budget // kv_cache.bytes_per_block(model_config, 16, torch.float32)


# ---- real graphs -----------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
def test_cuda_runner_captures_every_size_of_the_ladder(tiny_llama):
    llm = tiny_llm(tiny_llama, device="cuda", max_num_seqs=12)
    assert sorted(in_process_model(llm).cuda_graphs.graphs) == [1, 2, 4, 8, 12]


@pytest.mark.gpu
@requires_cuda
def test_enforce_eager_captures_no_graphs(tiny_llama):
    assert not tiny_llm(tiny_llama, device="cuda", enforce_eager=True).stats().cuda_graphs


@pytest.mark.gpu
@requires_cuda
def test_graph_replay_matches_the_eager_forward(tiny_llama):
    llm = tiny_llm(tiny_llama, device="cuda", max_num_seqs=6)
    checks = install_checked_runner(llm, in_process_model(llm).cuda_graphs)
    greedy_tokens(llm)
    assert [size for size, _ in checks] == [5, 4, 3, 2, 1]
    # cuBLAS may pick other kernels for the padded row counts: float32 rounding apart.
    assert max(diff for _, diff in checks) < 1e-4


@pytest.mark.gpu
@requires_cuda
def test_cuda_greedy_tokens_match_the_cpu_torch_backend(tiny_llama):
    expected = greedy_tokens(tiny_llm(tiny_llama, attention_backend="torch", device="cpu"))
    llm = tiny_llm(tiny_llama, device="cuda", max_num_seqs=8)
    assert llm.stats().cuda_graphs
    assert greedy_tokens(llm) == expected


@pytest.mark.gpu
@requires_cuda
def test_decode_steps_with_an_adapter_run_eagerly_and_give_the_cpu_tokens(tiny_llama, tmp_path):
    adapter = LoRARequest("a", 1, make_adapter(tiny_llama, str(tmp_path / "a"), seed=3))
    prompts, params = prompts_and_params()

    def tokens(device: str) -> list[list[int]]:  # the graphs hold the base model's linears
        llm = tiny_llm(tiny_llama, device=device, enable_lora=True, max_num_seqs=8)
        outputs = llm.generate(prompts, params, lora_request=adapter, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    assert tokens("cuda") == tokens("cpu") != greedy_tokens(tiny_llm(tiny_llama, device="cpu"))


@pytest.mark.gpu
@requires_cuda
def test_profiled_activations_cover_the_sampled_logits(tiny_llama):
    llm = tiny_llm(tiny_llama, device="cuda")
    runner = in_process_model(llm)
    vocab_size = llm.engine.model_config.vocab_size
    activations = kv_cache.profile_activation_bytes(
        runner.model, runner.backend, 16, torch.float32, 512, 64
    )
    assert activations >= 64 * vocab_size * 4  # the float32 logits of 64 sampled rows

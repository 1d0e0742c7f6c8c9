"""ModelRunner: turns a SchedulerOutput into one flattened forward pass and samples.

All scheduled tokens of a step are flattened into one batch (decodes first). Attention writes their
K/V into the paged cache through `slot_mapping` and attends over each request's context. Only the
rows that sample (the last token of a request whose known tokens are then all computed) and rows
whose prompt logprobs were asked for go through the LM head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from quire.attention.backend import AttentionBackend, AttentionMetadata
from quire.config import EngineConfig
from quire.engine.scheduler import ScheduledRequest, SchedulerOutput
from quire.kernels import cpu as cpu_kernels
from quire.layers.sampler import Sampler, SamplingBatch, compute_topk_logprobs, greedy
from quire.model.loader import load_model
from quire.model.model_config import ModelConfig
from quire.worker import host_memory, kv_cache
from quire.worker.cuda_graph import CUDAGraphRunner, use_cuda_graphs

logger = logging.getLogger(__name__)


@dataclass
class TopLogprobs:
    """Per position: column 0 the chosen token, then the top-k alternatives."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the chosen token, 1 = most likely


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    # For requests that asked for logprobs (raw distribution); column 0 is the new token.
    logprobs: dict[str, TopLogprobs]
    prompt_logprobs: dict[str, TopLogprobs]  # prompt positions computed this step


# Block tables of decode steps are this many blocks wide, or a multiple: the host arrays are
# then rebuilt once every 256 tokens of a growing context, not at each new block.
_TABLE_WIDTH_STEP = 16


class _DecodeInputs:
    """The host arrays of a decode-only step of `num_seqs` requests, and tensors that share their
    memory (`tensors`: token ids, positions, slots, seq_lens, block tables, query_start_loc).
    The runner keeps one while the batch keeps its shape and writes each step's values into it:
    on a CPU, making the six tensors anew costs ~0.1 ms a step, the caches cold from the weights.
    The tensors are read within the step only (a GPU gets copies)."""

    def __init__(self, num_seqs: int, table_width: int):
        self.ints = np.zeros((3, num_seqs), np.int64)  # token ids, positions, slots
        self.seq_lens = np.zeros(num_seqs, np.int32)
        self.block_tables = np.zeros((num_seqs, table_width), np.int32)
        ints = torch.from_numpy(self.ints)
        self.tensors = (
            ints[0],
            ints[1],
            ints[2],
            torch.from_numpy(self.seq_lens),
            torch.from_numpy(self.block_tables),
            torch.arange(num_seqs + 1, dtype=torch.int32),
        )


def make_backend(name: str) -> AttentionBackend:
    if name == "triton":
        from quire.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from quire.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        max_model_len: int,
    ):
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        cpu_kernels.configure(
            cpu_kernels.KernelSettings(enabled=config.cpu_kernels, gemv_fma=config.gemv_fma)
        )
        self.model = load_model(config, model_config, dtype, max_model_len)
        if self.device.type == "cpu" and config.huge_pages:
            host_memory.move_to_huge_pages(self.model)
        self.layers = self.model.attention_layers
        self.backend = make_backend(config.attention_backend)
        for layer in self.layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        self._decode_inputs: _DecodeInputs | None = None
        self.num_blocks = config.num_kv_blocks or kv_cache.num_kv_blocks(
            model_config,
            config.block_size,
            dtype,
            config.device,
            config.kv_cache_memory,
            config.gpu_memory_utilization,
            config.max_num_batched_tokens,
            model=self.model,
            max_num_seqs=config.max_num_seqs,
        )
        kv_cache.allocate_kv_cache(
            self.layers, self.num_blocks, config.block_size, dtype, config.device, config.huge_pages
        )
        self.cuda_graphs = (
            CUDAGraphRunner(self.model, config, max_model_len) if use_cuda_graphs(config) else None
        )

    # ---- batch preparation -----------------------------------------------------------------
    def _prepare(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The step's flattened inputs, its attention metadata, and each scheduled request's
        first row (plus the total at the end).

        Attention sees one sequence per prefill chunk and one per generated token: a decode is
        one token, and a resumed request replaying its generated tokens (scheduler.py) has each
        of them attend as a decode of its own, over the context up to it, so that it gets the
        bits the decode kernels gave it the first time."""
        if all(s.num_new_tokens == 1 and s.is_decode for s in scheduled):
            return self._prepare_decodes(scheduled)
        num_entries = len(scheduled)
        starts = np.fromiter(
            (s.request.num_computed_tokens for s in scheduled), np.int64, num_entries
        )
        new_tokens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, num_entries)
        decode = np.fromiter((s.is_decode for s in scheduled), bool, num_entries)
        first_rows = np.zeros(num_entries + 1, np.int64)
        np.cumsum(new_tokens, out=first_rows[1:])
        num_tokens = int(first_rows[-1])

        input_ids: list[int] = []
        for s, start in zip(scheduled, starts.tolist()):
            input_ids.extend(s.request.token_ids[start : start + s.num_new_tokens])
        # Attention sequences: entry i gives new_tokens[i] of them when it decodes (a replay
        # when more than one), else one. Without a replay, the usual step, they are the entries.
        entry_of_seq = None
        seq_starts, query_lens, cu_query = starts, new_tokens, first_rows
        if (decode & (new_tokens > 1)).any():
            seqs_per_entry = np.where(decode, new_tokens, 1)
            entry_of_seq = np.repeat(np.arange(num_entries), seqs_per_entry)
            first_seq = np.zeros(num_entries + 1, np.int64)
            np.cumsum(seqs_per_entry, out=first_seq[1:])
            offset = np.arange(len(entry_of_seq)) - first_seq[:-1][entry_of_seq]  # 0: prefills
            seq_starts = starts[entry_of_seq] + offset
            query_lens = np.where(decode[entry_of_seq], 1, new_tokens[entry_of_seq])
            cu_query = np.zeros(len(entry_of_seq) + 1, np.int64)
            np.cumsum(query_lens, out=cu_query[1:])
        seq_lens = seq_starts + query_lens
        num_seqs = len(seq_starts)
        num_decodes = num_seqs - int((~decode).sum())  # the scheduler puts decodes first

        # positions[t] = start of its sequence + offset inside the chunk
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - cu_query[:-1][seq_index] + seq_starts[seq_index]

        max_blocks = max(len(s.block_ids) for s in scheduled)
        block_tables = np.zeros((num_entries, max_blocks), np.int32)
        for i, s in enumerate(scheduled):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        if entry_of_seq is not None:
            block_tables = block_tables[entry_of_seq]
        slot_mapping = (
            block_tables[seq_index, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )

        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(cu_query.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=cu_query.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        return ids, torch.from_numpy(positions).to(dev), metadata, first_rows.tolist()

    def _prepare_decodes(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """`_prepare` for the usual step of a running batch, every entry one decode token: the
        same inputs, written into host arrays kept from step to step (`_DecodeInputs`) instead
        of new tensors."""
        block_size, n = self.block_size, len(scheduled)
        positions = [s.request.num_computed_tokens for s in scheduled]
        slots = [
            s.block_ids[p // block_size] * block_size + p % block_size
            for s, p in zip(scheduled, positions)
        ]
        seq_lens = [p + 1 for p in positions]
        width = -(-max(len(s.block_ids) for s in scheduled) // _TABLE_WIDTH_STEP)
        inputs = self._decode_inputs
        if inputs is None or inputs.block_tables.shape != (n, width * _TABLE_WIDTH_STEP):
            inputs = self._decode_inputs = _DecodeInputs(n, width * _TABLE_WIDTH_STEP)
        inputs.ints[0] = [s.request.token_ids[p] for s, p in zip(scheduled, positions)]
        inputs.ints[1] = positions
        inputs.ints[2] = slots
        inputs.seq_lens[:] = seq_lens
        tables = inputs.block_tables
        tables.fill(0)
        for i, s in enumerate(scheduled):
            tables[i, : len(s.block_ids)] = s.block_ids
        ids, positions_t, slots_t, seq_lens_t, tables_t, query_start_loc = (
            t.to(self.device) for t in inputs.tensors
        )
        first_rows = list(range(n + 1))
        metadata = AttentionMetadata(
            slot_mapping=slots_t,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            block_tables=tables_t,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=first_rows,
            seq_lens_cpu=seq_lens,
            num_decodes=n,
            num_decode_tokens=n,
        )
        return ids, positions_t, metadata, first_rows

    # ---- the step --------------------------------------------------------------------------
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        if output.block_copies:
            with torch.inference_mode():
                kv_cache.copy_blocks(self.layers, output.block_copies)
        scheduled = output.scheduled
        input_ids, positions, metadata, first_rows = self._prepare(scheduled)
        if (
            self.cuda_graphs is None
            and metadata.num_decodes == len(scheduled) == input_ids.shape[0]
            and not output.forked
            and all(_argmax_only(s) for s in scheduled)
        ):
            token_ids = self.model.argmax_tokens(input_ids, positions, metadata)
            if token_ids is not None:  # a decode step, every token computed by the CPU path
                sampled = {s.request.request_id: t for s, t in zip(scheduled, token_ids)}
                return ModelRunnerOutput(sampled, {}, {})
        with torch.inference_mode():  # entered only here: ~20 us each way with the caches cold
            return self._forward_and_sample(output, input_ids, positions, metadata, first_rows)

    def _forward_and_sample(
        self,
        output: SchedulerOutput,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        first_rows: list[int],
    ) -> ModelRunnerOutput:
        scheduled = output.scheduled
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(metadata):
            hidden = self.cuda_graphs.run(input_ids, positions, metadata)  # [num_tokens, hidden]
        else:
            hidden = self.model(input_ids, positions, metadata)  # [num_tokens, hidden]

        # Rows that sample: each request's last new token; a fork samples from its parent's row.
        row_of: dict[str, int] = {}
        for i, s in enumerate(scheduled):
            if s.samples:
                row_of[s.request.request_id] = first_rows[i + 1] - 1
        requests = [s.request for s in scheduled if s.samples]
        for child, parent in output.forked:
            row_of[child.request_id] = row_of[parent.request_id]
            requests.append(child)

        result = ModelRunnerOutput({}, {}, self._prompt_logprobs(scheduled, hidden, first_rows))
        if not requests:
            return result
        rows = [row_of[r.request_id] for r in requests]
        if rows != list(range(hidden.shape[0])):  # every row samples, in order: a decode step
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden)  # [num_sampled, vocab] float32
        if all(_takes_argmax(r) for r in requests):
            # The sampler would take the same argmax; its per-row batch costs ~0.1 ms of Python
            # with the caches cold from the weights, 1-2% of a batch-1 step on a CPU.
            result.sampled.update(zip([r.request_id for r in requests], greedy(logits).tolist()))
            return result
        batch = SamplingBatch.from_params(
            [r.sampling_params for r in requests],
            # Only penalized rows read their history: no per-step copy of every output.
            [r.output_token_ids if r.sampling_params.uses_penalties else [] for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.generator for r in requests],
            [_banned_tokens(r) for r in requests],
            self.device,
        )
        sampled = self.sampler(logits, batch)
        token_ids = sampled.sampled_token_ids.tolist()
        for i, r in enumerate(requests):
            result.sampled[r.request_id] = token_ids[i]
        if sampled.logprob_token_ids is not None:
            all_ids = sampled.logprob_token_ids.tolist()
            all_lps = sampled.logprobs.tolist()
            ranks = sampled.sampled_ranks.tolist()
            for i, r in enumerate(requests):
                k = r.sampling_params.logprobs
                if k is not None:
                    result.logprobs[r.request_id] = TopLogprobs(
                        [all_ids[i][: k + 1]], [all_lps[i][: k + 1]], [ranks[i]]
                    )
        return result

    def _prompt_logprobs(
        self,
        scheduled: list[ScheduledRequest],
        hidden: torch.Tensor,
        first_rows: list[int],  # of each scheduled request
    ) -> dict[str, TopLogprobs]:
        """Logprobs of prompt tokens 1.. given their prefix, for the chunk computed this step."""
        result = {}
        for i, s in enumerate(scheduled):
            request = s.request
            if request.prompt_logprobs_done:
                continue
            start = request.num_computed_tokens
            # Position p predicts prompt token p + 1; the last prompt position predicts no prompt token.
            end = min(start + s.num_new_tokens, request.num_prompt_tokens - 1)
            if end <= start:
                continue
            first_row = first_rows[i]
            logits = self.model.compute_logits(hidden[first_row : first_row + end - start])
            targets = torch.tensor(
                request.prompt_token_ids[start + 1 : end + 1], device=self.device
            )
            k = request.sampling_params.prompt_logprobs
            ids, lps, ranks = compute_topk_logprobs(logits.log_softmax(-1), targets, k)
            result[request.request_id] = TopLogprobs(ids.tolist(), lps.tolist(), ranks.tolist())
        return result


def _argmax_only(entry: ScheduledRequest) -> bool:
    """Whether the entry samples, with no prompt logprobs to compute, and its token is the
    argmax of the raw logits (`_takes_argmax`)."""
    return entry.samples and entry.request.prompt_logprobs_done and _takes_argmax(entry.request)


def _takes_argmax(request) -> bool:
    """Whether the request's next token is the argmax of the raw logits: greedy, unpenalized,
    no logprobs, nothing banned."""
    return request.sampling_params.argmax_only and not _banned_tokens(request)


def _banned_tokens(request) -> list[int]:
    """Below min_tokens, EOS and the stop token ids cannot be sampled."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned |= params.all_stop_token_ids
    return sorted(banned)

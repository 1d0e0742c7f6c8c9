"""ModelRunner: turns a SchedulerOutput into one flattened forward pass and samples.

The runner moves its InputBatch forward with the step's deltas, then flattens every scheduled
token into one batch (decodes first). Attention writes their K/V into the paged cache through
`slot_mapping` and attends over each request's context. Only the rows that sample go through the
LM head: the last token of a request whose known tokens are then all computed, every position of
a request verifying speculative tokens, and rows whose prompt logprobs were asked for.

Speculative tokens are verified position by position: the token sampled after the known tokens
and the first j proposals is kept if every proposal before it matched what was sampled at its
position. Each position samples with its own noise (sample/sampler.py, `noise_seed`) and sees
the proposals before it as generated tokens (penalties, min_tokens), so a request gets the tokens
it would get without speculation. That exact match is rejection sampling for proposals that are
point masses (n-gram ones, a draft model's for a greedy request); a sampling request verifying a
draft model's proposals goes through the rejection sampler with the draft's q instead
(sample/rejection_sampler.py). With a draft model, after each step the draft catches up on the
step's tokens and proposes the next step's tokens (spec_decode/draft_model.py).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from quire.attention.backend import AttentionBackend, AttentionMetadata
from quire.attention.forward_context import forward_context
from quire.config import EngineConfig
from quire.distributed.parallel_state import all_ranks_agree, tp_size
from quire.kernels import cpu as cpu_kernels
from quire.kernels import kv_format
from quire.kv_transfer.transport import KVLayout
from quire.kv_transfer.worker_connector import KVConnectorWorker, weights_fingerprint
from quire.messages import ModelRunnerOutput, SchedulerOutput, TopLogprobs
from quire.model.loader import load_model
from quire.model.model_config import ModelConfig
from quire.sample.rejection_sampler import rejection_sample
from quire.sample.sampler import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_SAMPLE,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_token_bitmask,
    banned_token_ids,
    compute_topk_logprobs,
    greedy,
    noise_seed,
    sampling_probs,
    uniform_noise,
)
from quire.spec_decode.draft_model import Draft, DraftModelProposer
from quire.worker import host_memory, kv_cache
from quire.worker.cpu_step import CpuStepRunner
from quire.worker.cuda_graph import CUDAGraphRunner, use_cuda_graphs
from quire.worker.input_batch import TABLE_WIDTH_STEP, InputBatch, RequestState

logger = logging.getLogger(__name__)

Step = list[tuple[RequestState, int]]  # the step's requests and tokens to compute, in order


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
            cpu_kernels.KernelSettings(
                enabled=config.cpu_kernels, gemv_fma=config.gemv_fma, amx=config.cpu_amx
            )
        )
        self.model = load_model(config, model_config, dtype, max_model_len)
        if self.device.type == "cpu" and config.huge_pages:
            host_memory.move_to_huge_pages(self.model)
        spec = config.speculative_config
        self.drafter = (
            DraftModelProposer(config, dtype, max_model_len)
            if spec is not None and spec.method == "draft_model"
            else None
        )
        # The front end refused a draft of another vocabulary (llm_engine.check_draft_vocabulary).
        assert self.drafter is None or self.drafter.model_config.vocab_size == (
            model_config.vocab_size
        )
        self.backend = make_backend(config.attention_backend)
        self.sampler = Sampler()
        first = self.model.attention_layers[0]
        num_kv_heads = first.num_kv_heads  # this rank's share (all of them with one rank)
        c_decode = self.device.type == "cpu" and cpu_kernels.supports_paged_decode(
            torch.bfloat16, first.num_heads, num_kv_heads, model_config.head_dim
        )
        kv_dtype = kv_format.cache_dtype(config.kv_cache_dtype, dtype, c_decode)
        rank_config = dataclasses.replace(model_config, num_key_value_heads=num_kv_heads)
        self.num_blocks = config.num_kv_blocks or kv_cache.num_kv_blocks(
            rank_config,
            config.block_size,
            dtype,
            config.device,
            config.kv_cache_memory,
            config.gpu_memory_utilization,
            config.max_num_batched_tokens,
            model=self.model,
            backend=self.backend,
            max_num_seqs=config.max_num_seqs,
            draft_model_config=None if self.drafter is None else self.drafter.model_config,
            kv_dtype=kv_dtype,
        )
        self.kv_cache = kv_cache.KVCache.allocate(
            model_config.num_hidden_layers,
            self.num_blocks,
            config.block_size,
            num_kv_heads,
            model_config.head_dim,
            kv_dtype,
            config.device,
            config.huge_pages,
        )
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, kv_dtype, config.huge_pages)
        self.kv_connector = None
        if config.disaggregation_mode is not None:
            layout = KVLayout(
                model=weights_fingerprint(self.model),
                num_layers=model_config.num_hidden_layers,
                block_size=config.block_size,
                num_kv_heads=num_kv_heads,
                head_dim=model_config.head_dim,
                dtype=kv_format.name(kv_dtype),
                tensor_parallel_size=config.tensor_parallel_size,
            )
            self.kv_connector = KVConnectorWorker(
                self.kv_cache, layout, config.kv_host, config.kv_port, config.kv_transfer_timeout
            )
        self.cpu_step = CpuStepRunner.for_model(self.model, self.kv_cache)
        if tp_size() > 1 and config.device == "cpu":
            # every rank must take the same path at every step: their collectives pair up
            if not all_ranks_agree(self.cpu_step is not None):
                self.cpu_step = None
                logger.info(
                    "The C decode step is off under tensor parallelism (it needs bf16 GEMV "
                    "weights and the shared-memory all-reduce on every rank; gloo alone has no "
                    "C side); decode steps run the modules"
                )
        self.cuda_graphs = (
            CUDAGraphRunner(self.model, self.kv_cache.layers, self.backend, config, max_model_len)
            if use_cuda_graphs(config)
            else None
        )
        self.input_batch = InputBatch(config.max_num_seqs, -(-max_model_len // self.block_size))
        self._decode_inputs: _DecodeInputs | None = None

    # ---- batch preparation -----------------------------------------------------------------
    def _prepare(
        self, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The step's flattened inputs, its attention metadata, and each scheduled request's
        first row (plus the total at the end).

        Attention sees one sequence per prefill chunk and one per generated token: a decode is
        one token, and a request computing several generated tokens (a replay after preemption,
        scheduler.py, or speculative tokens to verify) has each of them attend as a decode of
        its own, over the context up to it, so that it gets the bits the decode kernels give a
        plain decode."""
        if all(n == 1 and s.is_decode for s, n in step):
            return self._prepare_decodes(step)
        num_entries = len(step)
        starts = np.fromiter((s.num_computed_tokens for s, _ in step), np.int64, num_entries)
        new_tokens = np.fromiter((n for _, n in step), np.int64, num_entries)
        decode = np.fromiter((s.is_decode for s, _ in step), bool, num_entries)
        first_rows = np.zeros(num_entries + 1, np.int64)
        np.cumsum(new_tokens, out=first_rows[1:])
        num_tokens = int(first_rows[-1])

        input_ids: list[int] = []
        for s, n in step:
            input_ids.extend(s.input_token_ids(n))
        # Attention sequences: entry i gives new_tokens[i] of them when it decodes (several
        # when more than one), else one. In the usual step they are the entries.
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

        batch = self.input_batch
        rows = np.fromiter((s.row for s, _ in step), np.int64, num_entries)
        max_blocks = int(batch.num_blocks[rows].max())
        block_tables = batch.block_table[rows, :max_blocks]
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
        self, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """`_prepare` for the usual step of a running batch, every entry one decode token: the
        same inputs, written into host arrays kept from step to step (`_DecodeInputs`), the
        block tables taken from the InputBatch's rows."""
        block_size, n = self.block_size, len(step)
        batch = self.input_batch
        rows = [s.row for s, _ in step]
        positions = [s.num_computed_tokens for s, _ in step]
        width = -(-int(batch.num_blocks[rows].max()) // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP
        inputs = self._decode_inputs
        if inputs is None or inputs.block_tables.shape != (n, width):
            inputs = self._decode_inputs = _DecodeInputs(n, width)
        tables = inputs.block_tables
        np.take(batch.block_table[:, :width], rows, axis=0, out=tables)
        inputs.ints[0] = [s.token_ids[p] for (s, _), p in zip(step, positions)]
        inputs.ints[1] = positions
        pos = inputs.ints[1]
        inputs.ints[2] = tables[np.arange(n), pos // block_size] * block_size + pos % block_size
        np.add(pos, 1, out=inputs.seq_lens, casting="unsafe")
        ids, positions_t, slots_t, seq_lens_t, tables_t, query_start_loc = (
            t.to(self.device) for t in inputs.tensors
        )
        first_rows = list(range(n + 1))
        seq_lens = [p + 1 for p in positions]
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
        kv_output = None
        if self.kv_connector is not None:  # pulled K/V lands before the batch reads it
            kv_output = self.kv_connector.before_forward(output.kv_connector_metadata)
        result = self._execute(output)
        if self.kv_connector is not None:
            self.kv_connector.after_forward(
                output.kv_connector_metadata,
                result.sampled_token_ids,
                result.logprobs,
                output.forked_reqs,
            )
            result.kv_connector_output = kv_output
        return result

    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        step = self.input_batch.update(output)
        if self.drafter is not None:
            self.drafter.drop([*output.finished_req_ids, *output.preempted_req_ids])
        if output.block_copies:
            with torch.inference_mode():
                self.kv_cache.copy_blocks(output.block_copies)
                if self.drafter is not None:
                    self.drafter.kv_cache.copy_blocks(output.block_copies)
        if not step:
            return ModelRunnerOutput({})
        input_ids, positions, metadata, first_rows = self._prepare(step)
        if (
            self.cpu_step is not None
            and metadata.num_decodes == metadata.num_seqs
            and not output.forked_reqs
            and output.grammar_bitmask is None
            and all(_argmax_only(s, n) for s, n in step)
            and self.cpu_step.takes_argmax(metadata, input_ids.shape[0])
        ):
            # A decode-only step, every row's token the argmax: one C call (cpu_step.py).
            row_tokens = self.cpu_step.argmax_tokens(input_ids, positions, metadata)
            result = ModelRunnerOutput(_accept(step, first_rows, row_tokens))
        else:
            with torch.inference_mode():  # entered only here: ~20 us each way, caches cold
                result = self._forward_and_sample(
                    output, step, input_ids, positions, metadata, first_rows
                )
        if self.drafter is not None:
            result.draft_token_ids = self._propose(
                output, result, step, input_ids, positions, metadata, first_rows
            )
        return result

    def _propose(
        self,
        output: SchedulerOutput,
        result: ModelRunnerOutput,
        step: Step,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        first_rows: list[int],
    ) -> dict[str, list[int]]:
        """The draft catches up on the step's final tokens, then proposes for every request that
        sampled this step, after its new tokens (spec_decode/draft_model.py); none for a fork
        or its parent this step (they share a partial block the proposals would write into)."""
        drafter, batch = self.drafter, self.input_batch
        num_draft = output.num_draft_tokens  # None: k for every request
        computed = metadata.num_decodes != metadata.num_seqs  # prompt chunks: all rows at once
        forking = {f.req_id for f in output.forked_reqs}
        forking |= {f.parent_req_id for f in output.forked_reqs}
        if not computed and num_draft is not None and not any(num_draft.values()):
            # "auto" chose k = 0 for every request: no draft row to compute or keep up.
            return drafter.propose_nothing(result.sampled_token_ids, forking)
        with torch.inference_mode():  # entered only when the draft computes: ~20 us each way
            if computed:
                drafter.forward_step(input_ids, positions, metadata, self.backend)
            ids = input_ids.tolist()
            spec = output.scheduled_spec_decode_tokens
            entries = []
            for (s, n), first in zip(step, first_rows):
                sampled = result.sampled_token_ids.get(s.req_id)
                num_final = n  # less the rejected proposals, past the accepted ones
                if sampled is not None:
                    num_final -= len(spec.get(s.req_id, ())) + 1 - len(sampled)
                final = ids[first : first + num_final]
                entries.append((s.req_id, s.row, s.num_computed_tokens, s.token_ids, final))
            keep_up = None if num_draft is None else {r for r, k in num_draft.items() if k}
            pending = drafter.catch_up(entries, batch.block_table, keep_up, computed)
            proposing = []
            for req_id, token_ids in result.sampled_token_ids.items():
                if req_id in forking:
                    drafter.drafts.pop(req_id, None)
                    continue
                s = batch.requests[req_id]
                proposing.append(
                    drafter.proposing(
                        req_id,
                        s.row,
                        int(batch.num_blocks[s.row]),
                        s.prompt_token_ids,
                        s.token_ids + token_ids,
                        s.sampling_params,
                        s.index,
                        drafter.k if num_draft is None else num_draft.get(req_id, 0),
                    )
                )
            return drafter.propose(proposing, pending, batch.block_table, self.backend)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if self.cpu_step is not None and self.cpu_step.takes(metadata, input_ids.shape[0]):
            return self.cpu_step.forward(input_ids, positions, metadata)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(metadata):
            return self.cuda_graphs.run(input_ids, positions, metadata)
        with forward_context(metadata, self.kv_cache.layers, self.backend):
            return self.model(input_ids, positions)

    def _forward_and_sample(
        self,
        output: SchedulerOutput,
        step: Step,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        first_rows: list[int],
    ) -> ModelRunnerOutput:
        hidden = self._forward(input_ids, positions, metadata)  # [num_tokens, hidden]
        result = ModelRunnerOutput({}, {}, self._prompt_logprobs(step, hidden, first_rows))

        # Sampled rows: (request, hidden row, offset past its known tokens). A request samples
        # at its last new token, or at every position it verifies; a fork from its parent's row.
        sampled: list[tuple[RequestState, int, int]] = []
        last_row: dict[str, int] = {}
        for i, (s, n) in enumerate(step):
            if s.spec_token_ids:
                sampled.extend((s, first_rows[i] + j, j) for j in range(n))
            elif s.num_computed_tokens + n >= s.num_tokens:
                last_row[s.req_id] = first_rows[i + 1] - 1
                sampled.append((s, first_rows[i + 1] - 1, 0))
        requests = self.input_batch.requests
        for fork in output.forked_reqs:
            sampled.append((requests[fork.req_id], last_row[fork.parent_req_id], 0))
        if not sampled:
            return result
        rows = [row for _, row, _ in sampled]
        if rows != list(range(hidden.shape[0])):  # every row samples, in order: a decode step
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden)  # [num_sampled, vocab] float32
        if output.grammar_bitmask is not None:
            logits = self._apply_grammar(output, sampled, logits)
        if all(_takes_argmax(s, offset) for s, _, offset in sampled):
            # The sampler would take the same argmax (of the masked logits, under a grammar); its
            # per-row batch costs ~0.1 ms of Python with the caches cold from the weights, 1-2%
            # of a batch-1 step on a CPU.
            token_ids = greedy(logits).tolist()
            result.sampled_token_ids.update(_accept_rows(sampled, token_ids))
            return result
        batch = self._sampling_batch([(s, offset) for s, _, offset in sampled], seeded=True)
        drafted = self._drafted(sampled)
        num_logprobs = batch.max_num_logprobs
        if drafted:  # logprobs of the tokens the rejection sampler emits, computed below
            batch.max_num_logprobs = None
        out = self.sampler(logits, batch)
        token_ids = out.sampled_token_ids.tolist()
        accepted = _accept_rows(sampled, token_ids)
        if drafted:
            row_tokens = self._rejection_sample(
                sampled, drafted, logits, out.sampled_token_ids, accepted
            )
            if num_logprobs is not None:
                ids, lps, ranks = compute_topk_logprobs(
                    logits.log_softmax(dim=-1), row_tokens, num_logprobs
                )
                out = SamplerOutput(row_tokens, lps[:, 0], ids, lps, ranks)
        result.sampled_token_ids.update(accepted)
        if out.logprob_token_ids is not None:
            self._sampled_logprobs(result, sampled, accepted, out)
        return result

    def _sampling_batch(self, rows: list[tuple[RequestState, int]], seeded: bool) -> SamplingBatch:
        """The sampling parameters of these (request, offset past its known tokens) rows, with
        their sampling noise's keys if `seeded`."""
        return SamplingBatch.from_params(
            [s.sampling_params for s, _ in rows],
            # Only penalized rows read their history: no per-step copy of every output.
            [_seen_outputs(s, offset) for s, offset in rows],
            [s.prompt_token_ids for s, _ in rows],
            [_noise_key(s, offset) if seeded else None for s, offset in rows],
            [_banned_tokens(s, offset) for s, offset in rows],
            self.device,
        )

    def _drafted(self, sampled: list[tuple[RequestState, int, int]]) -> dict[int, Draft]:
        """The sampling (not greedy) requests verifying a draft model's proposals: the index
        of each one's first row in `sampled`, and its draft (proposals and q)."""
        if self.drafter is None:
            return {}
        drafts = self.drafter.drafts
        drafted = {}
        for i, (s, _, offset) in enumerate(sampled):
            draft = drafts.get(s.req_id) if offset == 0 and s.spec_token_ids else None
            if draft is not None and draft.probs is not None:
                assert draft.token_ids[: len(s.spec_token_ids)] == s.spec_token_ids
                drafted[i] = draft
        return drafted

    def _rejection_sample(
        self,
        sampled: list[tuple[RequestState, int, int]],
        drafted: dict[int, Draft],
        logits: torch.Tensor,  # [num_sampled, vocab], a row per entry of `sampled`
        sampled_tokens: torch.Tensor,  # [num_sampled], the target's sample at each row
        accepted: dict[str, list[int]],  # updated: the drafted requests' emitted tokens
    ) -> torch.Tensor:  # [num_sampled]: the token each row emits (the sample where not drafted)
        """Verifies the drafted requests' proposals by rejection sampling, all at once
        (sample/rejection_sampler.py). The target's p at each proposal is the distribution its
        row samples from; the bonus token is the row's own sample."""
        firsts = list(drafted)
        states = [sampled[i][0] for i in firsts]
        ks = [len(s.spec_token_ids) for s in states]
        batch_size, max_k, dev = len(states), max(ks), self.device
        # [B, K] in row-major order; padding past a request's k repeats its last proposal's row.
        padded = [
            (i, s, min(j, k - 1)) for i, s, k in zip(firsts, states, ks) for j in range(max_k)
        ]
        rows = torch.tensor([i + j for i, _, j in padded], device=dev)
        target_batch = self._sampling_batch([(s, j) for _, s, j in padded], seeded=False)
        target_probs = sampling_probs(logits[rows], target_batch)  # [B * K, V]
        draft_probs = torch.zeros_like(target_probs).view(batch_size, max_k, -1)
        for b, (i, k) in enumerate(zip(firsts, ks)):
            draft_probs[b, :k] = drafted[i].probs[:k]
        keys = [
            (_noise_key(s, j, STREAM_ACCEPT), _noise_key(s, j, STREAM_RESIDUAL))
            for s in states
            for j in range(max_k)
        ]
        proposals = [s.spec_token_ids + [0] * (max_k - k) for s, k in zip(states, ks)]
        out, num_emitted = rejection_sample(
            torch.tensor(proposals, device=dev),
            torch.tensor(ks, device=dev),
            draft_probs,
            target_probs.view(batch_size, max_k, -1),
            sampled_tokens[torch.tensor([i + k for i, k in zip(firsts, ks)], device=dev)],
            uniform_noise([a for a, _ in keys], dev).view(batch_size, max_k),
            [r for _, r in keys],
        )
        emitted = out.tolist()
        for s, tokens, num in zip(states, emitted, num_emitted.tolist()):
            accepted[s.req_id] = tokens[:num]
        positions = torch.arange(max_k + 1, device=dev)
        valid = positions < num_emitted[:, None]
        row_index = torch.tensor(firsts, device=dev)[:, None] + positions
        row_tokens = sampled_tokens.clone()
        row_tokens[row_index[valid]] = out[valid]
        return row_tokens

    def _apply_grammar(
        self,
        output: SchedulerOutput,
        sampled: list[tuple[RequestState, int, int]],
        logits: torch.Tensor,  # [num_sampled, vocab]
    ) -> torch.Tensor:
        """Masks the tokens each structured-output row's grammar forbids."""
        first_mask_row = output.structured_output_request_ids
        logit_rows, mask_rows = [], []
        for i, (s, _, offset) in enumerate(sampled):
            first = first_mask_row.get(s.req_id)
            if first is not None:
                logit_rows.append(i)
                mask_rows.append(first + offset)
        bitmask = torch.from_numpy(output.grammar_bitmask[mask_rows]).to(self.device)
        return apply_token_bitmask(logits, bitmask, logit_rows)

    def _sampled_logprobs(
        self,
        result: ModelRunnerOutput,
        sampled: list[tuple[RequestState, int, int]],
        accepted: dict[str, list[int]],
        out,
    ) -> None:
        all_ids = out.logprob_token_ids.tolist()
        all_lps = out.logprobs.tolist()
        ranks = out.sampled_ranks.tolist()
        for i, (s, _, offset) in enumerate(sampled):
            k = s.sampling_params.logprobs
            if k is None or offset >= len(accepted[s.req_id]):
                continue
            top = result.logprobs.setdefault(s.req_id, TopLogprobs([], [], []))
            top.token_ids.append(all_ids[i][: k + 1])
            top.logprobs.append(all_lps[i][: k + 1])
            top.ranks.append(ranks[i])

    def _prompt_logprobs(
        self,
        step: Step,
        hidden: torch.Tensor,
        first_rows: list[int],  # of each scheduled request
    ) -> dict[str, TopLogprobs]:
        """Logprobs of prompt tokens 1.. given their prefix, for the chunk computed this step."""
        result = {}
        for i, (s, n) in enumerate(step):
            if not s.returns_prompt_logprobs:
                continue
            start = s.num_computed_tokens
            # Position p predicts prompt token p + 1; the last prompt position predicts none.
            end = min(start + n, s.num_prompt_tokens - 1)
            if end <= start:
                continue
            first_row = first_rows[i]
            logits = self.model.compute_logits(hidden[first_row : first_row + end - start])
            targets = torch.tensor(s.prompt_token_ids[start + 1 : end + 1], device=self.device)
            k = s.sampling_params.prompt_logprobs
            ids, lps, ranks = compute_topk_logprobs(logits.log_softmax(-1), targets, k)
            result[s.req_id] = TopLogprobs(ids.tolist(), lps.tolist(), ranks.tolist())
        return result


def _accept(step: Step, first_rows: list[int], row_tokens: list[int]) -> dict[str, list[int]]:
    """Each request's new tokens from a decode-only step whose every row sampled."""
    if len(row_tokens) == len(step):  # one row each: no proposals to verify
        return {s.req_id: [token_id] for (s, _), token_id in zip(step, row_tokens)}
    sampled = []
    for i, (s, n) in enumerate(step):
        sampled.extend((s, first_rows[i] + j, j) for j in range(n))
    return _accept_rows(sampled, [row_tokens[row] for _, row, _ in sampled])


def _accept_rows(
    sampled: list[tuple[RequestState, int, int]], token_ids: list[int]
) -> dict[str, list[int]]:
    """Each request's new tokens from its sampled rows: the token after its known tokens, then,
    while the token sampled at a position equals the proposal there, the token after that."""
    accepted: dict[str, list[int]] = {}
    done: set[str] = set()  # requests whose proposal at an earlier position was rejected
    for (s, _, offset), token_id in zip(sampled, token_ids):
        if s.req_id in done:
            continue
        accepted.setdefault(s.req_id, []).append(token_id)
        if offset >= len(s.spec_token_ids) or token_id != s.spec_token_ids[offset]:
            done.add(s.req_id)
    return accepted


def _argmax_only(state: RequestState, num_new: int) -> bool:
    """Whether the entry samples at each of its rows (a decode, or a verification), with no
    prompt logprobs to compute, and each token is the argmax of the raw logits
    (`_takes_argmax`)."""
    return (
        (num_new == 1 or bool(state.spec_token_ids))
        and state.num_computed_tokens + num_new >= state.num_tokens
        and not state.returns_prompt_logprobs
        and all(_takes_argmax(state, j) for j in range(num_new))
    )


def _takes_argmax(state: RequestState, offset: int) -> bool:
    """Whether the request's token `offset` positions past its known ones is the argmax of the
    raw logits: greedy, unpenalized, no logprobs, nothing banned."""
    return state.sampling_params.argmax_only and not _banned_tokens(state, offset)


def _seen_outputs(state: RequestState, offset: int) -> list[int]:
    """The generated tokens a penalized row sees: its outputs, then the proposals before it."""
    if not state.sampling_params.uses_penalties:
        return []
    return state.token_ids[state.num_prompt_tokens :] + state.spec_token_ids[:offset]


def _noise_key(state: RequestState, offset: int, stream: int = STREAM_SAMPLE) -> int | None:
    seed = state.sampling_params.seed
    if seed is None:
        return None
    return noise_seed(seed, state.index, state.num_tokens + offset, stream)


def _banned_tokens(state: RequestState, offset: int) -> list[int]:
    return banned_token_ids(state.sampling_params, state.num_output_tokens + offset)

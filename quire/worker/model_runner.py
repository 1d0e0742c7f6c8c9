"""ModelRunner: one step, from a SchedulerOutput to a ModelRunnerOutput.

prepare -> forward -> sample -> propose. The runner moves its InputBatch forward with the step's
deltas and builds the step's inputs (worker/step_inputs.py), runs the target's ModelForward
(worker/model_forward.py), computes logits only for the rows that sample — the last token of a
request whose known tokens are then all computed, every position of a request verifying
speculative tokens, a fork's parent row — and rows whose prompt logprobs were asked for, samples
them in one call of the StepSampler (sample/step_sampler.py), and last hands the step to its
proposer, if any, for the next step's proposals (worker/protocols.py).

Under pipeline parallelism each stage runs this same step on its layers; only the last stage
computes logits, samples and proposes, and only its output carries tokens.

A decode-only step whose every row takes the argmax of the raw logits asks the ModelForward for
the tokens in one call (the C step fuses the forward, the LM head and the argmax); a forward
path that cannot, gives None, and the step goes the usual way. In any other step on a CPU, the
rows of requests that take the argmax at every row get their tokens from the C step's LM head
and argmax alone (`ModelForward.greedy_tokens`: no [rows, vocab] logits tensor per step), and
only the other rows' logits go to the StepSampler.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from quire.config import QuireConfig
from quire.distributed.parallel_state import pp_rank
from quire.kernels import cpu as cpu_kernels
from quire.kernels import kv_format
from quire.layers.lora_linear import LoRAMapping, lora_context
from quire.lora.manager import LoRAManager
from quire.lora.ops import lora_ops
from quire.messages import ModelRunnerOutput, SchedulerOutput, TopLogprobs
from quire.sample.sampler import compute_topk_logprobs
from quire.sample.step_sampler import (
    GrammarMask,
    Row,
    StepSample,
    StepSampler,
    accept,
    takes_argmax,
)
from quire.worker import kv_cache
from quire.worker.cuda_graph import use_cuda_graphs
from quire.worker.input_batch import InputBatch, RequestState
from quire.worker.model_forward import ModelForward, make_backend
from quire.worker.protocols import KVConnector, Proposer, SampledStep
from quire.worker.step_inputs import Step, StepInputBuilder, StepInputs


class ModelRunner:
    def __init__(
        self,
        config: QuireConfig,
        proposer: Proposer | None = None,
        kv_connector: KVConnector | None = None,
    ):
        device, cache, model = config.device, config.cache, config.model
        self.device = torch.device(device.device)
        cpu_kernels.configure(
            cpu_kernels.KernelSettings(
                enabled=device.cpu_kernels, gemv_fma=device.gemv_fma, amx=device.cpu_amx
            )
        )
        self.target = ModelForward.load(
            model,
            model.max_model_len,
            make_backend(device.attention_backend),
            cache.huge_pages,
            config.lora,
            layers=config.parallel.stage_layers(pp_rank()),
        )
        self.loras = (
            None
            if config.lora is None
            else LoRAManager(config.lora, model.architecture, self.target.model)
        )
        self.lora_ops = None if config.lora is None else lora_ops(self.device, model.dtype)
        # the last step's adapter rows, kept while the next step's slots and row counts are the
        # same (every steady decode step)
        self._lora_mapping: tuple[tuple, LoRAMapping] | None = None
        self.proposer = proposer if self.target.is_last_stage else None  # it needs the tokens
        self.kv_connector = kv_connector
        self.async_scheduling = config.scheduler.async_scheduling
        target = self.target
        c_decode = self.device.type == "cpu" and cpu_kernels.supports_paged_decode(
            torch.bfloat16, target.num_heads, target.num_kv_heads, model.architecture.head_dim
        )
        kv_dtype = kv_format.cache_dtype(cache.kv_cache_dtype, model.dtype, c_decode)
        block_bytes = target.kv_block_bytes(cache.block_size, kv_dtype)
        if proposer is not None:
            block_bytes += proposer.kv_block_bytes(cache.block_size, kv_dtype)
        self.num_blocks = cache.num_kv_blocks or kv_cache.num_kv_blocks(
            config, block_bytes, target.model, target.backend
        )
        target.allocate_kv(
            self.num_blocks,
            cache.block_size,
            kv_dtype,
            cache.huge_pages,
            cuda_graphs=config if use_cuda_graphs(config) else None,
        )
        if proposer is not None:
            proposer.allocate_kv(self.num_blocks, cache.block_size, kv_dtype, cache.huge_pages)
        if kv_connector is not None:
            kv_connector.register_kv_cache(target.kv_cache, target.model)
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs, -(-model.max_model_len // cache.block_size)
        )
        self.inputs = StepInputBuilder(self.input_batch, cache.block_size, self.device)
        self.sampler = StepSampler(self.device)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        kv_output = None
        if self.kv_connector is not None:  # pulled K/V lands before the batch reads it
            kv_output = self.kv_connector.before_forward(output.kv_connector_metadata)
        if self.loras is not None:
            self._release_adapters(output)
        step = self.input_batch.update(output)
        if self.loras is not None:
            self._acquire_adapters(output)
        if self.proposer is not None:
            self.proposer.drop([*output.finished_req_ids, *output.preempted_req_ids])
        if output.block_copies:
            with torch.inference_mode():
                self.target.copy_blocks(output.block_copies)
                if self.proposer is not None:
                    self.proposer.copy_blocks(output.block_copies)
        result = ModelRunnerOutput({})
        if step:
            inputs = self.inputs.build(step)
            with self._adapters(step):
                result = self._run(output, step, inputs)
            if self.proposer is not None:
                result.draft_token_ids = self.proposer.propose(
                    self._sampled_step(output, step, inputs, result.sampled_token_ids)
                )
        if self.async_scheduling:
            self.input_batch.record_sampled(result.sampled_token_ids)
        if self.kv_connector is not None:
            self.kv_connector.after_forward(
                output.kv_connector_metadata,
                result.sampled_token_ids,
                result.logprobs,
                output.forked_reqs,
            )
            result.kv_connector_output = kv_output
        return result

    def _run(self, output: SchedulerOutput, step: Step, inputs: StepInputs) -> ModelRunnerOutput:
        """The forward and the sampling of a step."""
        rows, hidden_rows = _sampled_rows(output, step, inputs.first_rows, self.input_batch)
        if (
            inputs.decode_only
            and not output.forked_reqs  # then the rows ascend: all of them iff as many
            and len(hidden_rows) == inputs.first_rows[-1]
            and output.grammar_bitmask is None
            and all(takes_argmax(s, offset) for s, offset in rows)
        ):
            # Every row samples, in order, and takes the argmax: the fused path, where it runs.
            tokens = self.target.argmax_tokens(inputs.input_ids, inputs.positions, inputs.metadata)
            if tokens is not None:
                return ModelRunnerOutput(accept(rows, tokens))
        with torch.inference_mode():  # entered only here: ~20 us each way, caches cold
            hidden = self.target.forward(inputs.input_ids, inputs.positions, inputs.metadata)
            if hidden is None:  # sent on to the next pipeline stage
                return ModelRunnerOutput({})
            result = ModelRunnerOutput({}, {}, self._prompt_logprobs(step, hidden, inputs))
            if not rows:
                return result
            if hidden_rows != list(range(hidden.shape[0])):  # not a decode step's every row
                hidden = hidden[self._index(hidden_rows)]
            grammar = None
            if output.grammar_bitmask is not None:
                grammar = GrammarMask(output.grammar_bitmask, output.structured_output_request_ids)
            sample = self._sample(rows, hidden, grammar)
        result.sampled_token_ids, result.logprobs = sample.accepted, sample.logprobs
        return result

    def _sample(
        self,
        rows: list[Row],
        hidden: torch.Tensor,  # [len(rows), hidden_size]: each row's hidden state
        grammar: GrammarMask | None,
    ) -> StepSample:
        """The rows' tokens: where the ModelForward fuses the LM head and the argmax, those of
        requests that take the argmax at every row and follow no grammar from it alone
        (`greedy_tokens`); the others (all of them elsewhere: one host sync, not two) from
        their logits through the StepSampler."""
        greedy_rows = _greedy_rows(rows, grammar) if self.target.fuses_lm_head_argmax else []
        if len(greedy_rows) == len(rows):
            return StepSample(accept(rows, self.target.greedy_tokens(hidden)))
        greedy: dict[str, list[int]] = {}
        sampled_rows = rows
        if greedy_rows:
            taken = set(greedy_rows)
            others = [i for i in range(len(rows)) if i not in taken]
            tokens = self.target.greedy_tokens(hidden[self._index(greedy_rows)])
            greedy = accept([rows[i] for i in greedy_rows], tokens)
            sampled_rows, hidden = [rows[i] for i in others], hidden[self._index(others)]
        logits = self.target.compute_logits(hidden)  # [num_rows, vocab] float32
        drafts = None if self.proposer is None else self.proposer.drafts
        sample = self.sampler(logits, sampled_rows, grammar, drafts)
        if greedy:  # each request's tokens in the order of its rows, as from one call
            accepted = greedy | sample.accepted
            sample.accepted = {r: accepted[r] for r in dict.fromkeys(s.req_id for s, _ in rows)}
        return sample

    def _index(self, indices: list[int]) -> torch.Tensor:
        return torch.tensor(indices, device=self.device)

    # ---- adapters (multi-LoRA) --------------------------------------------------------------
    def _release_adapters(self, output: SchedulerOutput) -> None:
        """The dropped requests no longer hold their adapters."""
        requests = self.input_batch.requests
        for req_id in (*output.finished_req_ids, *output.preempted_req_ids):
            state = requests.get(req_id)
            if state is not None and state.lora_request is not None:
                self.loras.release(state.lora_request.lora_name)

    def _acquire_adapters(self, output: SchedulerOutput) -> None:
        """New requests load (unless loaded) and hold their adapters; forks hold their
        parent's."""
        requests = self.input_batch.requests
        for new in output.scheduled_new_reqs:
            if new.lora_request is not None:
                self.loras.add(new.lora_request)
                self.loras.acquire(new.lora_request.lora_name)
        for fork in output.forked_reqs:
            lora = requests[fork.req_id].lora_request
            if lora is not None:
                self.loras.acquire(lora.lora_name)

    def _adapters(self, step: Step) -> AbstractContextManager:
        """The step's adapter rows for every LoRALinear, where a request of the step runs one
        (none: the base model's linears alone)."""
        if self.loras is None or all(s.lora_request is None for s, _ in step):
            return nullcontext()
        names = [s.lora_request.lora_name for s, _ in step if s.lora_request is not None]
        slot_of = self.loras.activate(names)
        slots = [
            -1 if s.lora_request is None else slot_of[s.lora_request.lora_name] for s, _ in step
        ]
        key = (tuple(slots), tuple(n for _, n in step))
        if self._lora_mapping is None or self._lora_mapping[0] != key:
            mapping = LoRAMapping.from_requests(*key, self.device)
            self._lora_mapping = key, mapping
        return lora_context(self._lora_mapping[1], self.lora_ops)

    def _sampled_step(
        self,
        output: SchedulerOutput,
        step: Step,
        inputs: StepInputs,
        sampled: dict[str, list[int]],
    ) -> SampledStep:
        forking = {f.req_id for f in output.forked_reqs}
        forking |= {f.parent_req_id for f in output.forked_reqs}
        batch = self.input_batch
        return SampledStep(
            step=step,
            inputs=inputs,
            sampled=sampled,
            requests=batch.requests,
            block_table=batch.block_table,
            num_blocks=batch.num_blocks,
            forking=forking,
            num_draft_tokens=output.num_draft_tokens,
        )

    def _prompt_logprobs(
        self, step: Step, hidden: torch.Tensor, inputs: StepInputs
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
            first_row = inputs.first_rows[i]
            logits = self.target.compute_logits(hidden[first_row : first_row + end - start])
            targets = torch.tensor(s.prompt_token_ids[start + 1 : end + 1], device=self.device)
            k = s.sampling_params.prompt_logprobs
            ids, lps, ranks = compute_topk_logprobs(logits.log_softmax(-1), targets, k)
            result[s.req_id] = TopLogprobs(ids.tolist(), lps.tolist(), ranks.tolist())
        return result


def _greedy_rows(rows: list[Row], grammar: GrammarMask | None) -> list[int]:
    """The indices of the rows whose request takes the argmax of the raw logits at every one of
    its rows and follows no grammar."""
    sampling = {s.req_id for s, offset in rows if not takes_argmax(s, offset)}
    if grammar is not None:
        sampling |= grammar.first_rows.keys()
    return [i for i, (s, _) in enumerate(rows) if s.req_id not in sampling]


def _sampled_rows(
    output: SchedulerOutput, step: Step, first_rows: list[int], batch: InputBatch
) -> tuple[list[Row], list[int]]:
    """The rows that sample, as (request, offset past its known tokens), and the hidden row of
    each. A request samples at its last new token, or at every position it verifies; a fork
    from its parent's row."""
    rows: list[Row] = []
    hidden_rows: list[int] = []
    for i, (s, n) in enumerate(step):
        if s.spec_token_ids:
            rows.extend((s, j) for j in range(n))
            hidden_rows.extend(range(first_rows[i], first_rows[i] + n))
        elif s.num_computed_tokens + n >= len(s.token_ids):
            rows.append((s, 0))
            hidden_rows.append(first_rows[i + 1] - 1)
    if output.forked_reqs:
        last_row = {s.req_id: first_rows[i + 1] - 1 for i, (s, _) in enumerate(step)}
        for fork in output.forked_reqs:
            state: RequestState = batch.requests[fork.req_id]
            rows.append((state, 0))
            hidden_rows.append(last_row[fork.parent_req_id])
    return rows, hidden_rows

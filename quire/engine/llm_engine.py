"""LLMEngine: add_request / abort_request / step(). schedule -> execute -> update -> outputs."""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from quire.config import EngineConfig
from quire.engine.detokenizer import IncrementalDetokenizer
from quire.engine.kv_manager import KVCacheManager
from quire.engine.request import Request, RequestStatus
from quire.engine.scheduler import Scheduler, SchedulerOutput
from quire.model.loader import load_model_config
from quire.model.tokenizer import load_tokenizer
from quire.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from quire.sampling_params import SamplingParams
from quire.worker.model_runner import ModelRunner, ModelRunnerOutput, TopLogprobs

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


@dataclass
class _Sequence:
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""  # released so far (never a prefix of a stop string that may still match)


@dataclass
class RequestGroup:
    """A caller's request: its prompt and the n sequences that complete it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[int, _Sequence] = field(default_factory=dict)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(
            s.request.is_finished for s in self.sequences.values()
        )


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_config = load_model_config(config)
        self.model_config = model_config
        self.dtype = config.resolve_dtype(model_config.torch_dtype)
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings}); pass a smaller max_model_len."
            )
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, model_config, self.dtype, max_model_len)
        pool_tokens = self.runner.num_blocks * config.block_size
        if max_model_len > pool_tokens:
            logger.warning(
                "max_model_len %d does not fit in the KV pool (%d tokens); using %d",
                max_model_len,
                pool_tokens,
                pool_tokens,
            )
            max_model_len = pool_tokens
        self.max_model_len = max_model_len
        self.kv_manager = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens, max_model_len
        )
        eos = set(model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.groups: dict[str, RequestGroup] = {}
        self.num_steps = 0

    # ---- requests --------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("A prompt dict needs a 'prompt' or a 'prompt_token_ids' key.")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            "A prompt must be a string, a list of token ids, or a dict with 'prompt_token_ids'."
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request. Raises ValueError (engine untouched) on bad input."""
        if request_id in self.groups:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        params = (params or SamplingParams()).clone()
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(
                f"n ({params.n}) must be <= max_num_seqs ({self.scheduler.max_num_seqs}): the n "
                "sequences of a request run together; lower n or raise max_num_seqs."
            )
        prompt_text, token_ids = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
        params.all_stop_token_ids |= self.eos_token_ids
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        group = RequestGroup(request_id, prompt_text, token_ids, params)
        if arrival_time is not None:
            group.arrival_time = arrival_time
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        request = Request(
            request_id=request_id if params.n == 1 else f"{request_id}#0",
            prompt_token_ids=token_ids,
            sampling_params=params,
            max_tokens=max_tokens,
            group_id=request_id,
            arrival_time=group.arrival_time,
            device=self.config.device,
        )
        self._add_sequence(group, request)
        self.groups[request_id] = group
        self.scheduler.add_request(request)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        if not all(isinstance(t, numbers.Integral) for t in token_ids):
            raise ValueError("Prompt token ids must be integers.")
        vocab_size = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise ValueError(f"Prompt token ids must be in [0, {vocab_size}).")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}: shorten the prompt (it must leave room for one new token) "
                "or raise max_model_len."
            )

    def _add_sequence(self, group: RequestGroup, request: Request) -> None:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params
        )
        group.sequences[request.index] = _Sequence(request, detokenizer)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Ends requests (by the caller's ids) at once and frees their KV blocks."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            group = self.groups.pop(request_id, None)
            if group is None:
                continue
            seq_ids = [s.request.request_id for s in group.sequences.values()]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            # Sequences not forked yet never will be: the parent is gone.
            for seq in group.sequences.values():
                seq.request.status = RequestStatus.FINISHED_ABORTED

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration. Returns an output for every request that made progress."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        runner_output = self.runner.execute(scheduler_output)
        self.num_steps += 1
        return self._process(scheduler_output, runner_output)

    def _process(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        for child, parent in sched.forked:
            group = self.groups[parent.group_id]
            self._add_sequence(group, child)
        for request_id, top in out.prompt_logprobs.items():
            request = self.scheduler.requests[request_id]
            group = self.groups[request.group_id]
            # Preempted mid-prompt, a request recomputes from the start: skip positions returned.
            num_returned = len(group.prompt_logprobs) - 1 - request.num_computed_tokens
            group.prompt_logprobs.extend(self._logprob_dicts(top)[max(num_returned, 0) :])

        updated = self.scheduler.update(sched, out.sampled)
        for entry in sched.scheduled:
            request = entry.request
            if request.num_computed_tokens >= request.num_prompt_tokens:
                request.prompt_logprobs_done = True
        stopped: list[str] = []
        for request in updated:
            group = self.groups[request.group_id]
            touched[group.request_id] = group
            if group.first_token_time is None:
                group.first_token_time = now
                group.num_cached_tokens = max(request.num_cached_tokens, 0)
            request_id = request.request_id
            if request.logprobs is not None:
                top = out.logprobs[request_id]
                request.cumulative_logprob += top.logprobs[0][0]  # column 0: the new token
                request.logprobs.extend(self._logprob_dicts(top))
            if request.status == RequestStatus.FINISHED_STOPPED:
                continue  # ended by a stop token (EOS, stop_token_ids): not part of the text
            seq = group.sequences[request.index]
            stop = seq.detokenizer.update([request.token_ids[-1]], request.num_output_tokens)
            if stop is not None:
                request.stop_reason = stop
                if request.is_finished:  # max_tokens reached on the same token
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    stopped.append(request_id)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)

        outputs = []
        for group in touched.values():
            outputs.append(self._make_output(group))
            if group.finished:
                group.finished_time = now
                del self.groups[group.request_id]
        return outputs

    def _logprob_dicts(self, top: TopLogprobs) -> list[PositionLogprobs]:
        dicts = []
        for ids, lps, rank in zip(top.token_ids, top.logprobs, top.ranks):
            entry = {ids[0]: Logprob(lps[0], rank, self.tokenizer.decode([ids[0]]))}
            for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, r, self.tokenizer.decode([tid]))
            dicts.append(entry)
        return dicts

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        completions = []
        for index in sorted(group.sequences):
            seq = group.sequences[index]
            request = seq.request
            finished = request.is_finished
            seq.text += seq.detokenizer.get_delta_text(finished)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=seq.text,
                    token_ids=request.output_token_ids,  # a fresh slice
                    cumulative_logprob=(
                        request.cumulative_logprob if request.logprobs is not None else None
                    ),
                    logprobs=request.logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        metrics = {"arrival_time": group.arrival_time}
        first_scheduled_time = group.sequences[0].request.first_scheduled_time
        if first_scheduled_time is not None:
            metrics["first_scheduled_time"] = first_scheduled_time
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs,
            outputs=completions,
            finished=group.finished,
            num_cached_tokens=group.num_cached_tokens,
            metrics=metrics,
        )

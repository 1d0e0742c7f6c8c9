"""LLMEngine, the front end: add_request / abort_request / step() -> RequestOutputs.

It owns the text side (tokenizing prompts, detokenizing outputs, stop strings) and the caller's
view of each request (its n sequences, their tokens, logprobs and finish reasons), and drives an
EngineCore (engine/core.py) that schedules and runs steps on plain token ids.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import numbers
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from quire.config import EngineConfig, QuireConfig, resolve_config
from quire.engine.core import CoreStats, EngineCore, EngineCoreOutput
from quire.engine.core_client import CoreProcessClient
from quire.engine.detokenizer import IncrementalDetokenizer
from quire.engine.request import Request, RequestStatus
from quire.engine.speculator import SpecDecodingStats
from quire.lora.adapter import load_adapter
from quire.lora_request import LoRARequest
from quire.messages import TopLogprobs
from quire.model.model_config import ModelConfig, load_model_config
from quire.model.tokenizer import load_tokenizer
from quire.outputs import (
    CompletionOutput,
    EngineStats,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)
from quire.sampling_params import RequestOutputKind, SamplingParams
from quire.structured_output.compiler import GrammarCompiler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from quire.worker.worker import WorkerState

logger = logging.getLogger(__name__)
atexit.register(gc.unfreeze)  # an engine freezes its start's heap: exit still frees it

PromptType = str | list[int] | dict[str, Any]


def _user_lora_names(core_names: Iterable[str]) -> list[str]:
    """Adapters' names without the number of their load (`_worker_lora`'s "name@load")."""
    return sorted({name.rpartition("@")[0] for name in core_names})


@dataclass
class _Sequence:
    """One completion as the caller sees it."""

    req_id: str  # the core's id of this sequence
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # generated
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    text: str = ""  # released so far (never a prefix of a stop string that may still match)
    num_decoded: int = 0  # of token_ids, those given to the detokenizer


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
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_finished: int = 0  # of the sequences
    # Whether its text is decoded as tokens arrive: for an output each step, or for stop
    # strings to be found; else once, when the sequence finishes. (Read every step: kept.)
    text_each_step: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        self.text_each_step = params.output_kind is RequestOutputKind.CUMULATIVE or bool(
            params.stop
        )

    @property
    def finished(self) -> bool:
        return self.num_finished == self.params.n

    @property
    def sequence_ids(self) -> list[str]:
        """The core's ids of all n sequences, forked yet or not."""
        if self.params.n == 1:
            return [self.request_id]
        return [f"{self.request_id}#{i}" for i in range(self.params.n)]


def check_draft_vocabulary(
    config: EngineConfig, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A ValueError unless the draft model shares the target's vocabulary: its size, and its
    tokenizer's token -> id map (skipped when the draft is the target itself)."""
    draft = config.speculative_config.model
    draft_config = load_model_config(replace(config, model=draft, tokenizer=None))
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(
            f"The draft model's vocabulary ({draft_config.vocab_size} tokens, {draft}) differs "
            f"from the target's ({model_config.vocab_size}): speculative decoding needs a draft "
            "model with the target's tokenizer."
        )
    if os.path.realpath(draft) == os.path.realpath(config.model):
        return
    if load_tokenizer(draft).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"The draft model's tokenizer ({draft}) maps tokens to other ids than the target's: "
            "speculative decoding needs a draft model with the target's tokenizer."
        )


class LLMEngine:
    def __init__(self, config: EngineConfig):
        """`config`: the arguments, validated; the engine resolves its QuireConfig from them
        (`quire_config`, with the KV pool's size once the core has measured it)."""
        self.config = config
        quire_config = resolve_config(config)
        model_config = quire_config.model.architecture
        self.model_config = model_config
        self.dtype = quire_config.model.dtype
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            check_draft_vocabulary(config, model_config, self.tokenizer)
        # Compiles structured outputs' grammars to validate them; the core shares its cache when
        # it runs in this process.
        self.grammar_compiler = GrammarCompiler(
            lambda: self.tokenizer,
            model_config.vocab_size,
            model_config.eos_token_ids,
            config.grammar_cache_bytes,
        )
        # Multi-LoRA: the adapters requests may name (checked before the model loads), each
        # with the number of its load (a reload under the same name is another adapter to the
        # workers and the prefix cache).
        self.lora_config = config.lora_config()
        self.loras: dict[str, tuple[LoRARequest, int]] = {}
        self._lora_loads = itertools.count(1)
        for lora_request in config.lora_requests():
            self.add_lora(lora_request)
        if config.engine_core_process:
            self.core = CoreProcessClient(quire_config)
        else:
            self.core = EngineCore(quire_config, self.grammar_compiler)
        self.quire_config: QuireConfig = self.core.config
        self.max_model_len = self.core.max_model_len
        eos = set(model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.groups: dict[str, RequestGroup] = {}
        # What start made (modules, tokenizer, tables) lives as long as the engine: taken out
        # of the collector's generations (vLLM does the same), a full collection then walks only
        # what the steps made, not the whole model (at batch 512 it took 5 ms a step). They go
        # back when the engine shuts down or its LLM is dropped (the engine's own reference
        # cycles need the collector), and at exit.
        gc.collect()
        gc.freeze()

    # ---- adapters (multi-LoRA) ---------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Makes an adapter available to requests by its name, checked against the base model
        (LoRAAdapterError, a ValueError naming the file and field, if it does not fit). Raises
        ValueError if LoRA is off or the name is taken."""
        if self.lora_config is None:
            raise ValueError("LoRA adapters need enable_lora (--enable-lora).")
        if lora_request.lora_name in self.loras:
            raise ValueError(
                f"An adapter named {lora_request.lora_name!r} is already loaded: unload it first, "
                "or give this one another name."
            )
        load_adapter(
            lora_request.lora_name,
            lora_request.lora_path,
            self.model_config,
            self.lora_config.max_lora_rank,
        )
        self.loras[lora_request.lora_name] = (lora_request, next(self._lora_loads))

    def remove_lora(self, name: str) -> None:
        """Unloads adapter `name`: new requests cannot name it; running ones finish with it.
        Raises KeyError for a name not loaded."""
        if name not in self.loras:
            raise KeyError(f"No adapter named {name!r} is loaded.")
        del self.loras[name]

    def list_loras(self) -> list[LoRARequest]:
        return [lora_request for lora_request, _ in self.loras.values()]

    def get_lora(self, name: str) -> LoRARequest:
        """The adapter loaded under `name`. Raises KeyError for a name not loaded."""
        if name not in self.loras:
            raise KeyError(f"No adapter named {name!r} is loaded.")
        return self.loras[name][0]

    def lora_adapters_in_use(self) -> tuple[list[str], list[str]]:
        """The adapters of running requests and of waiting ones, by the names requests gave
        them, sorted (one that was unloaded while its requests run is still named)."""
        stats = self.core.stats()
        running = _user_lora_names(stats.running_lora_adapters)
        return running, _user_lora_names(stats.waiting_lora_adapters)

    def _worker_lora(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The adapter as the core and workers see it (its name carries its load's number);
        loads it first if it is new (LLM.generate's lora_request)."""
        if lora_request is None:
            return None
        known = self.loras.get(lora_request.lora_name)
        if known is None:
            self.add_lora(lora_request)
            known = self.loras[lora_request.lora_name]
        elif known[0].lora_path != lora_request.lora_path:
            raise ValueError(
                f"Adapter {lora_request.lora_name!r} is loaded from {known[0].lora_path}, not "
                f"{lora_request.lora_path}: unload it first, or give the other another name."
            )
        loaded, version = known
        return LoRARequest(f"{loaded.lora_name}@{version}", loaded.lora_int_id, loaded.lora_path)

    @property
    def scheduler(self):  # inspection of an in-process core (tests)
        return self.core.scheduler

    @property
    def kv_manager(self):
        return self.core.kv_manager

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def num_kv_blocks(self) -> int:
        return self.core.num_kv_blocks

    def core_stats(self) -> CoreStats:
        return self.core.stats()

    def stats(self) -> EngineStats:
        """A snapshot of the engine: pool, queues, counters, the worker's fast paths. Needs the
        engine core in this process."""
        core = self.core.stats()
        workers = self.core.worker_states()
        worker = workers[0]
        spec = core.spec_decoding
        return EngineStats(
            num_kv_blocks=self.num_kv_blocks,
            num_free_kv_blocks=core.num_free_kv_blocks,
            num_running=core.num_running,
            num_waiting=core.num_waiting,
            num_steps=self.num_steps,
            num_preemptions=core.num_preemptions,
            prefix_cache_queries=core.prefix_cache_queries,
            prefix_cache_hits=core.prefix_cache_hits,
            spec_decode_num_drafts=0 if spec is None else spec.num_drafts,
            spec_decode_num_draft_tokens=0 if spec is None else spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=0 if spec is None else spec.num_accepted_tokens,
            c_decode_step=worker.c_decode_step,
            cuda_graphs=worker.cuda_graphs,
            gemv_path=worker.gemv_path,
            qmatmul_path=worker.qmatmul_path,
            weight_bytes=tuple(w.weight_bytes for w in workers),
            most_steps_in_flight=core.most_steps_in_flight,
            num_scheduled_ahead=core.num_scheduled_ahead,
        )

    def check_invariants(self) -> None:
        """Raises AssertionError saying what is wrong unless the engine is idle: no request
        unfinished, every KV block free with ref count 0, and no request left on any rank's
        worker (EngineCore.idle_problems). Needs the engine core in this process."""
        problems = []
        if self.groups:
            problems.append(f"{len(self.groups)} request(s) unfinished ({', '.join(self.groups)})")
        problems += self.core.idle_problems()
        if problems:
            raise AssertionError("The engine is not idle: " + "; ".join(problems) + ".")

    def worker_states(self) -> list[WorkerState]:
        """What each rank's worker holds and which fast paths it runs, in rank order."""
        return self.core.worker_states()

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's running totals; None when it is off."""
        return self.core.stats().spec_decoding

    def shutdown(self) -> None:
        """Ends the engine's core and worker processes (if any); the engine cannot run
        afterwards."""
        self.core.shutdown()
        gc.unfreeze()

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and queues a request, with `lora_request`'s adapter if given. Raises
        ValueError (engine untouched) on bad input."""
        if request_id in self.groups:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        worker_lora = self._worker_lora(lora_request)
        params = (params or SamplingParams()).clone()
        max_num_seqs = self.config.max_num_seqs
        if params.n > max_num_seqs:
            raise ValueError(
                f"n ({params.n}) must be <= max_num_seqs ({max_num_seqs}): the n "
                "sequences of a request run together; lower n or raise max_num_seqs."
            )
        prompt_text, token_ids = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
        if params.logit_bias is not None:
            vocab_size = self.model_config.vocab_size
            if max(params.logit_bias) >= vocab_size:
                raise ValueError(
                    f"logit_bias keys must be token ids in [0, {vocab_size}), got "
                    f"{max(params.logit_bias)}."
                )
        if params.structured_outputs is not None:
            self.grammar_compiler.compile(params.structured_outputs)  # GrammarError if invalid
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
            lora_request=worker_lora,
        )
        self.groups[request_id] = group
        self.core.add_request(request)

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

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Ends requests (by the caller's ids) at once and frees their KV blocks."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            group = self.groups.pop(request_id, None)
            if group is not None:
                self.core.abort_requests(group.sequence_ids)

    def abort_all(self) -> None:
        """Ends every request, including sequences a failed step forked (their group never
        heard of them), and leaves the engine empty and ready for new requests."""
        self.groups.clear()
        self.core.abort_all()

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def reset_prefix_cache(self) -> None:
        """Forgets the prefix cache's entries for free blocks (vLLM's `reset_prefix_cache`):
        later prompts are computed from cold, e.g. for a benchmark or a reference run."""
        self.core.reset_prefix_cache()

    def has_kv_transfers(self) -> bool:
        """Whether K/V is being pulled, or held for a decode instance: step on even when no
        request is unfinished (disaggregation)."""
        return self.config.disaggregation_mode is not None and self.core.has_kv_transfers()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration. Returns an output for every request that made progress."""
        return self._process(self.core.step())

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        now = time.monotonic()
        groups = self.groups
        touched: dict[str, RequestGroup] = {}
        stopped: list[str] = []
        for out in core_outputs:
            group = groups.get(out.group_id)
            if group is None:
                continue
            seq = group.sequences.get(out.index)
            if seq is None:  # the first output of this sequence (a fork's, or the first's)
                seq = group.sequences[out.index] = self._new_sequence(group, out.req_id)
            elif seq.status.is_finished:  # ended here by a stop string; a core process ran on
                continue
            if group.first_scheduled_time is None:
                group.first_scheduled_time = out.first_scheduled_time
            if out.prompt_logprobs is not None:
                # Preempted mid-prompt, a request recomputes from the start: skip positions
                # already returned.
                num_returned = len(group.prompt_logprobs) - 1 - out.prompt_logprobs_start
                dicts = self._logprob_dicts(out.prompt_logprobs)
                group.prompt_logprobs.extend(dicts[max(num_returned, 0) :])
            if not out.new_token_ids:
                if out.status == RequestStatus.FINISHED_ERROR:  # failed before any token
                    self._set_status(group, seq, out.status, out.stop_reason)
                    touched[group.request_id] = group
                continue
            touched[group.request_id] = group
            if group.first_token_time is None:
                group.first_token_time = now
                group.num_cached_tokens = out.num_cached_tokens
            if self._append(group, seq, out):
                stopped.append(seq.req_id)
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)

        outputs = []
        for group in touched.values():
            finished = group.finished
            if finished:
                group.finished_time = now
                del groups[group.request_id]
            elif group.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(self._make_output(group, finished))
        return outputs

    def _new_sequence(self, group: RequestGroup, req_id: str) -> _Sequence:
        detokenizer = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, group.params)
        logprobs = [] if group.params.logprobs is not None else None
        return _Sequence(req_id, detokenizer, logprobs=logprobs)

    @staticmethod
    def _set_status(
        group: RequestGroup, seq: _Sequence, status: RequestStatus, reason: int | str | None
    ) -> None:
        if status.is_finished and not seq.status.is_finished:
            group.num_finished += 1
        seq.status, seq.stop_reason = status, reason

    def _append(self, group: RequestGroup, seq: _Sequence, out: EngineCoreOutput) -> bool:
        """Takes a step's new tokens into the sequence and, where its text is decoded as tokens
        arrive (`text_each_step`) or it finishes, into the detokenizer; True when a stop string
        ended it (the core must then end it too). A step can bring several tokens (verified
        speculative ones): with stop strings they go to the detokenizer one by one, and those
        after a stop string's are dropped."""
        new_ids = out.new_token_ids
        stop = None
        if group.text_each_step or out.status.is_finished:
            text_ids = new_ids
            if seq.num_decoded < len(seq.token_ids):  # decoded once, at the end
                text_ids = seq.token_ids[seq.num_decoded :] + new_ids
            if out.status == RequestStatus.FINISHED_STOPPED:
                text_ids = text_ids[:-1]  # ended by a stop token (EOS, stop_token_ids): not text
            detokenizer = seq.detokenizer
            num_tokens = len(seq.token_ids) + len(new_ids)
            if not group.params.stop:
                if text_ids:
                    detokenizer.update(text_ids, num_tokens)
            else:
                num_before = len(seq.token_ids)  # with stop strings, every token is decoded
                for i, token_id in enumerate(text_ids, start=1):
                    stop = detokenizer.update([token_id], num_before + i)
                    if stop is not None:
                        new_ids = new_ids[:i]
                        break
            seq.num_decoded = len(seq.token_ids) + len(new_ids)
        seq.token_ids.extend(new_ids)
        self._set_status(group, seq, out.status, out.stop_reason)
        if seq.logprobs is not None and out.logprobs is not None:
            n, rows = len(new_ids), out.logprobs
            top = TopLogprobs(rows.token_ids[:n], rows.logprobs[:n], rows.ranks[:n])
            seq.cumulative_logprob += sum(row[0] for row in top.logprobs)  # column 0
            seq.logprobs.extend(self._logprob_dicts(top))
        if stop is None:
            return False
        self._set_status(group, seq, RequestStatus.FINISHED_STOPPED, stop)
        return not out.status.is_finished  # else the core ended it already (max_tokens)

    def _logprob_dicts(self, top: TopLogprobs) -> list[PositionLogprobs]:
        dicts = []
        for ids, lps, rank in zip(top.token_ids, top.logprobs, top.ranks):
            entry = {ids[0]: Logprob(lps[0], rank, self.tokenizer.decode([ids[0]]))}
            for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, r, self.tokenizer.decode([tid]))
            dicts.append(entry)
        return dicts

    def _make_output(self, group: RequestGroup, finished: bool) -> RequestOutput:
        completions = []
        sequences = group.sequences
        for index in sorted(sequences) if len(sequences) > 1 else sequences:
            seq = sequences[index]
            seq.text += seq.detokenizer.get_delta_text(seq.status.is_finished)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=seq.text,
                    token_ids=list(seq.token_ids),
                    cumulative_logprob=(
                        seq.cumulative_logprob if seq.logprobs is not None else None
                    ),
                    logprobs=seq.logprobs,
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        metrics = {"arrival_time": group.arrival_time}
        if group.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = group.first_scheduled_time
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=group.num_cached_tokens,
            metrics=metrics,
        )

"""LLM: the offline batch API.  LLM(model).generate(prompts, params) -> list[RequestOutput]."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import itertools
import time
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from quire.config import EngineConfig
from quire.engine.llm_engine import LLMEngine, PromptType
from quire.engine_args import EngineArgs
from quire.entrypoints.chat_template import render_chat
from quire.lora_request import LoRARequest
from quire.outputs import EngineStats, RequestOutput
from quire.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, object]]


def _engine_args_signature() -> inspect.Signature:
    """`LLM(...)`'s signature as help() and editors show it: `model`, then every other field of
    EngineArgs as a keyword argument with its default."""
    defaults = EngineArgs()
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(EngineArgs):
        kind = inspect.Parameter.KEYWORD_ONLY
        if f.name == "model":
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(
            inspect.Parameter(f.name, kind, default=getattr(defaults, f.name), annotation=f.type)
        )
    return inspect.Signature(params)


class LLM:
    """`LLM(model, **engine_args)`: the keyword arguments are EngineArgs' fields (engine_args.py:
    dtype, max_model_len, max_num_seqs, ...), the same knobs as `quire`'s flags; an unknown one
    raises TypeError naming the closest."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self._start(EngineArgs.from_kwargs(model=model, **kwargs).create_engine_config())

    __init__.__signature__ = _engine_args_signature()

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        # Dropping the LLM frees its engine only through the collector, which skips what the
        # engine froze at start (LLMEngine.__init__): unfreeze then.
        weakref.finalize(self, gc.unfreeze)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """A snapshot: KV blocks (all, free), running and waiting requests, steps, preemptions,
        prefix-cache queries and hits, speculative decoding's counters, and which fast paths the
        worker runs (the C decode step, CUDA graphs, the matmul kernels' loops)."""
        return self.engine.stats()

    def check_invariants(self) -> None:
        """Raises AssertionError saying what is wrong unless the engine is idle: nothing
        running or waiting, every KV block free with ref count 0, and on every rank no request
        left in the worker. For tests, between `generate` calls."""
        self.engine.check_invariants()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of the prompts.
        `lora_request`: the adapter every prompt runs, or one per prompt (None: the base model;
        needs `enable_lora=True`). Bad input (an invalid prompt, params or adapter) raises
        ValueError before anything is queued."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"Got {len(params)} SamplingParams for {len(prompts)} prompts: "
                    "pass one, or one per prompt."
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"Got {len(loras)} lora_requests for {len(prompts)} prompts: pass one, or "
                    "one per prompt."
                )
        params = [_final_only(p) for p in params]  # the outputs of finished requests only
        request_ids = [str(next(self._ids)) for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, p, lora in zip(request_ids, prompts, params, loras):
                self.engine.add_request(request_id, prompt, p, lora_request=lora)
                added.append(request_id)
        except Exception:
            self.engine.abort_request(added)
            raise
        try:
            return self._run(request_ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(request_ids)
            raise

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        start = time.perf_counter()
        num_output_tokens = 0
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    bar.update(1)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"{num_output_tokens / max(elapsed, 1e-9):.1f} tok/s")
        bar.close()
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the chat template (the model's, or `chat_template`, a
        Jinja template's text), handing it `tools`, then generates. Bad messages or a template
        that cannot render them raise ValueError before anything is queued."""
        if not messages:
            raise ValueError("messages must hold a conversation (a list of at least one message).")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.apply_chat_template(
                conversation, add_generation_prompt, chat_template=chat_template, tools=tools
            )
            ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(
        self,
        messages: ChatMessages,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text `chat` would generate from (see `render_chat`)."""
        return render_chat(
            self.engine.tokenizer, messages, tools, add_generation_prompt, chat_template
        )


def _final_only(params: SamplingParams | None) -> SamplingParams:
    """A copy of `params` whose request gives one output, when it finishes (its text decoded
    then, once, unless stop strings need it as it grows)."""
    params = (params or SamplingParams()).clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params

"""ModelForward: one model, its KV cache, and the fastest way to run a step on it.

The target model and a draft model are two instances. Each is loaded, given its KV cache
(`allocate_kv`), and from then on runs a prepared step with one call: `forward` gives the hidden
states of the step's rows, `compute_logits` the LM head over some of them. Where the step can go
through a faster path than the modules, the path is chosen once, when the cache exists:

- the C decode step (worker/cpu_step.py) for decode-only steps on a CPU, which can also take
  each row's argmax in the same call (`argmax_tokens`); its LM head and argmax also take the
  greedy rows of any other step (`greedy_tokens`, `fuses_lm_head_argmax`);
- CUDA graphs (worker/cuda_graph.py) for decode-only batches on a GPU that run no adapter (the
  target only: its `max_num_seqs` ladder);
- the model's modules, in a forward context of the step's attention metadata, for every other
  step.

Under tensor parallelism every rank must take the same path at every step (their collectives pair
up), so the ranks agree on the C step once, when it is chosen.

A pipeline stage's ModelForward holds its range of the layers and their KV cache: a stage other
than the first receives the previous stage's hidden states and residual before its layers run, a
stage other than the last sends its own to the next (`forward` then returns None). The C step
runs a stage's layers too (worker/cpu_step.py), unless tensor parallelism splits the stage.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from quire.attention.backend import AttentionBackend, AttentionMetadata
from quire.attention.forward_context import forward_context
from quire.config import ModelSettings, QuireConfig
from quire.distributed.parallel_state import (
    all_ranks_agree,
    pp_size,
    recv_from_previous_stage,
    send_to_next_stage,
    tp_size,
)
from quire.layers.lora_linear import get_lora_context
from quire.lora.config import LoRAConfig
from quire.model.loader import load_model
from quire.model.model_config import ModelConfig
from quire.sample.sampler import greedy
from quire.worker import host_memory, kv_cache
from quire.worker.cpu_step import CpuStepRunner
from quire.worker.cuda_graph import CUDAGraphRunner

logger = logging.getLogger(__name__)


def make_backend(name: str) -> AttentionBackend:
    if name == "triton":
        from quire.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from quire.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


class ModelForward:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
    ):
        """`dtype`: of the activations (the hidden states a pipeline stage receives)."""
        self.model = model
        self.model_config = model_config
        self.dtype = dtype
        self.backend = backend
        first = model.attention_layers[0]
        self.num_heads = first.num_heads  # this rank's share (all of them with one rank)
        self.num_kv_heads = first.num_kv_heads
        self.kv_cache: kv_cache.KVCache | None = None
        self.cpu_step: CpuStepRunner | None = None
        self.cuda_graphs: CUDAGraphRunner | None = None

    @classmethod
    def load(
        cls,
        settings: ModelSettings,
        max_position: int,
        backend: AttentionBackend,
        huge_pages: bool,
        lora: LoRAConfig | None = None,
        layers: range | None = None,
    ) -> ModelForward:
        """Loads `settings.model`'s weights (this rank's share; of `layers` only, a pipeline
        stage's) for positions below `max_position`; on a CPU onto huge pages if `huge_pages`;
        with `lora`, every linear an adapter may target holds its adapter slots."""
        model = load_model(
            settings,
            settings.architecture,
            settings.dtype,
            max_position,
            max_loras=0 if lora is None else lora.max_loras,
            max_lora_rank=0 if lora is None else lora.max_lora_rank,
            layers=layers,
        )
        if settings.device == "cpu" and huge_pages:
            host_memory.move_to_huge_pages(model)
        return cls(model, settings.architecture, backend, settings.dtype)

    @property
    def is_last_stage(self) -> bool:
        """Whether this model ends in the LM head (the last pipeline stage, or the only one)."""
        return self.model.is_last_stage

    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds (parameters, buffers and packed or quantized
        copies)."""
        tensors = {}
        for module in self.model.modules():
            values = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            values += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
            for value in values:
                # oneDNN-packed copies (layout _mkldnn) have no storage to point at
                key = value.data_ptr() if value.layout == torch.strided else id(value)
                tensors[key] = value.numel() * value.element_size()
        return sum(tensors.values())

    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes of one KV block of this model on this rank."""
        rank_config = dataclasses.replace(
            self.model_config,
            num_key_value_heads=self.num_kv_heads,
            num_hidden_layers=len(self.model.layer_range),
        )
        return kv_cache.bytes_per_block(rank_config, block_size, kv_dtype)

    def allocate_kv(
        self,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        huge_pages: bool,
        cuda_graphs: QuireConfig | None = None,
    ) -> None:
        """Allocates this model's KV cache and chooses its fast path. `cuda_graphs`: the config
        to capture decode graphs over the cache by (the target's)."""
        param = next(self.model.parameters())
        self.kv_cache = kv_cache.KVCache.allocate(
            len(self.model.layer_range),
            num_blocks,
            block_size,
            self.num_kv_heads,
            self.model_config.head_dim,
            kv_dtype,
            param.device,
            huge_pages,
        )
        if pp_size() == 1 or tp_size() == 1:
            self.cpu_step = CpuStepRunner.for_model(self.model, self.kv_cache)
        if tp_size() > 1 and param.device.type == "cpu":
            if not all_ranks_agree(self.cpu_step is not None):
                self.cpu_step = None
                logger.info(
                    "The C decode step is off under tensor parallelism (it needs bf16 GEMV "
                    "weights and the shared-memory all-reduce on every rank; gloo alone has no "
                    "C side); decode steps run the modules"
                )
        if cuda_graphs is not None:
            self.cuda_graphs = CUDAGraphRunner(
                self.model, self.kv_cache.layers, self.backend, cuda_graphs
            )

    @property
    def path(self) -> str:
        """The fast path chosen for decode-only steps: "c_step", "cuda_graphs" or "modules"."""
        if self.cpu_step is not None:
            return "c_step"
        return "cuda_graphs" if self.cuda_graphs is not None else "modules"

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:  # [num_tokens, hidden_size] after the final norm; None: sent on
        model = self.model
        if self.cpu_step is not None and self.cpu_step.takes(metadata, input_ids.shape[0]):
            if not model.is_first_stage:
                self.cpu_step.receive(self._receive(input_ids))
            if model.is_last_stage:
                return self.cpu_step.forward(input_ids, positions, metadata)
            send_to_next_stage(self.cpu_step.forward_to_next_stage(input_ids, positions, metadata))
            return None
        # the graphs hold the base model's linears: a step that runs adapters runs eagerly
        if (
            self.cuda_graphs is not None
            and get_lora_context() is None
            and self.cuda_graphs.can_run(metadata)
        ):
            return self.cuda_graphs.run(input_ids, positions, metadata)
        hidden = residual = None
        if not model.is_first_stage:
            hidden, residual = self._receive(input_ids).unbind()
        with forward_context(metadata, self.kv_cache.layers, self.backend):
            out = model(input_ids, positions, hidden, residual)
        if model.is_last_stage:
            return out
        send_to_next_stage(torch.stack(out))
        return None

    def argmax_tokens(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
    ) -> list[int] | None:
        """Each row's argmax token in one call, where the fast path fuses the forward, the LM
        head and the argmax for this step (a decode-only step through the C step); None where
        it does not: then `forward` and `compute_logits` give the logits."""
        if self.cpu_step is None or not self.cpu_step.takes_argmax(metadata, input_ids.shape[0]):
            return None
        if not self.model.is_first_stage:
            self.cpu_step.receive(self._receive(input_ids))
        return self.cpu_step.argmax_tokens(input_ids, positions, metadata)

    def _receive(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The previous pipeline stage's hidden states and residual for this step's tokens,
        [2, num_tokens, hidden_size] (one message)."""
        received = torch.empty(
            (2, input_ids.shape[0], self.model_config.hidden_size),
            dtype=self.dtype,
            device=input_ids.device,
        )
        return recv_from_previous_stage(received)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        return self.model.compute_logits(hidden)

    @property
    def fuses_lm_head_argmax(self) -> bool:
        """Whether `greedy_tokens` runs the C step's LM head and argmax: no [rows, vocab]
        logits tensor (on a GPU the logits stay on the device, and the sampler's argmax costs
        no more)."""
        return self.cpu_step is not None and self.cpu_step.has_lm_head

    def greedy_tokens(
        self,
        hidden: torch.Tensor,  # [rows, hidden_size], after the final norm
    ) -> list[int]:  # each row's argmax token over `compute_logits(hidden)`
        """The argmax of each row's logits: the C step's LM head and argmax in one call where
        it takes the rows (`fuses_lm_head_argmax`), else `compute_logits` and the sampler's
        argmax."""
        if self.cpu_step is not None and self.cpu_step.takes_lm_head_argmax(hidden.shape[0]):
            return self.cpu_step.lm_head_argmax(hidden)
        return greedy(self.compute_logits(hidden)).tolist()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.kv_cache.copy_blocks(copies)

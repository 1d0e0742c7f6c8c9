"""quire: an LLM inference and serving engine."""

import os

# libgomp (torch's OpenMP runtime on CPU) with no spin count set throttles its spin-wait to ~1000
# iterations on small machines, so worker threads fall asleep between the hundreds of short
# parallel regions of a decode step and each region pays a futex wake-up: a batch-1 decode step
# of SmolLM2 took 109 ms instead of 19 ms on 2 cores. A finite spin count keeps them awake across
# a step and lets them sleep when the engine is idle. Only effective if torch is not yet imported.
# (Every variable quire reads is in quire/envs.py; this one it sets.)
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

from quire.config import EngineConfig
from quire.engine_args import EngineArgs
from quire.entrypoints.llm import LLM
from quire.lora_request import LoRARequest
from quire.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from quire.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "EngineStats",
    "Logprob",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]

"""quire: an LLM inference and serving engine."""

from quire.config import EngineConfig
from quire.entrypoints.llm import LLM
from quire.outputs import CompletionOutput, Logprob, RequestOutput
from quire.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "Logprob", "RequestOutput", "SamplingParams"]

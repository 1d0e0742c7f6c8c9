"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys before rotary."""

from quire.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

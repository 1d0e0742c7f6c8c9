"""Multi-LoRA: adapters read from PEFT folders and GGUF files (adapter.py), kept loaded with LRU
eviction and written into the model's adapter slots (manager.py), and the batched ops that add
each token row's delta (ops.py on CPU, triton_ops.py on GPU). The linears that take them are
quire/layers/lora_linear.py's."""

from quire.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from quire.lora.config import LoRAConfig
from quire.lora.manager import LoRAManager
from quire.lora_request import LoRARequest

__all__ = [
    "LoRAAdapter",
    "LoRAAdapterError",
    "LoRAConfig",
    "LoRAManager",
    "LoRARequest",
    "load_adapter",
]

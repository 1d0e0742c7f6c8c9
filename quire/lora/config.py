"""LoRAConfig: how many adapters a step and the process hold, and their largest rank, spelled
as vLLM spells them (LoRARequest, which adapter a request runs, is plain data in
quire/lora_request.py)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 4  # distinct adapters in one step (the model's adapter slots)
    max_lora_rank: int = 16  # the largest rank an adapter may have; slots are this wide
    max_cpu_loras: int | None = None  # adapters kept loaded; None: max(max_loras, 8)

    def __post_init__(self) -> None:
        if type(self.max_loras) is not int or self.max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, not {self.max_loras!r}.")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, not "
                f"{self.max_lora_rank!r}: pass the smallest that holds your adapters' ranks."
            )
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", max(self.max_loras, 8))
        elif type(self.max_cpu_loras) is not int or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer of at least "
                f"max_loras ({self.max_loras}): every adapter in a step is kept loaded."
            )

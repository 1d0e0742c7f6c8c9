"""LoRARequest: which adapter a request runs, as vLLM spells it; plain data that crosses from the
caller to the engine and to every worker. `parse_lora_module` reads `--lora-modules`' items."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs: `lora_name` (what the OpenAI `model` field names),
    `lora_int_id` (a positive id, unique per adapter) and `lora_path` (a PEFT folder or a GGUF
    LoRA file)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, not {self.lora_name!r}.")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, not {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"lora_path must name a PEFT adapter folder or a GGUF LoRA file, not "
                f"{self.lora_path!r}."
            )


def parse_lora_module(text: str, lora_int_id: int) -> LoRARequest:
    """One `--lora-modules` item: `name=path`, or vLLM's JSON form `{"name": ..., "path": ...,
    "base_model_name": ...}` (the base model's name is not checked: the adapter's shapes are)."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"lora module {text!r} is not valid JSON: {error}.") from None
        unknown = sorted(set(item) - {"name", "path", "base_model_name"})
        if not isinstance(item, dict) or unknown or "name" not in item or "path" not in item:
            raise ValueError(
                f'lora module {text!r}: the JSON form takes "name" and "path" (and '
                'optionally "base_model_name").'
            )
        return LoRARequest(item["name"], lora_int_id, item["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora module {text!r} must be name=path, or the JSON form.")
    return LoRARequest(name, lora_int_id, path)

"""LoRAManager: the adapters one worker holds, loaded and in the model's slots.

Up to `max_cpu_loras` adapters stay loaded (host memory); loading one more evicts the least
recently used that no running request holds (`acquire` / `release`). Up to `max_loras` of them
sit in the model's slots (every LoRALinear's stacked A and B); `activate` gives a step's adapters
slots, keeping those already placed and reusing the least recently used slot of an adapter the
step does not run. Each load is a new `AdapterIdentity` (name, path, load number): what the
prefix cache keys blocks on, so a reload (from another path, or the same path changed) never
shares blocks with what it replaced.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from quire.layers.lora_linear import LoRALinear
from quire.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from quire.lora.config import LoRAConfig
from quire.lora_request import LoRARequest
from quire.model.model_config import ModelConfig


@dataclass(frozen=True)
class AdapterIdentity:
    name: str
    path: str
    version: int  # the load's number in this manager: a reload is another identity


@dataclass
class _Loaded:
    adapter: LoRAAdapter
    identity: AdapterIdentity
    users: int = 0  # running requests holding it
    unloading: bool = False  # removed while in use: dropped at its last release


class LoRAManager:
    def __init__(self, config: LoRAConfig, model_config: ModelConfig, model: nn.Module):
        self.config = config
        self.model_config = model_config
        self.layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
        if not self.layers:
            raise ValueError("The model has no adapter slots: load it with max_loras > 0.")
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()  # least recently used first
        self._slots: list[AdapterIdentity | None] = [None] * config.max_loras
        self._slot_order: list[int] = []  # slots, least recently activated first
        self._loads = itertools.count(1)

    def add(self, request: LoRARequest) -> AdapterIdentity:
        """Loads the request's adapter unless it is loaded (evicting the least recently used
        adapter no request holds, past max_cpu_loras). Raises LoRAAdapterError for a bad
        adapter, a name loaded from another path, or one still being unloaded."""
        loaded = self._loaded.get(request.lora_name)
        if loaded is not None:
            if loaded.unloading:
                raise LoRAAdapterError(
                    f"adapter {request.lora_name!r} is being unloaded: load it again once the "
                    "requests that use it have finished."
                )
            if loaded.identity.path != request.lora_path:
                raise LoRAAdapterError(
                    f"adapter {request.lora_name!r} is loaded from {loaded.identity.path}, not "
                    f"{request.lora_path}: unload it first, or give the other one another name."
                )
            self._loaded.move_to_end(request.lora_name)
            return loaded.identity
        adapter = load_adapter(
            request.lora_name, request.lora_path, self.model_config, self.config.max_lora_rank
        )
        identity = AdapterIdentity(request.lora_name, request.lora_path, next(self._loads))
        self._evict(self.config.max_cpu_loras - 1)
        self._loaded[request.lora_name] = _Loaded(adapter, identity)
        return identity

    def remove(self, name: str) -> None:
        """Unloads adapter `name`; one that running requests hold goes at their last release.
        Raises KeyError for a name not loaded."""
        loaded = self._loaded[name]
        if loaded.users:
            loaded.unloading = True
        else:
            del self._loaded[name]

    def acquire(self, name: str) -> AdapterIdentity:
        """A running request holds adapter `name` (loaded): it is not evicted until released."""
        loaded = self._loaded[name]
        loaded.users += 1
        self._loaded.move_to_end(name)
        return loaded.identity

    def release(self, name: str) -> None:
        loaded = self._loaded[name]
        loaded.users -= 1
        assert loaded.users >= 0
        if loaded.unloading and not loaded.users:
            del self._loaded[name]

    def loaded(self) -> list[str]:
        """The loaded adapters' names, least recently used first."""
        return list(self._loaded)

    def activate(self, names: Iterable[str]) -> dict[str, int]:
        """Slots for a step's adapters (loaded, at most max_loras): name -> slot. Writes every
        LoRALinear's slot for an adapter not already in one."""
        wanted = {name: self._loaded[name].identity for name in dict.fromkeys(names)}
        if len(wanted) > len(self._slots):
            raise ValueError(
                f"{len(wanted)} adapters in one step, and max_loras is {len(self._slots)}."
            )
        placed = {identity: slot for slot, identity in enumerate(self._slots) if identity}
        free = [
            slot
            for slot in self._free_first()
            if self._slots[slot] is None or self._slots[slot] not in wanted.values()
        ]
        result = {}
        for name, identity in wanted.items():
            slot = placed.get(identity)
            if slot is None:
                slot = free.pop(0)
                adapter = self._loaded[name].adapter
                for layer in self.layers:
                    layer.set_slot(slot, adapter.layers[layer.layer_idx])
                self._slots[slot] = identity
            self._touch(slot)
            result[name] = slot
        return result

    def _free_first(self) -> list[int]:
        """Slots in the order they are reused: empty ones, then least recently activated."""
        empty = [slot for slot, identity in enumerate(self._slots) if identity is None]
        return empty + [slot for slot in self._slot_order if self._slots[slot] is not None]

    def _touch(self, slot: int) -> None:
        if slot in self._slot_order:
            self._slot_order.remove(slot)
        self._slot_order.append(slot)

    def _evict(self, keep: int) -> None:
        """Unloads the least recently used adapters no request holds, down to `keep`."""
        for name in [n for n, loaded in self._loaded.items() if not loaded.users]:
            if len(self._loaded) <= keep:
                return
            del self._loaded[name]
        assert len(self._loaded) <= keep, "every loaded adapter is held: max_cpu_loras too low"

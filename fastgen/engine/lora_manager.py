"""The LoRA adapters of one engine: their names, the adapters read into host memory, the device slots.

- `load(name, path)` reads the PEFT adapter and checks it against the served model at once, so a
  missing or corrupt one, a rank over `max_lora_rank`, an unknown target or a shape that does not fit
  the base raises ValueError and nothing is registered. Each load gets a new `lora_id`, never reused:
  it is also the adapter's prefix-cache namespace, so KV computed under one adapter never serves
  another, the base model, or an adapter loaded later under the same name.
- Host memory holds at most `max_cpu_loras` read adapters, least recently used evicted; an evicted one
  is read again from its directory the next time a step needs it.
- `activate(lora_ids)`, before each step, puts the step's adapters into device slots: one already there
  keeps its slot, another takes a free slot or the least recently used one this step does not need.
  The scheduler never puts more than `max_loras` distinct adapters in one step, so there always is one.
- Under tensor parallelism every rank holds its shard of the same slots: each slot write is kept
  (`take_writes`) and sent to the other ranks before the step that needs it; they read the adapter from
  the same directory.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from fastgen.executor.distributed import LoRASlotWrite
from fastgen.models.lora import LoRAAdapter, load_lora_adapter
from fastgen.models.lora_layers import LoRALayers
from fastgen.sampling_params import FieldValueError


class UnknownLoRAError(FieldValueError):
    """A request or call names an adapter this engine has not loaded (a 404 when served). Its field is
    `lora`, so a server's prompt-error wrapping keeps it as it is, not as an error of the prompt."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "lora")


@dataclass(frozen=True, slots=True)
class LoadedLoRA:
    """One registered adapter."""

    name: str
    """What requests select it by."""
    path: str
    """Its PEFT directory (read again after eviction from host memory)."""
    lora_id: int
    """Its id for this load (>= 1; 0 is the base model): what sequences carry and the KV namespace."""


class LoRAManager:
    """Names -> adapters, the host LRU cache of read adapters, and which adapter sits in which device slot."""

    def __init__(self, model: nn.Module, layers: LoRALayers, max_cpu_loras: int, dtype: torch.dtype,
                 replicated: bool = False) -> None:
        """Adapters for `model`, whose LoRA linears are `layers`; at most `max_cpu_loras` kept read in
        host memory, in `dtype`. `replicated`: other tensor-parallel ranks hold shards of the same slots,
        so every slot write is also kept for them (`take_writes`)."""
        if max_cpu_loras < layers.max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({layers.max_loras})")
        self.model = model
        self.layers = layers
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.adapters: dict[str, LoadedLoRA] = {}
        """The registered adapters by name."""
        self._by_id: dict[int, LoadedLoRA] = {}
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slots: list[int] = [0] * layers.max_loras  # lora_id in each device slot (0: empty)
        self._slot_use: list[int] = [0] * layers.max_loras  # the step count when each slot was last needed
        self._steps = 0
        self._ids = itertools.count(1)
        self._writes: list[LoRASlotWrite] | None = [] if replicated else None

    @property
    def max_loras(self) -> int:
        """Device slots: distinct adapters one step may use."""
        return self.layers.max_loras

    def _read(self, name: str, path: str) -> LoRAAdapter:
        adapter = load_lora_adapter(name, path, self.model, self.layers.max_rank, self.dtype)
        self.layers.check(adapter)
        return adapter

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in the host cache as its most recently used entry, evicting past `max_cpu_loras`."""
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def load(self, name: str, path: str) -> LoadedLoRA:
        """Read, check and register the PEFT adapter at `path` as `name`; ValueError naming the problem
        (nothing registered) for a bad adapter or a name already loaded."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter's name must be a non-empty str, got {name!r}")
        if not isinstance(path, str) or not path:
            raise ValueError(f"LoRA adapter {name!r}: its path must be a non-empty str, got {path!r}")
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (from {self.adapters[name].path}); "
                             "unload it first")
        adapter = self._read(name, path)
        loaded = LoadedLoRA(name, path, next(self._ids))
        self.adapters[name] = loaded
        self._by_id[loaded.lora_id] = loaded
        self._keep(loaded.lora_id, adapter)
        return loaded

    def get(self, name: str) -> LoadedLoRA:
        """The registered adapter `name`; `UnknownLoRAError` when there is none."""
        loaded = self.adapters.get(name)
        if loaded is None:
            known = ", ".join(map(repr, sorted(self.adapters))) or "none"
            raise UnknownLoRAError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return loaded

    def name_of(self, lora_id: int) -> str | None:
        """The name of the adapter with `lora_id` (None for 0, the base model)."""
        return self._by_id[lora_id].name if lora_id else None

    def unload(self, name: str) -> None:
        """Forget adapter `name` and empty its device slot (the engine first refuses while requests use it)."""
        loaded = self.get(name)
        del self.adapters[name]
        del self._by_id[loaded.lora_id]
        self._host.pop(loaded.lora_id, None)
        if loaded.lora_id in self._slots:
            slot = self._slots.index(loaded.lora_id)
            self._write(slot, None)
            self._slots[slot], self._slot_use[slot] = 0, 0

    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Device slots holding the adapters `lora_ids` (base model 0 excluded), writing the ones not there yet."""
        if len(lora_ids) > self.max_loras:
            raise ValueError(f"a step needs {len(lora_ids)} LoRA adapters but only {self.max_loras} device slots exist "
                             "(max_loras)")
        self._steps += 1
        placed = {}
        for lora_id in lora_ids:
            if lora_id in self._slots:
                placed[lora_id] = self._slots.index(lora_id)
                self._slot_use[placed[lora_id]] = self._steps
        for lora_id in sorted(lora_ids - set(placed)):
            slot = min((s for s in range(self.max_loras) if s not in placed.values()), key=lambda s: self._slot_use[s])
            self._slots[slot] = 0  # empty until its new adapter is fully written
            self._write(slot, self._host_copy(lora_id))
            self._slots[slot], self._slot_use[slot] = lora_id, self._steps
            placed[lora_id] = slot
        return placed

    def _write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put `adapter` (None: nothing) into device slot `slot`, and keep the write for the other ranks."""
        self.layers.write(slot, adapter)
        if self._writes is not None:
            self._writes.append(LoRASlotWrite(slot, None, None) if adapter is None else
                                LoRASlotWrite(slot, adapter.name, adapter.path))

    def take_writes(self) -> list[LoRASlotWrite]:
        """The slot writes made since the last call, in order, for the other tensor-parallel ranks to repeat
        before the next step (empty when the slots are not replicated)."""
        if self._writes is None:
            return []
        writes, self._writes = self._writes, []
        return writes

    def _host_copy(self, lora_id: int) -> LoRAAdapter:
        """The read adapter `lora_id` (read again from its directory if it was evicted), now most recently used."""
        adapter = self._host.get(lora_id)
        if adapter is None:
            loaded = self._by_id[lora_id]
            adapter = self._read(loaded.name, loaded.path)
        self._keep(lora_id, adapter)
        return adapter

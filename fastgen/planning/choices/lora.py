"""The plan's LoRA fields: whether adapters are served, how many distinct ones a step may use (device
slots), their largest rank, how many stay read in host memory, and what their stacks cost.

Every adaptable linear of the decoder layers holds `max_loras` slots of rank `max_lora_rank` times the
projections merged into it (`fastgen.models.lora_layers`), allocated once beside the weights; the
policy takes those bytes from the KV cache's room and quotes them in `max_loras`' reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastgen.models.lora_layers import lora_stack_bytes
from fastgen.planning.model_facts import ModelFacts
from fastgen.planning.plan import format_bytes

DEFAULT_MAX_LORAS = 4
"""Distinct adapters per step unless told: vLLM's default of 1 would serialise any mix of adapters,
and 4 keeps the stacks a small share of the weights for ranks up to `DEFAULT_MAX_LORA_RANK`."""

DEFAULT_MAX_LORA_RANK = 16
"""vLLM's default `max_lora_rank`: the rank most published adapters are trained at or under."""

LORA_FIELDS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
"""The plan fields this module chooses."""


@dataclass(frozen=True, slots=True)
class LoRAChoice:
    """The LoRA fields of a plan, their reasons and what their stacks take."""

    enable_lora: bool
    """Adapters are served."""
    max_loras: int
    """Device slots (0 with LoRA off)."""
    max_lora_rank: int
    """Largest rank a slot holds (0 with LoRA off)."""
    max_cpu_loras: int
    """Adapters kept in host memory (0 with LoRA off)."""
    stack_bytes: int
    """Bytes of every adaptable linear's slots, on each device."""
    reasons: dict[str, str]
    """A reason for each of `LORA_FIELDS`."""


def choose_lora(model: ModelFacts, user: dict[str, Any], dtype: torch.dtype, tp: int, offload: str) -> LoRAChoice:
    """The LoRA fields for `model` from the user's overrides (`normalise_overrides`' output); ValueError,
    naming the field, for values LoRA cannot run with here."""
    if not user.get("enable_lora", False):
        set_anyway = [name for name in LORA_FIELDS[1:] if user.get(name)]
        if set_anyway:
            raise ValueError(f"{set_anyway[0]} is set but enable_lora is not: pass enable_lora=True to serve adapters")
        why = "LoRA is off (enable_lora=True to serve adapters)"
        return LoRAChoice(False, 0, 0, 0, 0, {name: why for name in LORA_FIELDS})
    reasons = {"enable_lora": "set by the user"}

    def pick(name: str, default: int, why: str) -> int:
        value = user.get(name, default)
        reasons[name] = "set by the user" if name in user else why
        if value < 1:
            raise ValueError(f"{name} must be at least 1 with enable_lora, got {value}")
        return value

    max_loras = pick("max_loras", DEFAULT_MAX_LORAS, f"{DEFAULT_MAX_LORAS} distinct adapters per step (vLLM's "
                     "default of 1 would run any mix of adapters one adapter a step)")
    rank = pick("max_lora_rank", DEFAULT_MAX_LORA_RANK, f"vLLM's default: rank {DEFAULT_MAX_LORA_RANK}, what most "
                "published adapters are trained at or under")
    max_cpu = pick("max_cpu_loras", max_loras, "as many as device slots (vLLM's default); an adapter evicted from "
                   "host memory is read again from its directory when next used")
    if max_cpu < max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu}) must be at least max_loras ({max_loras}): every adapter in a "
                         "device slot is also kept in host memory")
    stacks = lora_stack_bytes(model.lora_linears, max_loras, rank, dtype)
    reasons["max_loras"] += (f"; their stacks take {format_bytes(stacks)} ({max_loras} slots of rank {rank} over "
                             f"the {len(model.lora_linears)} adaptable linears), taken from the KV cache's room")
    if offload != "none":
        reasons["max_loras"] += (f"; with offload={offload!r} they stay resident (slots are written between steps, "
                                 "whichever layers are streamed out)")
    if tp > 1:
        reasons["max_loras"] += (f"; each of the {tp} ranks holds its share (B's rows of a column-parallel linear, A's "
                                 "columns of a row-parallel one), counted here at the whole")
    return LoRAChoice(True, max_loras, rank, max_cpu, stacks, reasons)


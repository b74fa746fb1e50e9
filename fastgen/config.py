"""Engine configuration: the keywords of `fastgen.pipeline(...)`.

Fields that are also `Plan` fields default to None, meaning "let the policy choose"
(`fastgen/policy.py`, which validates them and says why it chose each value); a value given
here always wins over the policy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fastgen.plan import PLAN_FIELDS


@dataclass(slots=True)
class EngineConfig:
    """How one engine instance is built. Every field is a keyword of `fastgen.pipeline`."""

    model: str | None = None
    """Checkpoint directory or cached hub id; None = the bundled demo model."""
    device: str | None = None
    """"cpu" or "cuda[:i]"; None = CUDA when available, else CPU."""
    max_length: int | None = None
    """Longest prompt + output a request may have (MII's `max_length`); None = the model's context."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides the plan's `kv_cache_memory`."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks shared with earlier prompts."""
    seed: int | None = None
    """Seed of the default generator used by unseeded sampled requests."""
    progress: bool = True
    """Show progress bars while loading weights and compiling buckets."""
    dtype: torch.dtype | str | None = None
    """Plan: weights and KV dtype (None = the policy's choice)."""
    attention_backend: str | None = None
    """Plan: "torch" (reference op everywhere) or "triton" (a CPU needs TRITON_INTERPRET=1); None/"auto" = policy."""
    compile: str | None = None
    """Plan: torch.compile of the step per bucket: "off", "default" or "max-autotune"; None = policy
    (the environment variable FASTGEN_COMPILE, when set, is the default instead)."""
    cuda_graphs: bool | None = None
    """Plan: capture each bucket once as a CUDA graph (CUDA only); None = policy."""
    buckets: tuple[int, ...] | None = None
    """Plan: static step sizes in tokens, ascending; a step pads to the smallest that holds it."""
    token_budget: int | None = None
    """Plan: tokens computed per step (FastGen's `max_ragged_batch_size`)."""
    max_seqs: int | None = None
    """Plan: sequences per step (FastGen's `max_ragged_sequence_count`), at most token_budget."""
    block_size: int | None = None
    """Plan: KV block size in tokens."""
    kv_cache_memory: int | float | None = None
    """Plan: KV-cache size, bytes (int) or a fraction (float in (0, 1]) of the memory left after weights."""
    tensor_parallel: int | None = None
    """Plan: processes the weights and KV cache are split over (one per GPU; on a CPU they share the
    cores); None = the policy's choice, or WORLD_SIZE under torchrun."""
    replica_num: int | None = None
    """Plan: engine replicas; a serving option (`fastgen.serve`), 1 for a pipeline."""

    def __post_init__(self) -> None:
        for name in ("max_length", "num_kv_blocks", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < (0 if name == "seed" else 1)):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'seed' else 'positive'} int or None, "
                                 f"got {value!r}")
        for name in ("enable_prefix_caching", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.device is not None:
            torch.device(self.device)  # raises on a malformed device string
        if self.tensor_parallel is not None and (isinstance(self.tensor_parallel, bool)
                                                 or not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1):
            raise ValueError(f"tensor_parallel must be a positive int or None, got {self.tensor_parallel!r}")
        if self.replica_num not in (None, 1):
            raise ValueError("replica_num > 1 runs several engine processes: use fastgen.serve(..., replica_num=N)")

    def plan_overrides(self) -> dict[str, Any]:
        """The plan fields the user set (None = the policy chooses)."""
        return {name: getattr(self, name) for name in PLAN_FIELDS}

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> "EngineConfig":
        """Build from `pipeline` keywords; an unknown keyword is a TypeError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(map(repr, unknown))} "
                            f"(supported: {', '.join(sorted(known - {'model'}))})")
        return cls(model=model, **kwargs)

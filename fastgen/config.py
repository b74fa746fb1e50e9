"""Engine configuration: the keywords of `fastgen.pipeline(...)`, validated in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fastgen.models.config import parse_dtype


@dataclass(slots=True)
class EngineConfig:
    """How one engine instance is built. Every field is a keyword of `fastgen.pipeline`."""

    model: str | None = None
    """Checkpoint directory or cached hub id; None = the bundled demo model."""
    dtype: torch.dtype | str | None = None
    """Weights and KV dtype; None = the checkpoint's, with fp16 turned into bf16 on the CPU (no fast fp16 there)."""
    device: str | None = None
    """"cpu" or "cuda[:i]"; None = CUDA when available, else CPU."""
    max_length: int | None = None
    """Longest prompt + output a request may have (MII's `max_length`); None = the model's context."""
    token_budget: int = 768
    """Tokens computed per step (FastGen's `max_ragged_batch_size`)."""
    max_seqs: int = 512
    """Sequences per step (FastGen's `max_ragged_sequence_count`); at most `token_budget`."""
    block_size: int | None = None
    """KV block size in tokens; None = FastGen's rule (64 for head_dim 128, 128 for head_dim <= 64)."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides `kv_cache_memory`."""
    kv_cache_memory: int | float | None = None
    """KV-cache size: bytes (int) or a fraction of free memory (float in (0, 1]); None = 0.9 of free
    GPU memory or 0.2 of available RAM, never more than max_seqs full-length sequences need."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks shared with earlier prompts."""
    seed: int | None = None
    """Seed of the default generator used by unseeded sampled requests."""
    progress: bool = True
    """Show a progress bar while loading weights."""
    attention_backend: str = "auto"
    """Paged attention implementation: "auto" (Triton on CUDA, torch on CPU), "torch" (the reference
    everywhere) or "triton" (everywhere; on a CPU only with TRITON_INTERPRET=1, as CI does)."""

    compile: str = "off"
    """torch.compile of the model step per bucket: "off", "default" or "max-autotune"."""
    cuda_graphs: bool = False
    """Capture each bucket once as a CUDA graph and replay it (CUDA only)."""
    buckets: tuple[int, ...] | None = None
    """Static step sizes in tokens; a step pads to the smallest one that holds it. None = powers of
    two up to token_budget when compiling or capturing, else no padding (exact shapes)."""

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        if self.buckets is not None:
            buckets = tuple(self.buckets) if isinstance(self.buckets, (list, tuple)) else None
            if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
                raise ValueError(f"buckets must be a non-empty list of positive ints, got {self.buckets!r}")
            self.buckets = tuple(sorted(set(buckets)))
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if self.compile not in ("off", "default", "max-autotune"):
            raise ValueError(f"compile must be 'off', 'default' or 'max-autotune', got {self.compile!r}")
        for name in ("token_budget", "max_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_seqs > self.token_budget:
            raise ValueError(f"max_seqs ({self.max_seqs}) must not exceed token_budget ({self.token_budget})")
        if self.buckets is not None and self.buckets[-1] > self.token_budget:
            raise ValueError(f"the largest bucket ({self.buckets[-1]}) exceeds token_budget ({self.token_budget}): "
                             "no step could use it")
        for name in ("max_length", "block_size", "num_kv_blocks", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1)):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        mem = self.kv_cache_memory
        if mem is not None:
            if isinstance(mem, bool) or not isinstance(mem, (int, float)):
                raise TypeError(f"kv_cache_memory must be bytes (int) or a fraction (float), got {mem!r}")
            if isinstance(mem, float) and not 0 < mem <= 1:
                raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {mem}")
            if isinstance(mem, int) and mem < 1:
                raise ValueError(f"kv_cache_memory in bytes must be positive, got {mem}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
        if self.device is not None:
            torch.device(self.device)  # raises on a malformed device string

    def resolved_buckets(self) -> tuple[int, ...]:
        """The bucket list the runner pads to (empty = exact shapes, no padding)."""
        if self.buckets is not None:
            return self.buckets
        if self.compile == "off" and not self.cuda_graphs:
            return ()
        powers = [1 << i for i in range(self.token_budget.bit_length()) if (1 << i) < self.token_budget]
        return tuple(powers + [self.token_budget])

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> "EngineConfig":
        """Build from `pipeline` keywords; an unknown keyword is a TypeError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(map(repr, unknown))} (supported: {', '.join(sorted(known - {'model'}))})")
        return cls(model=model, **kwargs)

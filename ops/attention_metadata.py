"""The flat, ragged description of one engine step that every attention call reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens come from and where their K/V go.

    A step holds `T` query tokens from `S` sequences, laid out sequence after sequence. Padded
    entries (added to reach a static bucket shape) have slot -1, an empty query range and a
    seq_len of 0; attention skips them.
    """

    slot_mapping: torch.Tensor
    """int64 `[T]`: KV-cache slot (`block_id * block_size + offset`) of each query token; -1 = padding."""
    block_tables: torch.Tensor
    """int32 `[S, max_blocks]`: the KV blocks of each sequence, in order; unused columns are ignored."""
    seq_lens: torch.Tensor
    """int32 `[S]`: tokens of each sequence whose K/V exist after this step (cached + new)."""
    query_start_loc: torch.Tensor
    """int32 `[S + 1]`: sequence `s` owns query tokens `query_start_loc[s]:query_start_loc[s + 1]`."""
    backend: str = "auto"
    """Attention implementation: "auto" (by device: Triton on CUDA, torch on CPU), "torch", "triton" or "cpu"
    (the torch path with its decode rows on fastgen's C++ CPU kernel).
    A plain string, so torch.compile specialises on it instead of guarding on tensors."""
    long_rope: torch.Tensor | None = None
    """bool `[T]`: the token's rotary embedding takes LongRoPE's long factors (attention itself ignores
    it; it rides here because every layer already receives this step's metadata). None: by position."""
    state_slots: torch.Tensor | None = None
    """int32 `[S]`: the recurrent-state slot of each sequence, for layers that keep a fixed-size state per
    sequence instead of K/V (hybrid models' linear attention); -1 where a sequence has none. None: the
    step carries no slots (attention layers never read them)."""
    lora_slots: torch.Tensor | None = None
    """int32 `[T]`: the LoRA adapter slot of each token (-1: the base model), for the adapted linears
    (`fastgen.models.lora_layers`); None: the step runs the base model only."""
    step_plans: dict = field(default_factory=dict)
    """What eager layers work out from this metadata once per step and every layer reuses (host copies
    of the offsets, the resolved KV slots, the CPU decode plans, the rotary cos/sin rows of the step's
    positions): filled by the first layer. A new metadata object per step; compiled graphs never read it."""

    @property
    def num_seqs(self) -> int:
        """Number of sequence rows `S` (padded rows included)."""
        return self.seq_lens.shape[0]

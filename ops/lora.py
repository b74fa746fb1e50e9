"""The batched LoRA delta beside a base linear, for a flat batch of rows that each name an adapter slot.

Every row of the flat ragged batch carries `slot_ids[row]`: the slot of the adapter it runs under, or
-1 for none. One linear's adapters sit stacked per slot, zero-padded to the stack's rank:
`lora_a[max_loras, rank, in]`, `lora_b[max_loras, out, rank]`, `scales[max_loras]`. The delta is
punica's SGMV idea in torch ops: rows are grouped by slot and each distinct adapter present costs one
shrink (`x @ A^T`) and one expand (`@ B^T * scale`) over its rows only, so a step mixing few adapters
pays for those, not for every slot. The zero padding contributes nothing, so adapters of different
ranks share one stack.
"""

from __future__ import annotations

import torch


def add_lora(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """`output[T, out]` plus, on each row with `slot_ids[row] >= 0`, that slot's LoRA delta of `x[T, in]`.

    Returns a new tensor (the base output is left as it is). Rows with slot -1 keep the base output.
    """
    if slot_ids.dim() != 1 or slot_ids.shape[0] != x.shape[0]:
        raise ValueError(f"slot_ids must be one slot per row ({x.shape[0]}), got shape {tuple(slot_ids.shape)}")
    adapted = (slot_ids >= 0).nonzero().squeeze(1)
    if adapted.numel() == 0:
        return output
    slots = slot_ids[adapted]
    order = torch.argsort(slots, stable=True)
    rows, slots = adapted[order], slots[order]
    present, counts = torch.unique_consecutive(slots, return_counts=True)
    delta = torch.empty(rows.shape[0], output.shape[1], dtype=output.dtype, device=output.device)
    start = 0
    # One host sync for the group sizes, then one matmul pair per adapter present in the step.
    for slot, count in zip(present.tolist(), counts.tolist()):
        segment = x.index_select(0, rows[start:start + count])
        shrunk = segment @ lora_a[slot].t()
        torch.mul(shrunk @ lora_b[slot].t(), scales[slot], out=delta[start:start + count])
        start += count
    return output.index_add(0, rows, delta)


class LoRAStack:
    """One linear's adapters stacked by slot, zero-padded to `max_rank`, ready for `add_lora`.

    `lora_a[max_loras, max_rank, in]`, `lora_b[max_loras, out, max_rank]` and `scales[max_loras]`
    are allocated once, so the step sees fixed shapes whichever adapters are loaded.
    """

    def __init__(self, max_loras: int, max_rank: int, in_features: int, out_features: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras} and {max_rank}")
        self.max_rank = max_rank
        self.lora_a = torch.zeros(max_loras, max_rank, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device)
        self.scales = torch.zeros(max_loras, dtype=dtype, device=device)

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Put adapter weights `a[r, in]`, `b[out, r]` (r <= max_rank) and its scale into `slot`."""
        rank = a.shape[0]
        if rank > self.max_rank:
            raise ValueError(f"LoRA rank {rank} exceeds the stack's max_rank {self.max_rank}")
        if tuple(a.shape) != (rank, self.lora_a.shape[2]) or tuple(b.shape) != (self.lora_b.shape[1], rank):
            raise ValueError(f"LoRA shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a linear of "
                             f"in={self.lora_a.shape[2]}, out={self.lora_b.shape[1]}")
        self.clear(slot)
        self.lora_a[slot, :rank].copy_(a)
        self.lora_b[slot, :, :rank].copy_(b)
        self.scales[slot] = scale

    def clear(self, slot: int) -> None:
        """Empty `slot` (all zeros: a row pointing at it gets no delta)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scales[slot] = 0.0

    def apply(self, output: torch.Tensor, x: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """`add_lora` with this stack's weights."""
        return add_lora(output, x, self.lora_a, self.lora_b, self.scales, slot_ids)

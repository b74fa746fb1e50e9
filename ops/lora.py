"""The batched LoRA delta beside a base linear, for a flat batch of rows that each name an adapter slot.

Every row of the flat ragged batch carries `slot_ids[row]`: the slot of the adapter it runs under, or
-1 for none. One linear's adapters sit stacked per slot, zero-padded to the stack's rank:
`lora_a[max_loras, rank, in]`, `lora_b[max_loras, out, rank]`, `scales[max_loras]`. The delta is
punica's SGMV idea in torch ops: rows are grouped by slot and each distinct adapter present costs one
shrink (`x @ A^T`) and one expand (`@ B^T * scale`) over its rows only, so a step mixing few adapters
pays for those, not for every slot. The zero padding contributes nothing, so adapters of different
ranks share one stack.

`add_lora_op` is the same function registered as the custom op `fastgen::add_lora_`, which
`torch.compile` treats as opaque (its host-side grouping would otherwise break the graph).
"""

from __future__ import annotations

import torch


def add_lora_(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    slot_ids: torch.Tensor,
) -> None:
    """Add to `output[T, out]`, in place, on each row with `slot_ids[row] >= 0`, that slot's LoRA delta
    of `x[T, in]`; rows with slot -1 keep the base output."""
    if slot_ids.dim() != 1 or slot_ids.shape[0] != x.shape[0]:
        raise ValueError(f"slot_ids must be one slot per row ({x.shape[0]}), got shape {tuple(slot_ids.shape)}")
    adapted = (slot_ids >= 0).nonzero().squeeze(1)
    if adapted.numel() == 0:
        return
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
    output.index_add_(0, rows, delta)


# Registered like `fastgen::paged_attention` (see there for why `torch.library.Library`): one opaque op a
# compiled layer calls, since grouping rows by slot reads their sizes on the host.
_LIBRARY = torch.library.Library("fastgen", "FRAGMENT")
_LIBRARY.define("add_lora_(Tensor(a!) output, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scales, "
                "Tensor slot_ids) -> ()")
_LIBRARY.impl("add_lora_", add_lora_, "CompositeExplicitAutograd")


def _fake(output, x, lora_a, lora_b, scales, slot_ids):
    return None


torch.library.register_fake("fastgen::add_lora_", _fake, lib=_LIBRARY)

add_lora_op = torch.ops.fastgen.add_lora_
"""`fastgen::add_lora_`: `add_lora_`'s contract, as one op a compiled layer calls."""

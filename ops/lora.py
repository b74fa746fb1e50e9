"""The batched LoRA delta beside a base linear, for a flat batch of rows that each name an adapter slot.

Every row of the flat ragged batch carries `slot_ids[row]`: the slot of the adapter it runs under, or
-1 for none. One linear's adapters sit stacked per slot, zero-padded to the stack's rank:
`lora_a[max_loras, rank, in]`, `lora_b[max_loras, out, rank]`, `scales[max_loras]`. The delta is
punica's SGMV idea in torch ops: rows are grouped by slot (once per step, `group_by_slot`) and each
distinct adapter present costs one shrink (`x @ A^T`) and one expand (`@ B^T * scale`) over its rows
only, so a step mixing few adapters pays for those, not for every slot. The zero padding contributes
nothing, so adapters of different ranks share one stack.

`add_lora_op` is the same function registered as the custom op `fastgen::add_lora_`, which
`torch.compile` treats as opaque (its host-side grouping would otherwise break the graph).
"""

from __future__ import annotations

import torch


def group_by_slot(slot_ids: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouping `add_lora_` reads, worked out once per step for every adapted linear: the rows
    ordered by slot (`[T]`, the base model's -1 rows first) and, on the host, how many rows each
    slot has (`[num_slots + 1]`: the base rows, then slot 0, 1, ...). Both have fixed shapes, so a
    step compiled for T rows serves any mix of adapters."""
    if slot_ids.dim() != 1:
        raise ValueError(f"slot_ids must be one slot per row, got shape {tuple(slot_ids.shape)}")
    order = torch.argsort(slot_ids, stable=True)
    # The one host sync of a step's LoRA: the group sizes.
    counts = torch.bincount(slot_ids.long() + 1, minlength=num_slots + 1).cpu()
    return order, counts


def add_lora_(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Add to `output[T, out]`, in place, on each row with an adapter slot, that slot's LoRA delta of
    `x[T, in]`; rows of the base model (slot -1) keep the base output. `order` and `counts` are
    `group_by_slot` of the step's slots."""
    if order.shape[0] != x.shape[0]:
        raise ValueError(f"order must list every row ({x.shape[0]}), got shape {tuple(order.shape)}")
    sizes = counts.tolist()
    base = sizes[0]
    if base == x.shape[0]:
        return
    rows = order[base:]
    segments = x.index_select(0, rows)
    delta = torch.empty(rows.shape[0], output.shape[1], dtype=output.dtype, device=output.device)
    start = 0
    # One matmul pair per adapter present in the step, over its rows only.
    for slot, count in enumerate(sizes[1:]):
        if count:
            shrunk = segments[start:start + count] @ lora_a[slot].t()
            torch.mul(shrunk @ lora_b[slot].t(), scales[slot], out=delta[start:start + count])
            start += count
    output.index_add_(0, rows, delta)


# Registered like `fastgen::paged_attention` (see there for why `torch.library.Library`): one opaque op a
# compiled layer calls, since grouping rows by slot reads their sizes on the host.
_LIBRARY = torch.library.Library("fastgen", "FRAGMENT")
_LIBRARY.define("add_lora_(Tensor(a!) output, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scales, "
                "Tensor order, Tensor counts) -> ()")
_LIBRARY.impl("add_lora_", add_lora_, "CompositeExplicitAutograd")


def _fake(output, x, lora_a, lora_b, scales, order, counts):
    return None


torch.library.register_fake("fastgen::add_lora_", _fake, lib=_LIBRARY)

add_lora_op = torch.ops.fastgen.add_lora_
"""`fastgen::add_lora_`: `add_lora_`'s contract, as one op a compiled layer calls."""

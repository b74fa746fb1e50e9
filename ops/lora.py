"""The batched LoRA delta beside a base linear, for a flat batch of rows that each name an adapter slot.

Every row of the flat ragged batch carries `slot_ids[row]`: the slot of the adapter it runs under, or
-1 for none. One linear's adapters sit stacked per slot, zero-padded to the stack's rank:
`lora_a[max_loras, rank, in]` and B transposed, `lora_b[max_loras, rank, out]`, the adapter's scale
already multiplied into B. The zero padding contributes nothing, so adapters of different ranks share one
stack. A merged linear (q/k/v, gate/up) gives each of its `output_sizes` sections its own rank/n ranks
(`fastgen.models.lora_layers`).

On the CPU the delta is one C++ kernel call per linear (`fastgen.ops.cpu_kernels.lora`): rows grouped by
slot, the shrink, and an expand that reads only each section's own block of B. On a 2-core EPYC (bf16,
SmolLM2-135M's four adapted linears of a layer, 4 adapters) it takes 55 us a layer at 16 rows against
515 us for the torch ops below, and 0.5 against 1.3 ms at 256 rows.

On a GPU it is two Triton kernels (`fastgen.ops.triton_lora`): a shrink, and an expand per section, each
row reading its own slot's A and B with no host sync.

Both kernels read only each row's slot (`slot_ids`), so a step bound for them is laid out by
`slots_only`: no host sync on a GPU, where the step is one a CUDA graph can capture and replay (the
padding rows of a bucket carry slot -1).

Elsewhere (a CPU without a compiler, `FASTGEN_CPU_KERNELS=off`) it is punica's SGMV idea in torch ops.
Once per step (`group_by_slot`) the rows are laid out as a padded `[slots present, M]` grid, M the most
rows any present adapter has (one host sync). Then each linear does one gather of its input rows, one
batched shrink (`bmm` with A^T), one batched expand (`bmm` with B), one mask of the padding and one
index-add into the output: five ops whatever the number of adapters, against three per adapter for a
loop over them. Steps whose adapters fill only part of the stack gather the present slots' A and B first.

`add_lora_op` (the grid) and `add_lora_slots_op` (the kernels) are the same functions registered as the
custom ops `fastgen::add_lora_` and `fastgen::add_lora_slots_`, which `torch.compile` treats as opaque.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgen.ops.cpu_kernels import active_op, cpu_lora_delta
from fastgen.ops.cpu_kernels.decode import KERNEL_DTYPES


@dataclass(frozen=True, slots=True)
class LoRAGrid:
    """One step's rows by adapter slot, as every adapted linear of the step reads them.

    Every shape depends only on the step's row count T and the stack's slots L, never on how the rows
    split over adapters, so a compiled layer serves every mix without a recompile: the grid's own
    size travels in `meta`, which the op reads on the host. A step for the kernels (`slots_only`) has
    the slots alone: `rows`, `valid` and `meta` are None."""

    slot_ids: torch.Tensor
    """`[T]` int32: each row's slot, -1 for the base model (what the kernels read)."""
    rows: torch.Tensor | None
    """`[L * T]` int64: row j of the s-th present slot is entry s * M + j (the rest, padding, point at row 0)."""
    valid: torch.Tensor | None
    """`[L * T]`, 1 for a real row and 0 for padding, in the stacks' dtype."""
    meta: torch.Tensor | None
    """Host `[2 + L]` int64: S (slots present), M (rows of the fullest), then the present slots in stack
    order (-1 after them)."""
    adapted: bool
    """Whether any row may have an adapter (S > 0), for eager callers to skip the op without reading `meta`
    (always True for device slots, which are not read on the host)."""


def lora_kernel_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a kernel that reads only the slots computes the delta of stacks of `dtype` on `device`: the
    Triton kernels on a GPU, the C++ kernel on a CPU that has built it (compiled here at first use)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and dtype in KERNEL_DTYPES and active_op("lora_delta") is not None


def slots_only(slot_ids: torch.Tensor) -> LoRAGrid:
    """The step of rows with `slot_ids` (`[T]`, -1 = the base model) as the kernels read it. On a GPU nothing
    is read on the host (what lets a CUDA graph capture the step with its padding rows at -1); on a CPU
    one check says whether any row is adapted, so a base-only eager step skips the calls."""
    if slot_ids.dim() != 1:
        raise ValueError(f"slot_ids must be one slot per row, got shape {tuple(slot_ids.shape)}")
    slot_ids = slot_ids.to(torch.int32).contiguous()
    adapted = slot_ids.is_cuda or bool(slot_ids.numel()) and int(slot_ids.max()) >= 0
    return LoRAGrid(slot_ids, None, None, None, adapted)


def group_by_slot(slot_ids: torch.Tensor, num_slots: int, dtype: torch.dtype) -> LoRAGrid:
    """The grid of a step whose rows carry `slot_ids` (`[T]`, -1 = the base model) over a stack of
    `num_slots` (S = 0 when no row has an adapter). One host sync: the rows each slot has."""
    if slot_ids.dim() != 1:
        raise ValueError(f"slot_ids must be one slot per row, got shape {tuple(slot_ids.shape)}")
    counts = torch.bincount(slot_ids.long() + 1, minlength=num_slots + 1).tolist()
    present = [slot for slot in range(num_slots) if counts[slot + 1]]
    device = slot_ids.device
    order = torch.argsort(slot_ids, stable=True)[counts[0]:]  # the adapted rows, by slot
    width = max((counts[slot + 1] for slot in present), default=0)
    # Where each adapted row goes in the grid: its slot's position among the present ones, and its
    # rank within its slot.
    grid_slot = torch.zeros(num_slots, dtype=torch.long)
    grid_slot[present] = torch.arange(len(present))
    starts = torch.zeros(num_slots, dtype=torch.long)
    starts[1:] = torch.tensor(counts[1:num_slots]).cumsum(0)
    sorted_slots = slot_ids.long()[order]
    rank = torch.arange(order.shape[0], device=device) - starts.to(device)[sorted_slots]
    cell = grid_slot.to(device)[sorted_slots] * width + rank
    size = num_slots * slot_ids.shape[0]
    rows = torch.zeros(size, dtype=torch.long, device=device).index_copy_(0, cell, order)
    valid = torch.zeros(size, dtype=dtype, device=device).index_fill_(0, cell, 1.0)
    meta = torch.tensor([len(present), width, *present] + [-1] * (num_slots - len(present)))
    return LoRAGrid(slot_ids.to(torch.int32).contiguous(), rows, valid, meta, bool(present))


def add_lora_(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ids: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    meta: torch.Tensor,
    output_sizes: list[int],
) -> None:
    """Add to `output[T, out]`, in place, on each row with an adapter slot, that slot's LoRA delta of
    `x[T, in]` in torch ops; rows of the base model keep the base output. `slot_ids`, `rows`, `valid` and
    `meta` are the step's `LoRAGrid` (`group_by_slot`); `output_sizes` the linear's sections (`[out]` for an
    unmerged one)."""
    num_slots = int(meta[0])
    if num_slots == 0:
        return
    width, *slots = meta[1:].tolist()
    if rows.shape[0] < num_slots * width or len(slots) != lora_a.shape[0]:
        raise ValueError(f"the grid ({num_slots} slots x {width} rows, over a stack of {len(slots)}) does not "
                         f"match the stack of {lora_a.shape[0]} slots or its {rows.shape[0]} row indices")
    if num_slots < lora_a.shape[0]:
        present = torch.tensor(slots[:num_slots], device=lora_a.device)
        lora_a, lora_b = lora_a.index_select(0, present), lora_b.index_select(0, present)
    rows, valid = rows[:num_slots * width], valid[:num_slots * width].view(num_slots, width, 1)
    segments = x.index_select(0, rows).view(num_slots, width, x.shape[1])
    delta = torch.bmm(torch.bmm(segments, lora_a.transpose(1, 2)), lora_b).mul_(valid)
    output.index_add_(0, rows, delta.view(num_slots * width, output.shape[1]))


def add_lora_slots_(output: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    slot_ids: torch.Tensor, output_sizes: list[int]) -> None:
    """`add_lora_`'s delta from the slots alone (`slots_only`): the Triton kernels on a GPU, the C++ kernel on
    a CPU, and the torch grid for tensors the C++ kernel does not take (a mixed dtype, strided rows)."""
    if output.is_cuda:
        from fastgen.ops.triton_lora import triton_lora_delta  # noqa: PLC0415 - imports triton, only where it runs

        triton_lora_delta(output, x, lora_a, lora_b, slot_ids, output_sizes)
    elif not cpu_lora_delta(output, x, lora_a, lora_b, slot_ids, output_sizes):
        grid = group_by_slot(slot_ids, lora_a.shape[0], lora_a.dtype)
        add_lora_(output, x, lora_a, lora_b, grid.slot_ids, grid.rows, grid.valid, grid.meta, output_sizes)


# Registered like `fastgen::paged_attention` (see there for why `torch.library.Library`): one opaque op a
# compiled layer calls.
_LIBRARY = torch.library.Library("fastgen", "FRAGMENT")
_LIBRARY.define("add_lora_(Tensor(a!) output, Tensor x, Tensor lora_a, Tensor lora_b, Tensor slot_ids, "
                "Tensor rows, Tensor valid, Tensor meta, int[] output_sizes) -> ()")
_LIBRARY.impl("add_lora_", add_lora_, "CompositeExplicitAutograd")
_LIBRARY.define("add_lora_slots_(Tensor(a!) output, Tensor x, Tensor lora_a, Tensor lora_b, Tensor slot_ids, "
                "int[] output_sizes) -> ()")
_LIBRARY.impl("add_lora_slots_", add_lora_slots_, "CompositeExplicitAutograd")


def _fake(*args) -> None:
    return None


torch.library.register_fake("fastgen::add_lora_", _fake, lib=_LIBRARY)
torch.library.register_fake("fastgen::add_lora_slots_", _fake, lib=_LIBRARY)

add_lora_op = torch.ops.fastgen.add_lora_
"""`fastgen::add_lora_`: `add_lora_`'s contract, as one op a compiled layer calls."""
add_lora_slots_op = torch.ops.fastgen.add_lora_slots_
"""`fastgen::add_lora_slots_`: `add_lora_slots_`'s contract, as one op a compiled layer calls."""

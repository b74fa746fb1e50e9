"""LoRA beside the decoder's linears, for every family in one place.

`attach_lora(model, max_loras, max_rank)` wraps each linear inside the decoder layers (the ones
quantization takes, already quantized ones included; not the embedding, the LM head, MoE routers
or stacked experts) in a `LoRALinear`: the base linear as it was, plus buffers
`lora_a[max_loras, R, in]` and `lora_b[max_loras, R, out]` (B transposed, the adapter's scale multiplied
in), where R is `max_rank` times the checkpoint projections merged into the linear (q/k/v: 3, gate/up: 2):
projection j of a merged linear owns ranks j*max_rank..(j+1)*max_rank, whatever the adapter's own rank,
so the CPU kernel's expand reads each projection's block of B alone (`fastgen.ops.lora`). They are
buffers so that a compiled layer takes them as graph inputs: writing an adapter into a slot changes
values, never shapes, and nothing recompiles.

Family code calls its linears with their input alone, so the step's per-token adapter slots
(`AttentionMetadata.lora_slots`) reach them through the model's one `LoRARows`: a forward pre-hook
on the model lays the metadata's slots out for the call, a forward hook lets go after. Where a kernel
computes the delta (Triton on a GPU, C++ on a CPU) the slots are all it reads
(`fastgen.ops.lora.slots_only`, `add_lora_slots_op`): nothing read on the host, so CUDA graphs capture
adapted steps like any other. Elsewhere they are laid out as one grid for the call
(`fastgen.ops.lora.group_by_slot`, `add_lora_op`). Either way one opaque op per linear.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fastgen.models.lora import LoRAAdapter
from fastgen.models.parallel import SINGLE, RowParallelLinear, TensorParallel, finish_row_parallel, read_merged_rows
from fastgen.models.quant import quantizable_linears
from fastgen.ops.lora import (LoRAGrid, add_lora_, add_lora_op, add_lora_slots_, add_lora_slots_op, group_by_slot,
                              lora_kernel_serves, slots_only)


class LoRARows:
    """How the rows of the step the model is running group by adapter slot."""

    def __init__(self, max_loras: int, dtype: torch.dtype, kernel: bool) -> None:
        self.max_loras = max_loras
        self.dtype = dtype
        self.kernel = kernel
        """Whether a kernel that reads the slots alone computes the delta (`fastgen.ops.lora.lora_kernel_serves`)."""
        self.grid: LoRAGrid | None = None
        """The step's adapted rows by slot; None between calls and in steps that carry no slots."""

    def bind(self, slot_ids: torch.Tensor | None) -> None:
        """Lay out the step's per-token slots (None: the step carries none, every row runs the base model)."""
        if slot_ids is None:
            self.grid = None
        elif self.kernel:
            self.grid = slots_only(slot_ids)
        else:
            self.grid = group_by_slot(slot_ids, self.max_loras, self.dtype)


class LoRALinear(nn.Module):
    """A base linear plus the LoRA delta of each row's adapter slot (`fastgen.ops.lora`)."""

    def __init__(self, base: nn.Module, max_loras: int, max_rank: int, rows: LoRARows, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        if hasattr(base, "output_sizes"):
            self.output_sizes = base.output_sizes
        self.sections = list(getattr(base, "output_sizes", (base.out_features,)))
        """The output sections whose adapter pairs each own `max_rank` ranks (one for an unmerged linear)."""
        self.rank = max_rank * len(self.sections)
        self.tp: TensorParallel = getattr(base, "tp", SINGLE)
        split_input = getattr(base, "row_parallel", isinstance(base, RowParallelLinear))
        self.row_parallel = self.tp.size > 1 and bool(split_input)
        """Whether the input is split over the ranks: A is split like the base's weight columns, and the
        delta joins the rank's partial product before the all-reduce."""
        if self.tp.size > 1 and not self.row_parallel and not hasattr(base, "full_sizes"):
            raise NotImplementedError(f"LoRA under tensor parallelism: a {type(base).__name__} is neither a merged "
                                      "column-parallel nor a row-parallel linear, so how its adapter splits is unknown")
        self.full_in_features = self.in_features * self.tp.size if self.row_parallel else self.in_features
        """The checkpoint's input width (what an adapter's A has)."""
        if hasattr(base, "full_sizes"):
            self.full_sizes, self.shard_starts = list(base.full_sizes), list(base.shard_starts)
        self.reduce = self.row_parallel and bool(getattr(base, "reduce", False))
        """Whether this module, not its base, sums the ranks' partial products (and then adds the base's bias,
        which stays the base's parameter: offload streams it with the base's weight)."""
        if self.reduce:
            base.reduce = False
        self.register_buffer("lora_a", torch.zeros(max_loras, self.rank, self.in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.rank, self.out_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.rows = rows

    def extra_repr(self) -> str:
        """Sizes shown by `print(model)`."""
        return f"max_loras={self.lora_a.shape[0]}, rank={self.rank}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base linear's output plus each adapted row's delta."""
        # Contiguous (a no-op for every base linear today), so that the flat view below is the output itself.
        # A row-parallel rank's partial product: its delta from its A columns is its share of the sum.
        out = self.base(x).contiguous()
        grid = self.rows.grid
        # Eager steps whose rows all run the base model skip the call; a compiled layer makes it whatever
        # the mix (a Python bool read while tracing would be a guard, and a recompile when it flips).
        if grid is not None and (torch.compiler.is_compiling() or grid.adapted):
            # Eager steps call the function itself: the dispatcher's round trip into Python costs ~15 us a
            # call, paid by every adapted linear of every layer.
            compiling = torch.compiler.is_compiling()
            out_2d, x_2d = out.view(-1, self.out_features), x.reshape(-1, self.in_features)
            if grid.rows is None:
                add_slots = add_lora_slots_op if compiling else add_lora_slots_
                add_slots(out_2d, x_2d, self.lora_a, self.lora_b, grid.slot_ids, self.sections)
            else:
                add = add_lora_op if compiling else add_lora_
                add(out_2d, x_2d, self.lora_a, self.lora_b, grid.slot_ids, grid.rows, grid.valid, grid.meta,
                    self.sections)
        if self.reduce:
            out = finish_row_parallel(out, self.base.bias, self.tp, True)
        return out

    @torch.no_grad()
    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float) -> None:
        """Put adapter weights `a[r, in]`, `b[out, r]` (the checkpoint's whole linear, `fastgen.models.lora`'s
        layout) into `slot`, B times `scale`; None empties it (all zeros: a row pointing at it gets no
        delta from this linear). r splits evenly over the sections, each at most `max_rank`; under tensor
        parallelism this rank keeps the rows of B, or the columns of A, that its base weight has."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is None:
            return
        rank, sections, per_section = a.shape[0], len(self.sections), self.rank // len(self.sections)
        full_out = sum(getattr(self, "full_sizes", self.sections))
        if (rank % sections or rank // sections > per_section or tuple(a.shape) != (rank, self.full_in_features)
                or tuple(b.shape) != (full_out, rank)):
            raise ValueError(f"LoRA shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a linear of "
                             f"in={self.full_in_features}, out={full_out}, {sections} section(s) of rank "
                             f"<= {per_section}")
        if self.row_parallel:
            a = a[:, self.tp.rank * self.in_features:(self.tp.rank + 1) * self.in_features]
        if hasattr(self, "full_sizes"):
            b = read_merged_rows(b, self.full_sizes, self.shard_starts, self.sections)
        r = rank // sections
        for j in range(sections):
            self.lora_a[slot, j * per_section:j * per_section + r].copy_(a[j * r:(j + 1) * r])
            self.lora_b[slot, j * per_section:j * per_section + r].copy_(b[:, j * r:(j + 1) * r].t().float() * scale)


class LoRALayers:
    """A model's `LoRALinear`s by module name: where an adapter manager writes adapters into slots."""

    def __init__(self, layers: dict[str, LoRALinear], max_loras: int, max_rank: int) -> None:
        self.layers = layers
        """Module name (`model.layers.0.self_attn.qkv_proj`) -> its LoRA linear."""
        self.max_loras = max_loras
        """Device slots: distinct adapters one step may use."""
        self.max_rank = max_rank
        """Largest adapter rank (PEFT's `r`) a slot holds."""

    def check(self, adapter: LoRAAdapter) -> None:
        """ValueError when `adapter` adapts a module that carries no LoRA here or outgrows its stack."""
        for name, module in adapter.modules.items():
            layer = self.layers.get(name)
            if layer is None:
                raise ValueError(f"LoRA adapter {adapter.name!r}: module {name!r} cannot carry LoRA here (adaptable: "
                                 f"the linears inside the decoder layers, not routers, stacked experts, "
                                 f"embeddings or the LM head)")
            if module.rank > layer.rank:
                raise ValueError(f"LoRA adapter {adapter.name!r}: {name} needs rank {module.rank}, over its stack's "
                                 f"{layer.rank} (max_lora_rank {self.max_rank})")

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put `adapter` into device slot `slot` of every LoRA linear (None: empty the slot)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside [0, {self.max_loras})")
        if adapter is not None:
            self.check(adapter)
        for name, layer in self.layers.items():
            module = None if adapter is None else adapter.modules.get(name)
            if module is None:
                layer.set_slot(slot, None, None, 0.0)
            else:
                layer.set_slot(slot, module.a, module.b, adapter.scale)


def _bind_rows(rows: LoRARows):
    def bind(module: nn.Module, args: tuple, kwargs: dict) -> None:
        metadata = args[2] if len(args) > 2 else kwargs["attn_metadata"]
        rows.bind(metadata.lora_slots)

    def release(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        rows.bind(None)

    return bind, release


def attach_lora(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> LoRALayers:
    """Wrap `model`'s adaptable linears in `LoRALinear`s (in place, stacks of `dtype` on `device`, each
    slot empty) and have the model's forward hand them its step's slots; returns them. Call it before
    prepacking or compiling."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras} and {max_rank}")
    rows = LoRARows(max_loras, dtype, lora_kernel_serves(torch.device(device), dtype))
    layers = {}
    for name, linear in quantizable_linears(model, quantized=True).items():
        parent_name, _, child = name.rpartition(".")
        layers[name] = LoRALinear(linear, max_loras, max_rank, rows, dtype, torch.device(device))
        setattr(model.get_submodule(parent_name), child, layers[name])
    bind, release = _bind_rows(rows)
    model.register_forward_pre_hook(bind, with_kwargs=True)
    model.register_forward_hook(release, with_kwargs=True)
    return LoRALayers(layers, max_loras, max_rank)


def lora_stack_bytes(linears: Iterable[tuple[int, int, int]], max_loras: int, max_rank: int,
                     dtype: torch.dtype) -> int:
    """Bytes of the LoRA stacks `attach_lora` allocates for linears of `(out, in, merged projections)`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_slot = sum(max_rank * shards * (out + inp) for out, inp, shards in linears)
    return max_loras * per_slot * itemsize

"""The LoRA delta of a step's rows on the C++ CPU kernel (`lora_delta.cpp`), or nothing where it cannot run."""

from __future__ import annotations

import torch

from fastgen.ops.cpu_kernels.build import active_op
from fastgen.ops.cpu_kernels.decode import KERNEL_DTYPES


def cpu_lora_delta(output: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   slot_ids: torch.Tensor, output_sizes: list[int]) -> bool:
    """Add to `output[T, out]`, in place, each row's adapter delta `lora_b[s]^T (lora_a[s] x[t])` for its slot
    s = `slot_ids[t]` (int32; -1 = none), where `lora_a` is `[slots, R, in]`, `lora_b` `[slots, R, out]`, and
    output section j (`output_sizes`) reads only ranks j*R/n..(j+1)*R/n of B.
    False, with nothing done, where the kernels are off (`FASTGEN_CPU_KERNELS`), could not be built, or do
    not take these tensors (not on the CPU, a dtype other than fp32/bf16/fp16, mixed dtypes)."""
    # Called by every adapted linear of every layer: the cheapest checks first, the op looked up once.
    dtype = output.dtype
    if (output.device.type != "cpu" or dtype not in KERNEL_DTYPES or x.dtype != dtype or lora_a.dtype != dtype
            or lora_b.dtype != dtype or output.stride(1) != 1):
        return False
    op = active_op("lora_delta")
    if op is None:
        return False
    op(output, x if x.stride(1) == 1 else x.contiguous(), lora_a, lora_b, slot_ids, output_sizes)
    return True

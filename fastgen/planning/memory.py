"""What fits where: the policy's memory arithmetic (weights, activations, KV room per device) and the
choice it rests on alone, whether the weights must be quantized to fit at all.

Quantization changes a model's outputs, so the policy never picks it for speed: "none" whenever the
weights in the plan dtype plus the minimum KV cache fit this machine (at some tensor-parallel size),
else the mildest quantization that fits (int8, then int4), with a reason quoting the bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastgen.models.quant import DEFAULT_GROUP_SIZE, INT4_GROUP_SIZES, QUANTIZATIONS
from fastgen.planning.hardware import Hardware
from fastgen.planning.model_facts import ModelFacts
from fastgen.planning.plan import dtype_name, format_bytes

CPU_KV_RAM_FRACTION = 0.2  # RAM is shared with the OS, the page cache and other processes
GPU_MEMORY_FRACTION = 0.9  # of free device memory; the rest absorbs fragmentation
GPU_WORKSPACE_BYTES = 512 << 20  # cuBLAS/Triton workspaces and CUDA-graph pool slack
KV_ROOM = 0.2  # a device must hold the weights plus 20% more for KV cache


def weights_label(dtype: torch.dtype, quantization: str) -> str:
    """How an error or reason names the weights' format: "bfloat16", "int8 (bfloat16 scales)"."""
    return dtype_name(dtype) if quantization == "none" else f"{quantization} ({dtype_name(dtype)} scales)"


def usable_gpu_bytes(hw: Hardware) -> int:
    """The policy's share of the least free GPU."""
    return int(GPU_MEMORY_FRACTION * min(g.free_memory for g in hw.gpus))


def kv_room(hw: Hardware, weights: int, tp: int, reserve: int) -> int:
    """Bytes per device left for the KV cache after `weights` (split over `tp` ranks) and activations."""
    total = hw.ram_available if hw.device_type == "cpu" else usable_gpu_bytes(hw)
    return int(total - weights / tp - reserve)


def gpu_need(weights: int, tp: int, reserve: int) -> float:
    """Bytes per GPU for this rank's weights, 20% more for KV cache, and activations."""
    return weights / tp * (1 + KV_ROOM) + reserve


def check_fits(hw: Hardware, weights: int, label: str, tp: int, reserve: int) -> None:
    """Raise ValueError when the weights at `tp` leave no room for a KV cache."""
    if kv_room(hw, weights, tp, reserve) <= 0:
        where = "RAM" if hw.device_type == "cpu" else "GPU memory"
        raise ValueError(f"model too large: {format_bytes(weights)} of {label} weights at tensor_parallel {tp} "
                         f"leave no {where} for the KV cache")


def activation_reserve(model: ModelFacts, hw: Hardware, dtype: torch.dtype, budget: int, max_seqs: int, tp: int) -> int:
    """Peak activation bytes of one full step per device, with slack for buffer reuse."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_token = 3 * model.hidden_size + (qkv + 3 * model.intermediate_size) // tp
    logits = max_seqs * model.vocab_size * 4 * 2  # fp32 logits plus the sampler's working copy
    workspace = GPU_WORKSPACE_BYTES if hw.device_type == "cuda" else 0
    return 2 * budget * per_token * itemsize + logits + workspace


def divides_heads(model: ModelFacts, tp: int) -> bool:
    """Whether `tp` ranks can split the heads (KV heads split, or copied when fewer than ranks)."""
    kv = model.num_kv_heads
    return model.num_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def tp_candidates(model: ModelFacts, hw: Hardware) -> list[int]:
    """Tensor-parallel sizes the policy may pick: 1 on a CPU; 1 and the powers of two up to the GPU
    count that split the heads on GPUs."""
    if hw.device_type == "cpu":
        return [1]
    return [1] + [1 << i for i in range(1, hw.gpu_count.bit_length()) if divides_heads(model, 1 << i)]


def choose_quantization(model: ModelFacts, hw: Hardware, dtype: torch.dtype, group_size: int, tps: list[int],
                        reserve: Callable[[int], int], block_size: int) -> tuple[str, str]:
    """"none" if the plan-dtype weights and the minimum KV cache fit at one of `tps`; else int8, else
    int4, whichever fits first; ValueError if not even int4 does."""
    cpu = hw.device_type == "cpu"
    sizes = {q: model.weight_bytes(dtype, q, group_size) for q in QUANTIZATIONS}

    def fits(q: str, tp: int) -> bool:
        if cpu:  # the KV cache takes its share of what is left: it must hold one block
            room = kv_room(hw, sizes[q], tp, reserve(tp))
            return room * CPU_KV_RAM_FRACTION >= block_size * model.kv_bytes(dtype, tp)
        return gpu_need(sizes[q], tp, reserve(tp)) <= usable_gpu_bytes(hw)

    where = (f"the {format_bytes(hw.ram_available)} of RAM available" if cpu
             else f"{format_bytes(usable_gpu_bytes(hw))} usable per GPU")
    largest = tps[-1]

    def need(q: str) -> str:
        if cpu:
            return format_bytes(sizes[q] + reserve(1) + block_size * model.kv_bytes(dtype) / CPU_KV_RAM_FRACTION)
        return f"{format_bytes(gpu_need(sizes[q], largest, reserve(largest)))} per GPU at TP={largest}"

    others = f"int8 would take {format_bytes(sizes['int8'])}, int4 {format_bytes(sizes['int4'])}"
    if any(fits("none", tp) for tp in tps):
        return "none", (f"{format_bytes(sizes['none'])} of {dtype_name(dtype)} weights and the minimum KV cache fit "
                        f"{where}; quantization changes outputs, so only on request ({others})")
    for q in ("int8", "int4"):
        fitting = [tp for tp in tps if fits(q, tp)]
        if fitting:
            rest = "" if q == "int8" else f", int8 ones {need('int8')}"
            return q, (f"the only way to fit: {dtype_name(dtype)} weights with room for KV need {need('none')}{rest}, "
                       f"more than {where}; {weights_label(dtype, q)} weights take {format_bytes(sizes[q])} "
                       f"(fit at TP={fitting[0]}; quantization='none' refuses)")
    raise ValueError(f"model too large: {format_bytes(sizes['none'])} of {dtype_name(dtype)} weights with room for KV "
                     f"need {need('none')}, and even int4 weights ({format_bytes(sizes['int4'])}) need {need('int4')}; "
                     f"this machine has {where}")


def choose_group_size(model: ModelFacts, quantization: str, tp: int) -> tuple[int, str]:
    """128 input features per int4 scale/zero when it divides every quantized layer's input width
    (hidden size, this rank's attention and MLP widths), else the largest accepted size that does."""
    if quantization != "int4":
        return DEFAULT_GROUP_SIZE, f"unused: quantization is {quantization} (int4 would group {DEFAULT_GROUP_SIZE})"
    widths = {model.hidden_size, model.num_heads * model.head_dim // tp}
    if not model.num_experts:
        widths.add(model.intermediate_size // tp)
    fitting = [g for g in INT4_GROUP_SIZES if g <= DEFAULT_GROUP_SIZE and all(w % g == 0 for w in widths)]
    if not fitting:
        raise ValueError(f"int4 needs input widths divisible by a group size of {INT4_GROUP_SIZES}; this model's "
                         f"are {sorted(widths)} at tensor_parallel {tp}: use quantization='int8'")
    group = fitting[-1]
    if group == DEFAULT_GROUP_SIZE:
        return group, f"{group} input features per scale and zero (torchao's and GPTQ's usual size)"
    return group, (f"{group}: the largest accepted group size up to {DEFAULT_GROUP_SIZE} that divides the input "
                   f"widths {sorted(widths)}")

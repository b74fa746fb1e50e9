"""Whether to stream decoder layers onto the device (ZeRO-Inference weight offload), from where,
under which weight budget, and what it will cost.

Offload never changes outputs, only speed: every step copies each streamed layer once, so the
policy offloads only when the weights and the minimum KV cache do not fit (after tensor
parallelism and quantization had their turn), or when the user asks. The reason quotes what the
plan expects: bytes moved per step, their time at the source's bandwidth, and the tokens per step
from which a layer's compute takes longer than the next layer's copy (the transfer is then hidden).
The layer arithmetic mirrors `fastgen.executor.offload.plan_residency`, which decides on the
loaded model's exact sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgen.planning.hardware import Hardware
from fastgen.planning.memory import CPU_KV_RAM_FRACTION, KV_ROOM, gpu_need, kv_room, usable_gpu_bytes
from fastgen.planning.model_facts import ModelFacts
from fastgen.planning.plan import format_bytes

PREFETCH_DEPTH = 2  # layer buffers when the budget allows: the one computing and the next on its way
# Pinned host copies of a GPU's streamed layers may take this share of available RAM; beyond it, disk.
HOST_PIN_FRACTION = 0.8
# A PCIe 4.0 NVMe drive's sequential read; reads the page cache already holds run at memory speed.
NVME_READ_GBPS = 3.0
# Pinned host-to-device copies: ~25 GB/s over PCIe 4.0 x16 (A100-class), ~50 over PCIe 5.0 (Hopper).
PCIE_H2D_GBPS = {(8, 0): 25.0, (9, 0): 50.0}
OFFLOAD_MAX_TOKEN_BUDGET = 8192  # how far the policy raises the SplitFuse budget to hide transfers


@dataclass(frozen=True, slots=True)
class OffloadChoice:
    """The offload decision and what it expects."""

    offload: str
    """"none", "cpu" or "disk"."""
    offload_reason: str
    """Why, for the plan's table (empty when the user set it)."""
    weight_memory: int
    """Device bytes for this rank's weights."""
    weight_memory_reason: str
    """What stays resident, what streams, and its expected cost (empty when the user set it)."""
    bytes_per_step: int
    """Bytes one forward pass copies per rank (0: nothing streams)."""
    hide_tokens: int
    """Tokens per step from which compute hides the copies (0: nothing streams)."""
    host_bytes: int
    """Host RAM the "cpu" source holds, all ranks (0 otherwise)."""


def h2d_gbps(hw: Hardware) -> float:
    """Pinned host-to-device copy rate of the slowest GPU (PCIe generation by compute capability)."""
    cc = min(g.compute_capability for g in hw.gpus)
    return max((rate for gen, rate in PCIE_H2D_GBPS.items() if cc >= gen), default=min(PCIE_H2D_GBPS.values()))


def fits_resident(model: ModelFacts, hw: Hardware, weights: int, dtype: torch.dtype, tp: int, reserve: int,
                  block_size: int) -> bool:
    """Whether `weights` (all ranks) and the minimum KV cache fit without offload (quantization's rule)."""
    if hw.device_type == "cpu":
        return kv_room(hw, weights, tp, reserve) * CPU_KV_RAM_FRACTION >= block_size * model.kv_bytes(dtype, tp)
    return gpu_need(weights, tp, reserve) <= usable_gpu_bytes(hw)


def choose_offload(model: ModelFacts, hw: Hardware, dtype: torch.dtype, quantization: str, group_size: int, tp: int,
                   reserve: int, block_size: int, flops: float, copy_gbps: float, user: dict) -> OffloadChoice:
    """The offload mode and weight budget for this rank. `flops` is the device's matmul rate in `dtype`,
    `copy_gbps` the CPU's host-copy rate (the "cpu" source on a CPU device); `user` holds the user's
    `offload` / `weight_memory` if set. ValueError for a budget that cannot work."""
    cpu = hw.device_type == "cpu"
    weights = model.weight_bytes(dtype, quantization, group_size) // tp
    in_layers = model.layer_weight_bytes(dtype, quantization, group_size) // tp
    static, per_layer = weights - in_layers, in_layers / model.num_layers
    fits = fits_resident(model, hw, weights * tp, dtype, tp, reserve, block_size)
    total = hw.ram_available if cpu else usable_gpu_bytes(hw)
    where = f"the {format_bytes(total)} of {'RAM available' if cpu else 'usable GPU memory'}"
    asked = user.get("weight_memory")
    budget = int(asked * weights) if isinstance(asked, float) else asked
    mode = user.get("offload")
    if mode == "none" or (mode is None and (budget is None and fits or budget is not None and budget >= weights)):
        if budget is not None and budget < weights:
            raise ValueError(f"weight_memory {format_bytes(budget)} is less than the {format_bytes(weights)} of "
                             "weights per device, which offload='none' keeps resident: use offload='cpu' or 'disk'")
        why = f"the {format_bytes(weights)} of weights and the minimum KV cache fit {where}"
        kept = "set by the user" if budget is not None else \
            f"offload is none: all {format_bytes(weights)} of weights per device stay resident"
        return OffloadChoice("none", "" if mode else why, budget or weights, kept, 0, 0, 0)
    if budget is None:  # the most that leaves the KV cache its 20% of the weights, as without offload
        budget = min(weights, int((total - reserve) / (1 + KV_ROOM)))
    resident, pool = _residency(static, per_layer, model.num_layers, budget)
    streamed = model.num_layers - resident
    moved = int(streamed * per_layer)
    pin_room = int(HOST_PIN_FRACTION * hw.ram_available)
    if mode is None:
        if cpu:
            mode, why = "disk", "on a CPU the host is the device: streamed layers must come from a file"
        elif moved * tp <= pin_room:
            mode, why = "cpu", (f"the {format_bytes(moved * tp)} streamed fit {HOST_PIN_FRACTION:.0%} of the "
                                f"{format_bytes(hw.ram_available)} of RAM available as pinned host copies")
        else:
            mode, why = "disk", (f"the {format_bytes(moved * tp)} streamed exceed {HOST_PIN_FRACTION:.0%} of the "
                                 f"{format_bytes(hw.ram_available)} of RAM available: read them from a file")
        lead = (f"{format_bytes(weights)} of weights per device and the minimum KV cache do not fit {where}"
                if asked is None else
                f"weight_memory {format_bytes(budget)} is below the {format_bytes(weights)} of weights per device")
        why = f"{lead}; {why}"
    else:
        why = ""
    if cpu:
        rate, source = (copy_gbps, "host memory (the same RAM: saves nothing on a CPU)") if mode == "cpu" \
            else (NVME_READ_GBPS, "disk (NVMe figure; the page cache is faster)")
    else:
        rate = h2d_gbps(hw) if mode == "cpu" else min(NVME_READ_GBPS, h2d_gbps(hw))
        source = "pinned host memory over PCIe" if mode == "cpu" else "disk via pinned staging buffers"
    itemsize_per_param = per_layer / max(1.0, model.layer_params / tp / model.num_layers)
    hide = int(-(-itemsize_per_param * flops // (2 * rate * 1e9))) if streamed else 0
    if streamed:
        wm_why = (f"{resident} of {model.num_layers} layers stay resident with the {format_bytes(static)} outside them "
                  f"and {pool} layer buffer(s); {streamed} stream from {source}: {format_bytes(moved)} per step, "
                  f"~{moved / (rate * 1e9):.2g} s at ~{rate:.3g} GB/s; compute hides the copies from ~{hide} tokens "
                  f"per step ({flops / 1e9:.3g} GFLOP/s)")
    else:
        wm_why = f"every layer fits {format_bytes(budget)}: nothing streams (lower weight_memory to stream)"
    if "weight_memory" in user:
        wm_why = f"set by the user ({wm_why})"
    return OffloadChoice(mode, why, budget, wm_why, moved, hide, moved * tp if mode == "cpu" else 0)


def _residency(static: int, per_layer: float, layers: int, budget: int) -> tuple[int, int]:
    """(resident layers, layer buffers) for equal layers, as the streamer decides; ValueError if nothing fits."""
    if static + layers * per_layer <= budget:
        return layers, 0
    for depth in (PREFETCH_DEPTH, 1):
        for resident in range(layers - 1, -1, -1):
            if static + (resident + min(depth, layers - resident)) * per_layer <= budget:
                return resident, min(depth, layers - resident)
    raise ValueError(f"model too large even with offload: weight_memory {format_bytes(budget)} cannot hold the "
                     f"{format_bytes(static)} that stay resident (embeddings, LM head, norms) plus one streamed "
                     f"decoder layer ({format_bytes(per_layer)})")

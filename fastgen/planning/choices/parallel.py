"""Tensor parallelism and replicas: the smallest TP whose shards fit (or, when offload streams the weights,
every GPU that splits the heads), then as many replicas as keep every GPU busy."""

from __future__ import annotations

from typing import Any, Callable

from fastgen.planning.hardware import Hardware
from fastgen.planning.memory import check_fits, gpu_need, tp_candidates, usable_gpu_bytes
from fastgen.planning.model_facts import ModelFacts
from fastgen.planning.plan import format_bytes

def choose_tensor_parallel_or_stream(model: ModelFacts, hw: Hardware, weights: int, label: str,
                                      reserve: Callable[[int], int], user: dict[str, Any]) -> tuple[int, str]:
    """The smallest TP that fits; when none does and offload may stream, every GPU that splits the heads
    (each rank streams its 1/TP shard)."""
    try:
        return choose_tensor_parallel(model, hw, weights, label, reserve)
    except ValueError:
        if user.get("offload") == "none":
            raise
    tp = tp_candidates(model, hw)[-1]
    if hw.device_type == "cpu":
        return tp, f"one process already spreads each matmul over all {hw.cpu_cores} cores; the weights stream (offload)"
    return tp, (f"{format_bytes(weights)} of {label} weights fit no tensor-parallel size: TP={tp} (the most GPUs that "
                f"split {model.num_heads} heads) and each rank streams its shard (offload)")


def choose_tensor_parallel(model: ModelFacts, hw: Hardware, weights: int, label: str,
                            reserve: Callable[[int], int]) -> tuple[int, str]:
    """1 if the weights (+20% KV room) fit one device, else the smallest power of two that fits."""
    if hw.device_type == "cpu":
        check_fits(hw, weights, label, 1, reserve(1))
        return 1, (f"one process already spreads each matmul over all {hw.cpu_cores} cores; "
                   f"{format_bytes(weights)} of weights fit the {format_bytes(hw.ram_available)} of RAM available")
    usable = usable_gpu_bytes(hw)

    def need(tp: int) -> float:
        return gpu_need(weights, tp, reserve(tp))

    if need(1) <= usable:
        return 1, f"{format_bytes(weights)} of weights (+20% KV room) fit one GPU ({format_bytes(usable)} usable)"
    candidates = tp_candidates(model, hw)[1:]
    for tp in candidates:
        if need(tp) <= usable:
            return tp, (f"{format_bytes(weights)} of weights (+20% KV room) need {format_bytes(need(tp // 2))} "
                        f"per GPU at TP={tp // 2}, more than the {format_bytes(usable)} usable; TP={tp} needs "
                        f"{format_bytes(need(tp))} and divides {model.num_heads} heads / {model.num_kv_heads} KV heads")
    largest = candidates[-1] if candidates else 1
    raise ValueError(
        f"model too large: {format_bytes(weights)} of {label} weights (+20% KV room) need "
        f"{format_bytes(need(largest))} per GPU even at TP={largest}, and each of the {hw.gpu_count} GPU(s) has "
        f"{format_bytes(usable)} usable"
        + ("" if candidates or hw.gpu_count == 1 else f" (no power-of-two TP divides {model.num_heads} heads)"))


def choose_replicas(hw: Hardware, tp: int) -> tuple[int, str]:
    """Every GPU busy: as many replicas of `tp` GPUs as the machine holds (a small model on many GPUs
    scales by replicas, which need no communication, rather than by more ranks)."""
    if hw.device_type == "cpu":
        return 1, f"one replica already uses all {hw.cpu_cores} cores"
    fit = max(1, hw.gpu_count // tp)
    if fit == 1:
        return 1, f"at TP {tp} one replica already takes {tp} of the {hw.gpu_count} GPU(s)"
    return fit, (f"{hw.gpu_count} GPUs / TP {tp} = {fit} replicas behind fastgen.serve's load balancer, "
                 "no communication between them (a pipeline runs one; pass replica_num=1 for MII's default)")

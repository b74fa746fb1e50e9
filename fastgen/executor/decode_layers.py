"""The plan's `decode_layer_kernel`: each decoder layer that has a C++ form (`decode_layer_weights()`) runs a step of
few rows as one call of `fastgen::decode_layer_<isa>`, and every other step through the forward it had (the compiled
dispatch, or its own).

Whether a step qualifies is worked out once, by its first layer, and kept in the step's `step_plans` beside the
attention kernel's plan, which it shares: the op calls that kernel for every row or the step is not taken.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastgen.ops import AttentionMetadata
from fastgen.ops.cpu_kernels import plan_kernel_step
from fastgen.ops.cpu_kernels.decode_layer import DecodeLayerStep, DecodeLayerWeights, plan_decode_layer_step

logger = logging.getLogger("fastgen")

_STEP_KEY = "decode_layer"
"""Where a step's `DecodeLayerStep` (or None) is kept in its `step_plans`."""


def install_decode_layers(layers: nn.ModuleList) -> dict[str, int]:
    """Route the few-row steps of every layer that has a C++ form through the op; returns, per reason a layer
    kept its forward, how many did ("" counts those that took the op). Logged once."""
    counts: dict[str, int] = {}
    for layer in layers:
        weights_of = getattr(layer, "decode_layer_weights", None)
        got = weights_of() if weights_of is not None else f"{type(layer).__name__} has no C++ decode-layer form"
        if isinstance(got, DecodeLayerWeights):
            layer.forward = _DecodeLayerForward(got, layer.forward)
            got = ""
        counts[got] = counts.get(got, 0) + 1
    taken = counts.get("", 0)
    kept = "; ".join(f"{n} keep their forward: {why}" for why, n in counts.items() if why)
    logger.info("fastgen: %d of %d decoder layers run few-row steps as one C++ call%s", taken, len(layers),
                f" ({kept})" if kept else "")
    return counts


def step_of(attn_metadata: AttentionMetadata, hidden: torch.Tensor) -> DecodeLayerStep | None:
    """The step's `DecodeLayerStep`, worked out by its first layer (None: its layers keep their forward)."""
    plans = attn_metadata.step_plans
    if _STEP_KEY not in plans:
        step = None
        if attn_metadata.backend == "cpu" and hidden.device.type == "cpu":
            if "kernel" not in plans:
                plans["kernel"] = plan_kernel_step(attn_metadata.block_tables, attn_metadata.seq_lens,
                                                   attn_metadata.query_start_loc)
            step = plan_decode_layer_step(hidden.shape[0], plans["kernel"])
        plans[_STEP_KEY] = step
    return plans[_STEP_KEY]


class _DecodeLayerForward:
    """A decoder layer's `forward` with the op in front: the op where the step qualifies, else `fallback`."""

    __slots__ = ("weights", "fallback")

    def __init__(self, weights: DecodeLayerWeights, fallback: Callable[..., Any]) -> None:
        self.weights = weights
        self.fallback = fallback

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata,
                 kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        step = None
        if hidden.shape[0] <= self.weights.max_rows and not torch.compiler.is_compiling():
            step = step_of(attn_metadata, hidden)
        if step is None:
            return self.fallback(positions, hidden, attn_metadata, kv_cache)
        return step.run(self.weights, hidden, positions, kv_cache, attn_metadata.slot_mapping)

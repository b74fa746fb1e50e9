"""The Phi-3 family (Phi-3, Phi-3.5-mini, Phi-4-mini: HF `model_type` "phi3").

Numerically Phi-3 is the Llama decoder: RMSNorm, GQA attention without biases, SiLU-gated MLP.
What differs is at the edges, and this file handles only that:

- the checkpoint stores q/k/v fused as `qkv_proj` and gate/up fused as `gate_up_proj`, in the
  same row order as our merged projections, so they load whole under their own names;
- LongRoPE ("su", or "yarn" in early checkpoints, both meaning LongRoPE to HF's Phi-3) takes
  `original_max_position_embeddings` from the top level of the config, not the rope dict, and a
  sequence that outgrows it is recomputed with the long factors, as HF's generate does (the
  engine's `LongRopeSwitch`);
- `sliding_window` (when set) and `partial_rotary_factor` are read by `ModelConfig` as usual.
"""

from __future__ import annotations

import dataclasses

from fastgen.models.config import ModelConfig
from fastgen.models.llama import LlamaForCausalLM

# HF's Phi3Config renames these legacy rope types to LongRoPE before building the rotary table.
_LONGROPE_ALIASES = ("su", "yarn", "longrope")


def phi3_model_config(config: ModelConfig) -> ModelConfig:
    """`config` with its rope settings read the way HF's Phi-3 reads them.

    Phi-3 allows plain or LongRoPE rotary only; any other `rope_type` is refused as HF refuses it.
    """
    scaling = config.rope_scaling
    if scaling is None:
        return config
    rope_type = scaling.get("rope_type")
    if rope_type not in _LONGROPE_ALIASES:
        raise ValueError(f"phi3 supports rope_type 'default' or 'longrope' (alias 'su', 'yarn'), got {rope_type!r}")
    scaling = {**scaling, "rope_type": "longrope"}
    # Phi-3 configs keep the pre-training length at the top level; HF gives it priority over the
    # rope dict's copy.
    original_max = config.raw.get("original_max_position_embeddings")
    if original_max is not None:
        scaling["original_max_position_embeddings"] = original_max
    return dataclasses.replace(config, rope_scaling=scaling)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Causal LM for Phi-3 checkpoints: the Llama decoder loaded from fused q/k/v and gate/up tensors."""

    packed_modules_mapping: dict[str, tuple[str, int]] = {}
    """Empty: the checkpoint's `qkv_proj` and `gate_up_proj` already match our merged modules."""

    long_rope_whole_sequence = True
    """HF's Phi-3 generation recomputes a sequence's cache with the long factors when it outgrows
    `original_max_position_embeddings` (`prepare_inputs_for_generation`); see `LongRopeSwitch`."""

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """The config with Phi-3's rope settings (`phi3_model_config`)."""
        return phi3_model_config(config)

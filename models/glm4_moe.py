"""The GLM-4.5 family (GLM-4.5, GLM-4.5-Air, GLM-4.6: HF `model_type` "glm4_moe").

Llama's pre-norm block with:
- attention: q/k/v biases (`attention_bias`) but none on o_proj, partial rotary (half of each
  head by default), optional per-head q/k RMSNorm (`use_qk_norm`);
- a sparse MoE layer from layer `first_k_dense_replace` on (dense gated MLPs before): a sigmoid
  router whose `e_score_correction_bias` steers the choice, group-limited top-k (`n_group`,
  `topk_group`), renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`) weights, and
  `n_shared_experts` always-on shared experts (one gated MLP of their total width, no gate).

Checkpoints carry multi-token-prediction layers after the last decoder layer
(`model.layers.<num_hidden_layers>.*`); HF ignores them and so do we.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM
from fastgen.models.layers import GATE_UP_PACKING, QKV_PACKING, GatedMLP, RMSNorm
from fastgen.models.llama import LlamaDecoderLayer, llama_attention
from fastgen.models.moe import MoeConfig, SparseMoeBlock


def glm4_moe_config(config: ModelConfig) -> MoeConfig:
    """The MoE settings of a glm4_moe config."""
    raw = config.raw
    return MoeConfig.from_model_config(
        config,
        {"num_experts": ("n_routed_experts", "num_local_experts"), "top_k": ("num_experts_per_tok",),
         "intermediate_size": ("moe_intermediate_size",)},
        renormalize=bool(raw.get("norm_topk_prob", True)), hidden_act=config.hidden_act,
        shared_expert_intermediate_size=raw.get("moe_intermediate_size", 0) * raw.get("n_shared_experts", 1),
        shared_expert_gate=False, scoring="sigmoid", score_correction_bias=True,
        num_groups=raw.get("n_group", 1), topk_groups=raw.get("topk_group", 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    """Pre-norm residual block: attention then the MoE layer (or a dense MLP in the first layers)."""

    def build_attention(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> nn.Module:
        """Biased q/k/v, unbiased o_proj, per-head q/k RMSNorm when `use_qk_norm`."""
        head_norm = functools.partial(RMSNorm, eps=config.rms_norm_eps) if config.raw.get("use_qk_norm") else None
        return llama_attention(config, layer_idx, rotary, qkv_bias=config.attention_bias, o_bias=False,
                               head_norm=head_norm)

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The MoE block from `first_k_dense_replace` on, a dense gated MLP before."""
        if layer_idx >= config.raw.get("first_k_dense_replace", 1):
            return SparseMoeBlock(config.hidden_size, glm4_moe_config(config), config.parallel)
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=config.parallel)


class Glm4MoeForCausalLM(DecoderLM):
    """Causal LM over the GLM-4.5 decoder."""

    layer_cls = Glm4MoeDecoderLayer
    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING, "shared_experts": ("shared_expert", None)}
    stacked_experts_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", None),
    }
    """Per-expert checkpoint module `experts.{i}.<name>` -> (our stacked parameter, shard index)."""

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """Partial rotary 0.5 when the config does not say (HF's default for this family)."""
        raw = config.raw
        if "partial_rotary_factor" not in raw and "partial_rotary_factor" not in (raw.get("rope_parameters") or {}):
            config = dataclasses.replace(config, partial_rotary_factor=0.5)
        return config

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """None for the multi-token-prediction layers past the decoder's last (HF ignores them too)."""
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= self.config.num_layers:
            return None
        return name, tensor

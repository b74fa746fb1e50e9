"""The OLMo 2 and OLMo 3 families (HF `model_type` "olmo2", "olmo3").

A Llama-shaped decoder with norms moved: each layer normalises the attention and MLP outputs
(`post_attention_layernorm`, `post_feedforward_layernorm`) before they join the residual, and
there is no pre-norm; q and k are RMS-normalised over the whole projection (all heads together,
before the split into heads), which under tensor parallelism takes one all-reduce of the squares
(`ShardedRMSNorm`). OLMo's RMSNorm multiplies by its weight in fp32 before casting back.

OLMo 3 adds sliding-window layers (`layer_types`; by default three local then one global) and
each kind its own rotary (`rope_parameters` per layer type in transformers 5).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM
from fastgen.models.layers import (GATE_UP_PACKING, QKV_PACKING, GatedMLP, RMSNorm, layer_type_rope_parameters,
                                   layer_type_rotaries)
from fastgen.ops import AttentionMetadata

_OLMO3_THETA = {"sliding_attention": 10_000.0, "full_attention": 10_000.0}
_OLMO3_LEGACY_KEYS = {"sliding_attention": "rope_theta", "full_attention": "rope_theta"}


class OlmoRMSNorm(RMSNorm):
    """RMSNorm that multiplies by its weight in fp32 and then casts (HF's Olmo2RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of `x`."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * out).to(x.dtype)


def olmo3_model_config(config: ModelConfig) -> ModelConfig:
    """OLMo 3's layer kinds (three sliding then one full when `layer_types` is absent) and windows."""
    raw = config.raw
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(config.num_layers)]
    window = raw.get("sliding_window") or 0
    windows = [window if t == "sliding_attention" else 0 for t in layer_types]
    return dataclasses.replace(config, layer_sliding_windows=windows, raw={**raw, "layer_types": list(layer_types)})


class OlmoDecoderLayer(nn.Module):
    """Attention and MLP, each output normalised before it joins the residual."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__()
        if config.model_type == "olmo3":
            rotary = getattr(rotary, config.raw["layer_types"][layer_idx])
        bias = config.attention_bias
        self.self_attn = Attention(config, layer_idx, rotary, qkv_bias=bias, o_bias=bias,
                                   full_norm_eps=config.rms_norm_eps)
        self.post_attention_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=config.parallel)
        self.post_feedforward_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, attn_metadata, kv_cache))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class OlmoForCausalLM(DecoderLM):
    """Causal LM over the OLMo 2 / OLMo 3 decoder."""

    layer_cls = OlmoDecoderLayer
    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING}

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """OLMo 3's layer kinds resolved (`olmo3_model_config`); OLMo 2 as it is."""
        return olmo3_model_config(config) if config.model_type == "olmo3" else config

    def build_rotary(self, config: ModelConfig) -> nn.Module:
        """OLMo 2: one rotary; OLMo 3: one per layer kind."""
        if config.model_type != "olmo3":
            return super().build_rotary(config)
        return layer_type_rotaries(config, layer_type_rope_parameters(config.raw, _OLMO3_THETA, _OLMO3_LEGACY_KEYS))

    def build_norm(self, config: ModelConfig) -> nn.Module:
        """OLMo's RMSNorm."""
        return OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

"""The Llama family: llama, mistral, qwen2, qwen3, smollm3.

They share one decoder: pre-norm attention + gated MLP, rotary positions, GQA. What differs is
small and read from the config: biases on q/k/v (Qwen2) or everywhere (`attention_bias`),
per-head q/k RMSNorm (Qwen3), sliding windows (Mistral, Qwen2/3 when enabled), explicit head_dim,
layers without rotary (SmolLM3's NoPE layers, `no_rope_layers`).
The embedding, final norm and head are the shell's (`decoder.py`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decode_layer import pre_norm_decode_weights
from fastgen.models.decoder import DecoderLM
from fastgen.models.layers import GATE_UP_PACKING, GatedMLP, QKV_PACKING, RMSNorm
from fastgen.ops import AttentionMetadata
from fastgen.ops.cpu_kernels.decode_layer import DecodeLayerWeights


def rope_layers(config: ModelConfig) -> list[bool]:
    """Per layer, whether it rotates q/k: `no_rope_layers` (1 = rotary, 0 = NoPE, HF's naming), by
    default every `no_rope_layer_interval`-th layer (4) without (SmolLM3, Llama 4)."""
    flags = config.raw.get("no_rope_layers")
    if flags is None:
        interval = config.raw.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(config.num_layers)]
    if len(flags) != config.num_layers:
        raise ValueError(f"{config.model_type} no_rope_layers has {len(flags)} entries for {config.num_layers} layers")
    return [bool(f) for f in flags]


def llama_attention(config: ModelConfig, layer_idx: int, rotary: nn.Module | None, **options) -> Attention:
    """Llama-family attention with the biases and q/k norms the config's family implies; `options`
    override them (the MoE siblings pass their own)."""
    # Qwen2 always has q/k/v biases and no o_proj bias; elsewhere attention_bias covers all four.
    defaults = dict(qkv_bias=config.attention_bias or config.model_type == "qwen2",
                    o_bias=config.attention_bias and config.model_type != "qwen2")
    if config.model_type in ("qwen3", "qwen3_moe"):
        defaults["head_norm"] = functools.partial(RMSNorm, eps=config.rms_norm_eps)
    if config.model_type == "smollm3" and not rope_layers(config)[layer_idx]:
        rotary = None
    return Attention(config, layer_idx, rotary, **{**defaults, **options})


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then gated MLP. Families with this block and another
    attention or MLP (the Qwen MoEs) override `build_attention` / `build_mlp`."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.build_attention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.build_mlp(config, layer_idx)

    def build_attention(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> nn.Module:
        """This layer's attention."""
        return llama_attention(config, layer_idx, rotary)

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """This layer's MLP."""
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias,
                        tp=config.parallel)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_metadata, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def decode_layer_weights(self) -> DecodeLayerWeights | str:
        """This layer's arguments of the C++ decode-layer op, or why it cannot run it (a family that changes
        `forward`, or whose attention or MLP is another shape)."""
        if type(self).forward is not LlamaDecoderLayer.forward:
            return f"{type(self).__name__} has its own forward"
        return pre_norm_decode_weights(self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)


class LlamaForCausalLM(DecoderLM):
    """Causal LM over the Llama decoder; serves llama, mistral, qwen2, qwen3 and smollm3 checkpoints."""

    layer_cls = LlamaDecoderLayer
    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING}

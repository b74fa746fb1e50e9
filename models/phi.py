"""The Phi family (Phi-1, Phi-1.5, Phi-2: HF `model_type` "phi").

One LayerNorm feeds attention and the MLP in parallel, and both outputs join the residual
together. Only the first `partial_rotary_factor` of each head is rotated. Every linear (the LM
head too) has a bias; norms are LayerNorms with bias; the MLP is `fc2(gelu_new(fc1(x)))`.
Phi-2 variants with `qk_layernorm` normalise each query and key head before the rotation.

Checkpoint names are HF's (`self_attn.dense`, `q_layernorm`, `model.final_layernorm`); q/k/v merge
into the shared attention's `qkv_proj` and the rest is renamed through `packed_modules_mapping`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM, ShellNames
from fastgen.models.layers import MLP, QKV_PACKING
from fastgen.ops import AttentionMetadata


def _layer_norm_eps(config: ModelConfig) -> float:
    """Phi configs name the epsilon `layer_norm_eps` (HF's default 1e-5), not `rms_norm_eps`."""
    return float(config.raw.get("layer_norm_eps", 1e-5))


class PhiDecoderLayer(nn.Module):
    """Parallel block: `x + attn(ln(x)) + mlp(ln(x))` with one shared LayerNorm."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__()
        eps = _layer_norm_eps(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        head_norm = functools.partial(nn.LayerNorm, eps=eps) if config.raw.get("qk_layernorm", False) else None
        self.self_attn = Attention(config, layer_idx, rotary, qkv_bias=True, o_bias=True, head_norm=head_norm)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=config.parallel)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        normed = self.input_layernorm(hidden)
        return self.self_attn(positions, normed, attn_metadata, kv_cache) + self.mlp(normed) + hidden


class PhiForCausalLM(DecoderLM):
    """Causal LM over the Phi decoder; its LM head has a bias."""

    names = ShellNames(norm="final_layernorm")
    layer_cls = PhiDecoderLayer
    lm_head_bias = True
    packed_modules_mapping = {
        **QKV_PACKING,
        "dense": ("o_proj", None),
        "q_layernorm": ("q_norm", None),
        "k_layernorm": ("k_norm", None),
    }

    def build_norm(self, config: ModelConfig) -> nn.Module:
        """A LayerNorm with bias."""
        return nn.LayerNorm(config.hidden_size, eps=_layer_norm_eps(config))

"""The Granite family (IBM Granite 3.x dense: HF `model_type` "granite").

The Llama decoder with four scalars from the config: the embedding is multiplied by
`embedding_multiplier`, attention scores are scaled by `attention_multiplier` (not head_dim**-0.5),
each branch output by `residual_multiplier` before it joins the residual, and the logits are divided
by `logits_scaling`. The multipliers are Python floats, as HF applies them.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.attention import KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.llama import LlamaDecoderLayer, LlamaForCausalLM, llama_attention
from fastgen.ops import AttentionMetadata


def _multiplier(config: ModelConfig, key: str, default: float) -> float:
    """A positive number from the config (HF's default when absent)."""
    value = config.raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"granite {key} must be a positive number, got {value!r}")
    return float(value)


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's block with each branch scaled by `residual_multiplier`."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__(config, layer_idx, rotary)
        self.residual_multiplier = _multiplier(config, "residual_multiplier", 1.0)

    def build_attention(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> nn.Module:
        """Llama attention scaled by `attention_multiplier`."""
        return llama_attention(config, layer_idx, rotary, scale=_multiplier(config, "attention_multiplier", 1.0))

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), attn_metadata, kv_cache)
        hidden = hidden + attn * self.residual_multiplier
        return hidden + self.mlp(self.post_attention_layernorm(hidden)) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    """Causal LM over the Granite decoder."""

    layer_cls = GraniteDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embedding_multiplier = _multiplier(self.config, "embedding_multiplier", 1.0)
        self.logits_scaling = _multiplier(self.config, "logits_scaling", 1.0)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The embedding times `embedding_multiplier`."""
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits divided by `logits_scaling`."""
        return logits / self.logits_scaling

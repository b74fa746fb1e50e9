"""The Gemma family: gemma (Gemma 1) and gemma2 (Gemma 2).

Gemma is a Llama-shaped decoder with its own details: embeddings scaled by sqrt(hidden_size)
(the factor rounded to the model dtype, as HF does), RMSNorms that scale by `1 + weight` in fp32,
a GeGLU MLP (tanh-approximated GELU), an explicit head_dim and tied embeddings.

Gemma 2 adds, all read from its config:
- four norms per layer: the attention and MLP outputs are normalised again before they join the
  residual (`post_attention_layernorm`, `post_feedforward_layernorm`);
- attention scores scaled by `query_pre_attn_scalar ** -0.5` and soft-capped with
  `attn_logit_softcapping` (`cap * tanh(score / cap)`); final logits soft-capped likewise;
- sliding-window attention on every other layer (`layer_types`, or even layers in configs written
  by transformers 4.x, which had no `layer_types`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM, softcap_value
from fastgen.models.layers import GATE_UP_PACKING, GatedMLP, QKV_PACKING
from fastgen.ops import AttentionMetadata


def gemma_model_config(config: ModelConfig) -> ModelConfig:
    """`config` with the activation, sliding windows and tying resolved the way HF's Gemma classes do."""
    raw = config.raw
    if config.model_type != "gemma":
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    else:
        # Gemma 1 checkpoints say "gelu" but were trained with the tanh approximation; HF rewrites it.
        act = raw.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if act == "gelu" else act
    windows = config.layer_sliding_windows
    if config.model_type == "gemma2" and not raw.get("layer_types"):
        window = raw.get("sliding_window") or 0
        windows = [window if i % 2 == 0 else 0 for i in range(config.num_layers)]
    # Gemma configs default to tied embeddings and older ones leave the key out.
    tied = raw.get("tie_word_embeddings", True)
    return dataclasses.replace(config, hidden_act=act, layer_sliding_windows=windows, tie_word_embeddings=tied)


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by `1 + weight`, all in fp32 before the cast back (HF's GemmaRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of `x`."""
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


def gemma_attention(config: ModelConfig, layer_idx: int, rotary: nn.Module | None, **options) -> Attention:
    """Gemma attention: scores scaled by `query_pre_attn_scalar ** -0.5` (head_dim when unset) and
    soft-capped by `attn_logit_softcapping` (Gemma 2), biases from `attention_bias`."""
    defaults = dict(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                    scale=float(config.raw.get("query_pre_attn_scalar") or config.head_dim) ** -0.5,
                    softcap=softcap_value(config.raw, "attn_logit_softcapping"))
    return Attention(config, layer_idx, rotary, **{**defaults, **options})


class GemmaDecoderLayer(nn.Module):
    """Pre-norm attention then GeGLU MLP; Gemma 2 and 3 also normalise each branch's output."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = self.build_attention(config, layer_idx, rotary)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act, tp=config.parallel)
        # Gemma 1's post_attention_layernorm is the MLP's pre-norm; Gemma 2 and 3 add a real one.
        self.sandwich_norms = config.model_type != "gemma"
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def build_attention(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> nn.Module:
        """This layer's attention (Gemma 3 adds q/k norms and picks its rotary per layer)."""
        return gemma_attention(config, layer_idx, rotary)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), attn_metadata, kv_cache)
        if not self.sandwich_norms:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaForCausalLM(DecoderLM):
    """Causal LM over the Gemma decoder; serves gemma and gemma2 checkpoints."""

    layer_cls = GemmaDecoderLayer
    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # A buffer, not a Python float: HF multiplies by this factor rounded to the model dtype
        # (sqrt(3072) becomes 55.5 in bf16), and a buffer also stays valid under CUDA-graph capture.
        self.register_buffer("embed_scale", torch.tensor(self.config.hidden_size**0.5), persistent=False)
        self.final_logit_softcap = softcap_value(self.config.raw, "final_logit_softcapping")

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """The activation, windows and tying resolved as HF's Gemma classes do (`gemma_model_config`)."""
        return gemma_model_config(config)

    def build_norm(self, config: ModelConfig) -> nn.Module:
        """Gemma's `1 + weight` RMSNorm."""
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The embedding scaled by sqrt(hidden_size) rounded to the model dtype."""
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale.to(hidden.dtype)

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Soft-capped by `final_logit_softcapping` (Gemma 2), in fp32 (HF caps in the model dtype: the
        cap only squashes, so this is the more exact side)."""
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

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

from fastgen.models.config import ModelConfig
from fastgen.models.layers import GATE_UP_PACKING, GatedMLP, MergedLinear, QKV_PACKING, rotary_embedding
from fastgen.ops import AttentionMetadata, attention

KVCache = tuple[torch.Tensor, torch.Tensor]


def gemma_model_config(config: ModelConfig) -> ModelConfig:
    """`config` with the activation, sliding windows and tying resolved the way HF's Gemma classes do."""
    raw = config.raw
    if config.model_type == "gemma2":
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


def _softcap(raw: dict, key: str) -> float:
    """A soft-capping value from the config, 0.0 when absent or null (no capping)."""
    value = raw.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{key} must be a positive number or null, got {value!r}")
    return float(value)


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


class GemmaAttention(nn.Module):
    """Self-attention with merged q/k/v, rotary positions, optional score soft-capping, paged KV."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = float(config.raw.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        self.softcap = _softcap(config.raw, "attn_logit_softcapping")
        self.sliding_window = config.layer_sliding_windows[layer_idx]
        bias = config.attention_bias
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        # Shared across layers; kept out of the module tree (see LlamaAttention).
        self._rotary = [rotary]

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Attend this step's tokens `hidden` `[T, hidden]` over their sequences' cached K/V."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self._rotary[0](positions, q, k, attn_metadata.long_rope, attn_metadata.step_plans)
        out = attention(q, k, v, kv_cache, attn_metadata, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(out.view(num_tokens, self.q_size))


class GemmaDecoderLayer(nn.Module):
    """Pre-norm attention then GeGLU MLP; Gemma 2 also normalises each branch's output."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        # Gemma 1's post_attention_layernorm is the MLP's pre-norm; Gemma 2 adds a real one.
        self.sandwich_norms = config.model_type == "gemma2"
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

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


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # A buffer, not a Python float: HF multiplies by this factor rounded to the model dtype
        # (sqrt(3072) becomes 55.5 in bf16), and a buffer also stays valid under CUDA-graph capture.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.rotary_emb = rotary_embedding(config)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, self.rotary_emb) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Final hidden states `[T, hidden]` for the flat batch."""
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, attn_metadata, kv_cache)
        return self.norm(hidden)


class GemmaForCausalLM(nn.Module):
    """Causal LM over the Gemma decoder; serves gemma and gemma2 checkpoints."""

    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING}
    """Checkpoint module name -> (our merged module, shard index); the loader uses it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config = gemma_model_config(config)
        self.config = config
        self.final_logit_softcap = _softcap(config.raw, "final_logit_softcapping")
        self.model = GemmaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (all released Gemmas do)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]`; call `compute_logits` on the rows that need logits."""
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[N, vocab]` for the selected hidden rows, soft-capped when the config says so."""
        logits = self.lm_head(hidden).float()
        if self.final_logit_softcap:
            # In fp32 (HF caps in the model dtype): the cap only squashes, so this is the more exact side.
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

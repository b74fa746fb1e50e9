"""The Phi family (Phi-1, Phi-1.5, Phi-2: HF `model_type` "phi").

One LayerNorm feeds attention and the MLP in parallel, and both outputs join the residual
together. Only the first `partial_rotary_factor` of each head is rotated. Every linear (the LM
head too) has a bias; norms are LayerNorms with bias; the MLP is `fc2(gelu_new(fc1(x)))`.
Phi-2 variants with `qk_layernorm` normalise each query and key head before the rotation.

Module names mirror HF's (`self_attn.dense`, `mlp.fc1`, `model.final_layernorm`) so the loader
maps checkpoint names 1:1; q/k/v are merged into one projection through `packed_modules_mapping`.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import MergedLinear, QKV_PACKING, get_activation, rotary_embedding
from fastgen.ops import AttentionMetadata, attention

KVCache = tuple[torch.Tensor, torch.Tensor]


def _layer_norm_eps(config: ModelConfig) -> float:
    """Phi configs name the epsilon `layer_norm_eps` (HF's default 1e-5), not `rms_norm_eps`."""
    return float(config.raw.get("layer_norm_eps", 1e-5))


class PhiAttention(nn.Module):
    """Self-attention with merged biased q/k/v, optional q/k LayerNorm and partial rotary."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = config.layer_sliding_windows[layer_idx]
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=True)
        self.dense = nn.Linear(self.q_size, config.hidden_size, bias=True)
        self.qk_layernorm = bool(config.raw.get("qk_layernorm", False))
        if self.qk_layernorm:
            eps = _layer_norm_eps(config)
            self.q_layernorm = nn.LayerNorm(self.head_dim, eps=eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, eps=eps)
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
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self._rotary[0](positions, q, k, attn_metadata.long_rope, attn_metadata.step_plans)
        out = attention(q, k, v, kv_cache, attn_metadata, self.scale, self.sliding_window)
        return self.dense(out.view(num_tokens, self.q_size))


class PhiMLP(nn.Module):
    """`fc2(act(fc1(x)))`, both with bias (not gated)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` `[T, hidden]`."""
        return self.fc2(self.act(self.fc1(x)))


class PhiDecoderLayer(nn.Module):
    """Parallel block: `x + attn(ln(x)) + mlp(ln(x))` with one shared LayerNorm."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=_layer_norm_eps(config))
        self.self_attn = PhiAttention(config, layer_idx, rotary)
        self.mlp = PhiMLP(config)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        normed = self.input_layernorm(hidden)
        return self.self_attn(positions, normed, attn_metadata, kv_cache) + self.mlp(normed) + hidden


class PhiModel(nn.Module):
    """Embedding, decoder layers, final LayerNorm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = rotary_embedding(config)
        self.layers = nn.ModuleList(PhiDecoderLayer(config, i, self.rotary_emb) for i in range(config.num_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=_layer_norm_eps(config))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Final hidden states `[T, hidden]` for the flat batch."""
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, attn_metadata, kv_cache)
        return self.final_layernorm(hidden)


class PhiForCausalLM(nn.Module):
    """Causal LM over the Phi decoder; its LM head has a bias."""

    packed_modules_mapping = dict(QKV_PACKING)
    """Checkpoint module name -> (our merged module, shard index); the loader uses it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = PhiModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (the bias stays separate)."""
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
        """fp32 logits `[N, vocab]` for the selected hidden rows."""
        return self.lm_head(hidden).float()

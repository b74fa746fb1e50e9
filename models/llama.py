"""The Llama family: llama, mistral, qwen2, qwen3.

They share one decoder: pre-norm attention + gated MLP, rotary positions, GQA. What differs is
small and read from the config: biases on q/k/v (Qwen2) or everywhere (`attention_bias`),
per-head q/k RMSNorm (Qwen3), sliding windows (Mistral, Qwen2/3 when enabled), explicit head_dim.

The forward takes the engine's flat ragged batch: `input_ids[T]`, `positions[T]`, the step's
`AttentionMetadata` and one (k_cache, v_cache) pair per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import GATE_UP_PACKING, GatedMLP, QKV_PACKING, RMSNorm, rotary_embedding
from fastgen.models.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, qkv_linear
from fastgen.ops import AttentionMetadata, attention

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention with merged q/k/v, rotary positions and paged KV."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: nn.Module,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        qk_norm: bool | None = None,
    ) -> None:
        """`qkv_bias`/`o_bias`/`qk_norm` default to what the config's family implies."""
        super().__init__()
        tp = config.parallel
        # Under tensor parallelism this rank holds only its heads; the sizes below are its share.
        self.num_heads = tp.split(config.num_heads, "the attention heads")
        self.num_kv_heads = tp.kv_heads(config.num_kv_heads)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = config.layer_sliding_windows[layer_idx]
        # Qwen2 always has q/k/v biases and no o_proj bias; elsewhere attention_bias covers all four.
        if qkv_bias is None:
            qkv_bias = config.attention_bias or config.model_type == "qwen2"
        if o_bias is None:
            o_bias = config.attention_bias and config.model_type != "qwen2"
        self.qkv_proj = qkv_linear(config.hidden_size, config.num_heads, config.num_kv_heads, self.head_dim,
                                   qkv_bias, tp)
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, o_bias, tp)
        self.qk_norm = config.model_type == "qwen3" if qk_norm is None else qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # Shared across layers; kept out of the module tree so it is neither a parameter
        # nor registered once per layer.
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
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotary[0](positions, q, k, attn_metadata.long_rope, attn_metadata.step_plans)
        out = attention(q, k, v, kv_cache, attn_metadata, self.scale, self.sliding_window)
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then gated MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias,
                            tp=config.parallel)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_metadata, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.parallel)
        self.rotary_emb = rotary_embedding(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Causal LM over the Llama decoder; serves llama, mistral, qwen2 and qwen3 checkpoints."""

    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING}
    """Checkpoint module name -> (our merged module, shard index); the loader uses it."""

    supports_tensor_parallel = True
    """Every layer is built from `parallel.py`'s sharded layers, so `tensor_parallel > 1` works."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, config.parallel)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so."""
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits `[N, vocab]` for the selected hidden rows (None on tensor-parallel ranks > 0)."""
        return self.lm_head.logits(hidden)

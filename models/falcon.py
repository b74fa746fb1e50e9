"""The Falcon family: falcon-7b (multi-query), falcon-40b/180b (`new_decoder_architecture`).

Each layer runs attention and the MLP in parallel on the normed input (one shared LayerNorm, or
`ln_attn`/`ln_mlp` in the new architecture) and adds both to the residual; `parallel_attn=False`
gives the classic sequential block. Positions are rotary. ALiBi checkpoints (`alibi=True`,
falcon-rw) are refused: our paged attention op has no ALiBi bias.

The checkpoint's fused `query_key_value` interleaves q/k/v per KV group, rows laid out
`[num_kv_heads, q_per_kv + 2, head_dim]` (multi-query is one group; plain multi-head is one group
per head). `adapt_checkpoint_tensor` regroups the rows to q | k | v at load time, so the forward
splits one contiguous projection like the Llama family does.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import get_activation, rotary_embedding
from fastgen.ops import AttentionMetadata, attention

KVCache = tuple[torch.Tensor, torch.Tensor]


def _expected_kv_heads(raw: dict, num_heads: int) -> int:
    """How many K/V heads HF's Falcon attention computes for this config."""
    if raw.get("new_decoder_architecture", False):
        return raw.get("num_kv_heads") or num_heads
    return 1 if raw.get("multi_query", True) else num_heads


def check_falcon_config(config: ModelConfig) -> None:
    """Raise ValueError for the Falcon variants fastgen cannot serve exactly."""
    raw = config.raw
    if raw.get("alibi", False):
        raise ValueError(
            "falcon checkpoints with alibi=True (e.g. falcon-rw) are not supported: fastgen's paged "
            "attention op has no ALiBi bias; only rotary Falcon models (falcon-7b/40b/180b) load"
        )
    if raw.get("new_decoder_architecture", False) and not raw.get("parallel_attn", True):
        raise ValueError(
            "falcon config sets new_decoder_architecture with parallel_attn=False: the new decoder is "
            "always parallel and transformers cannot run this combination either"
        )
    expected = _expected_kv_heads(raw, config.num_heads)
    if config.num_kv_heads != expected:
        raise ValueError(
            f"falcon config gives {config.num_kv_heads} K/V heads but its attention layout has {expected} "
            "(check multi_query, new_decoder_architecture and num_kv_heads)"
        )
    if config.num_heads % config.num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({config.num_heads}) is not a multiple of num_kv_heads ({config.num_kv_heads})"
        )


class FalconAttention(nn.Module):
    """Rotary self-attention with one fused q|k|v projection (regrouped at load) and paged KV."""

    def __init__(self, config: ModelConfig, rotary: nn.Module) -> None:
        super().__init__()
        bias = config.raw.get("bias", False)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.query_key_value = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.dense = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        # Shared across layers; kept out of the module tree so it is neither a parameter
        # nor registered once per layer.
        self._rotary = [rotary]

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Attend this step's tokens `hidden` `[T, hidden]` over their sequences' cached K/V."""
        num_tokens = hidden.shape[0]
        q, k, v = self.query_key_value(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self._rotary[0](positions, q, k, attn_metadata.long_rope, attn_metadata.step_plans)
        out = attention(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.dense(out.view(num_tokens, self.q_size))


class FalconMLP(nn.Module):
    """`dense_4h_to_h(act(dense_h_to_4h(x)))`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.raw.get("bias", False)
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.act = get_activation(config.raw.get("activation", "gelu"))
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` `[T, hidden]`."""
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    """Parallel attention + MLP over the normed input (or sequential when `parallel_attn=False`)."""

    def __init__(self, config: ModelConfig, rotary: nn.Module) -> None:
        super().__init__()
        raw = config.raw
        eps = raw.get("layer_norm_epsilon", 1e-5)
        new_arch = raw.get("new_decoder_architecture", False)
        self.parallel = new_arch or raw.get("parallel_attn", True)
        # The new architecture defaults to two norms; num_ln_in_parallel_attn=1 shares one.
        self.two_norms = new_arch and raw.get("num_ln_in_parallel_attn") != 1
        if self.two_norms:
            self.ln_attn = nn.LayerNorm(config.hidden_size, eps=eps)
            self.ln_mlp = nn.LayerNorm(config.hidden_size, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        if not self.parallel:
            self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = FalconAttention(config, rotary)
        self.mlp = FalconMLP(config)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        if self.two_norms:
            attn_in, mlp_in = self.ln_attn(hidden), self.ln_mlp(hidden)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden)
        attn_out = self.self_attention(positions, attn_in, attn_metadata, kv_cache)
        if not self.parallel:
            hidden = hidden + attn_out
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        # HF sums the two branches first, then adds the residual: keep its rounding order.
        return hidden + (self.mlp(mlp_in) + attn_out)


class FalconModel(nn.Module):
    """Embedding, decoder layers, final LayerNorm (HF's `transformer.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = rotary_embedding(config)
        self.h = nn.ModuleList(FalconDecoderLayer(config, self.rotary_emb) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.raw.get("layer_norm_epsilon", 1e-5))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Final hidden states `[T, hidden]` for the flat batch."""
        hidden = self.word_embeddings(input_ids)
        for layer, kv_cache in zip(self.h, kv_caches):
            hidden = layer(positions, hidden, attn_metadata, kv_cache)
        return self.ln_f(hidden)


class FalconForCausalLM(nn.Module):
    """Causal LM over the Falcon decoder (rotary variants only; see `check_falcon_config`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_falcon_config(config)
        self.config = config
        self.transformer = FalconModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (Falcon's default)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.word_embeddings.weight

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Regroup a fused `query_key_value` tensor from Falcon's per-KV-group rows to q | k | v."""
        if not name.endswith(("query_key_value.weight", "query_key_value.bias")):
            return name, tensor
        cfg = self.config
        rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        if tensor.shape[0] != rows:
            return name, tensor  # the loader's shape check reports it
        rest = tensor.shape[1:]
        groups = tensor.reshape(cfg.num_kv_heads, -1, cfg.head_dim, *rest)
        q = groups[:, :-2].reshape(-1, *rest)
        k = groups[:, -2].reshape(-1, *rest)
        v = groups[:, -1].reshape(-1, *rest)
        return name, torch.cat([q, k, v])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]`; call `compute_logits` on the rows that need logits."""
        return self.transformer(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[N, vocab]` for the selected hidden rows."""
        return self.lm_head(hidden).float()

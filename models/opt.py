"""The OPT family (facebook/opt-125m ... 66b).

A classic decoder: learned absolute positions (stored with an offset of 2, a fairseq legacy),
LayerNorm before each block (`do_layer_norm_before=True`, most sizes) or after it (opt-350m), a
ReLU MLP (fc1/fc2), biases everywhere unless `enable_bias=False`, and optional `project_in` /
`project_out` when the embedding width (`word_embed_proj_dim`) differs from the hidden size.
Checkpoint names carry HF's `model.decoder.` prefix (older files: `decoder.`).
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import MergedLinear, QKV_PACKING, get_activation
from fastgen.ops import AttentionMetadata, attention

KVCache = tuple[torch.Tensor, torch.Tensor]

POSITION_OFFSET = 2
"""OPT's learned position table starts at row 2: position p reads row p + 2."""


def _layer_norm(config: ModelConfig, dim: int) -> nn.LayerNorm:
    """OPT's LayerNorm: torch's default eps, affine unless `layer_norm_elementwise_affine=False`."""
    return nn.LayerNorm(dim, elementwise_affine=config.raw.get("layer_norm_elementwise_affine", True))


class OPTAttention(nn.Module):
    """Multi-head self-attention with merged q/k/v and paged KV; no rotary (positions are added)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.raw.get("enable_bias", True)
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size] * 3, bias=bias)
        self.out_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """Attend this step's tokens `hidden` `[T, hidden]` over their sequences' cached K/V."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.q_size, dim=-1)
        # HF scales the projected queries and attends with scale 1: same rounding as theirs.
        q = (q * self.scaling).view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_heads, self.head_dim)
        v = v.view(num_tokens, self.num_heads, self.head_dim)
        out = attention(q, k, v, kv_cache, attn_metadata, 1.0)
        return self.out_proj(out.view(num_tokens, self.q_size))


class OPTDecoderLayer(nn.Module):
    """Attention then MLP, each with a residual; LayerNorm before (pre-LN) or after (post-LN) each."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.raw.get("enable_bias", True)
        self.norm_before = config.raw.get("do_layer_norm_before", True)
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = _layer_norm(config, config.hidden_size)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = get_activation(config.raw.get("activation_function", "relu"))
        self.final_layer_norm = _layer_norm(config, config.hidden_size)

    def forward(self, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """Run one layer over the flat batch."""
        if self.norm_before:
            hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden), attn_metadata, kv_cache)
            return hidden + self.fc2(self.act(self.fc1(self.final_layer_norm(hidden))))
        hidden = self.self_attn_layer_norm(hidden + self.self_attn(hidden, attn_metadata, kv_cache))
        return self.final_layer_norm(hidden + self.fc2(self.act(self.fc1(hidden))))


class OPTDecoder(nn.Module):
    """Token + position embeddings, layers, final norm, with the optional embedding projections."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        raw = config.raw
        embed_dim = raw.get("word_embed_proj_dim") or config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, embed_dim)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        self.project_in = self.project_out = None
        if embed_dim != config.hidden_size:
            self.project_in = nn.Linear(embed_dim, config.hidden_size, bias=False)
            self.project_out = nn.Linear(config.hidden_size, embed_dim, bias=False)
        # Post-LN models have no final norm; `_remove_final_layer_norm` marks pre-4.20 fine-tunes without one.
        self.final_layer_norm = None
        if raw.get("do_layer_norm_before", True) and not raw.get("_remove_final_layer_norm", False):
            self.final_layer_norm = _layer_norm(config, config.hidden_size)
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Hidden states `[T, word_embed_proj_dim]` for the flat batch."""
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, attn_metadata, kv_cache)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    """HF's `model.` level: it only holds the decoder."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    """Causal LM over the OPT decoder; the LM head reads the (projected) embedding width."""

    packed_modules_mapping = dict(QKV_PACKING)
    """Checkpoint module name -> (our merged module, shard index); the loader uses it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.num_kv_heads != config.num_heads:
            raise ValueError(
                f"opt config gives {config.num_kv_heads} key/value heads for {config.num_heads} query heads; "
                "OPT attention has no grouped-query variant (drop num_key_value_heads from config.json)"
            )
        self.config = config
        self.model = OPTModel(config)
        embed_dim = config.raw.get("word_embed_proj_dim") or config.hidden_size
        self.lm_head = nn.Linear(embed_dim, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (OPT's default)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Give old checkpoints' bare `decoder.` names HF's `model.decoder.` prefix."""
        if name.startswith("decoder."):
            name = "model." + name
        return name, tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Hidden states `[T, word_embed_proj_dim]`; call `compute_logits` on the rows that need logits."""
        return self.model.decoder(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[N, vocab]` for the selected hidden rows."""
        return self.lm_head(hidden).float()

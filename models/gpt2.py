"""The GPT-2 family (`GPT2LMHeadModel`: gpt2, distilgpt2, and GPT-2 style fine-tunes).

Pre-LayerNorm blocks, learned absolute positions (`wpe`), a fused q|k|v projection (`c_attn`), a
gelu_new MLP (`c_fc`/`c_proj`) and a tied LM head. Attention is scaled by head_dim**-0.5 unless
`scale_attn_weights=False`, and further by 1/(layer index + 1) when `scale_attn_by_inverse_layer_idx`.

GPT-2's checkpoints store their projections as `Conv1D` weights `[in, out]`: we keep plain
`nn.Linear` modules and transpose those tensors at load time (`adapt_checkpoint_tensor`), which
also accepts old files whose names lack the `transformer.` prefix and skips the causal-mask
buffers (`attn.bias`, `attn.masked_bias`) they saved.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import get_activation
from fastgen.ops import AttentionMetadata, attention

KVCache = tuple[torch.Tensor, torch.Tensor]

_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_MASK_BUFFERS = ("bias", "masked_bias")


def check_gpt2_config(config: ModelConfig) -> None:
    """Raise ValueError for the GPT-2 variants fastgen cannot serve."""
    if config.raw.get("add_cross_attention", False):
        raise ValueError(
            "gpt2 config sets add_cross_attention: cross-attention needs encoder states, which a "
            "decoder-only engine does not have"
        )
    if config.num_kv_heads != config.num_heads:
        raise ValueError(
            f"gpt2 config gives {config.num_kv_heads} key/value heads for {config.num_heads} query heads; "
            "GPT-2 attention has no grouped-query variant (drop num_key_value_heads from config.json)"
        )


class GPT2Attention(nn.Module):
    """Multi-head self-attention over a fused `c_attn` projection, with paged KV."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        raw = config.raw
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5 if raw.get("scale_attn_weights", True) else 1.0
        if raw.get("scale_attn_by_inverse_layer_idx", False):
            self.scale /= float(layer_idx + 1)
        # `reorder_and_upcast_attn` only changes where HF upcasts to fp32; our attention op
        # already computes scores and softmax in fp32, so it needs nothing here.
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """Attend this step's tokens `hidden` `[T, hidden]` over their sequences' cached K/V."""
        num_tokens, width = hidden.shape
        q, k, v = (x.view(num_tokens, self.num_heads, self.head_dim) for x in self.c_attn(hidden).split(width, dim=-1))
        out = attention(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.c_proj(out.view(num_tokens, width))


class GPT2MLP(nn.Module):
    """`c_proj(act(c_fc(x)))`, gelu_new by default."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # HF's rule: n_inner, or 4 x hidden when null (a generic intermediate_size key is ignored).
        inner = config.raw.get("n_inner") or 4 * config.hidden_size
        self.c_fc = nn.Linear(config.hidden_size, inner)
        self.act = get_activation(config.raw.get("activation_function", "gelu_new"))
        self.c_proj = nn.Linear(inner, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` `[T, hidden]`."""
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-LN residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = config.raw.get("layer_norm_epsilon", 1e-5)
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """Run one layer over the flat batch."""
        hidden = hidden + self.attn(self.ln_1(hidden), attn_metadata, kv_cache)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    """Token and position embeddings, blocks, final LayerNorm (HF's `transformer.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.raw.get("layer_norm_epsilon", 1e-5))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Final hidden states `[T, hidden]` for the flat batch."""
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            hidden = block(hidden, attn_metadata, kv_cache)
        return self.ln_f(hidden)


class GPT2LMHeadModel(nn.Module):
    """Causal LM over the GPT-2 decoder (HF's `GPT2LMHeadModel`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_gpt2_config(config)
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (GPT-2's default)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Our name and layout for a checkpoint tensor; None for the saved attention-mask buffers."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "attn" and parts[-1] in _MASK_BUFFERS:
            return None
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name.endswith(_CONV1D_WEIGHTS):
            tensor = tensor.t()
        return name, tensor

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

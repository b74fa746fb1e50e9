"""The Falcon family: falcon-7b (multi-query), falcon-40b/180b (`new_decoder_architecture`).

Each layer runs attention and the MLP in parallel on the normed input (one shared LayerNorm, or
`ln_attn`/`ln_mlp` in the new architecture) and adds both to the residual; `parallel_attn=False`
gives the classic sequential block. Positions are rotary. ALiBi checkpoints (`alibi=True`,
falcon-rw) are refused: our paged attention op has no ALiBi bias.

The checkpoint's fused `query_key_value` interleaves q/k/v per KV group, rows laid out
`[num_kv_heads, q_per_kv + 2, head_dim]` (multi-query is one group; plain multi-head is one group
per head). `adapt_checkpoint_tensor` regroups the rows to q | k | v at load time, so the forward
splits one contiguous projection like the Llama family does (under tensor parallelism each rank
then takes its heads of each).
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM, ShellNames
from fastgen.models.layers import MLP
from fastgen.ops import AttentionMetadata


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


class FalconDecoderLayer(nn.Module):
    """Parallel attention + MLP over the normed input (or sequential when `parallel_attn=False`)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
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
        bias = raw.get("bias", False)
        self.self_attention = Attention(config, layer_idx, rotary, qkv_bias=bias, o_bias=bias, sliding_window=0)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, raw.get("activation", "gelu"), bias=bias,
                       tp=config.parallel)

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


class FalconForCausalLM(DecoderLM):
    """Causal LM over the Falcon decoder (rotary variants only; see `check_falcon_config`)."""

    names = ShellNames(base="transformer", embed="word_embeddings", layers="h", norm="ln_f")
    layer_cls = FalconDecoderLayer
    packed_modules_mapping = {
        "query_key_value": ("qkv_proj", None),
        "dense": ("o_proj", None),
        "dense_h_to_4h": ("fc1", None),
        "dense_4h_to_h": ("fc2", None),
    }

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """`config`, refused unless it is a rotary Falcon (`check_falcon_config`)."""
        check_falcon_config(config)
        return config

    def build_norm(self, config: ModelConfig) -> nn.Module:
        """A LayerNorm with Falcon's `layer_norm_epsilon`."""
        return nn.LayerNorm(config.hidden_size, eps=config.raw.get("layer_norm_epsilon", 1e-5))

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

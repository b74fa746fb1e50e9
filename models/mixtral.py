"""The Mixtral family: Mistral's decoder with every MLP replaced by a sparse MoE layer.

Attention is Llama's (GQA, rotary, a sliding window on every layer when `sliding_window` is set),
so it is reused from `llama.py`; the MoE layer lives in `moe.py`. Mixtral always renormalises its
top-k routing weights.

Checkpoint names: real checkpoints (and transformers 5's default `save_pretrained`) hold
`block_sparse_moe.gate.weight` and per-expert `block_sparse_moe.experts.{i}.w1/w2/w3.weight`;
transformers 5 with `save_original_format=False` writes `mlp.gate.weight` and the stacked
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`. Both load.

The Qwen MoE families reuse `MixtralForCausalLM` with their own layer (`qwen_moe.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.attention import KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM
from fastgen.models.layers import QKV_PACKING, RMSNorm
from fastgen.models.llama import llama_attention
from fastgen.models.moe import MoeConfig, SparseMoeBlock
from fastgen.ops import AttentionMetadata


class MixtralDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then the sparse MoE layer."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__()
        moe = MoeConfig.from_model_config(
            config,
            {"num_experts": ("num_local_experts",), "top_k": ("num_experts_per_tok",)},
            intermediate_size=config.intermediate_size,
            renormalize=True,
            hidden_act=config.hidden_act,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = llama_attention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_sparse_moe = SparseMoeBlock(config.hidden_size, moe, config.parallel)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_metadata, kv_cache)
        return hidden + self.block_sparse_moe(self.post_attention_layernorm(hidden))


class MixtralForCausalLM(DecoderLM):
    """Causal LM over the Mixtral decoder."""

    layer_cls = MixtralDecoderLayer

    packed_modules_mapping = {
        **QKV_PACKING,
        # transformers 5's fused layout calls the MoE layer `mlp`: a plain rename (no shard).
        "mlp": ("block_sparse_moe", None),
    }

    stacked_experts_mapping = {
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", None),
    }
    """Per-expert checkpoint module `experts.{i}.<name>` -> (our stacked parameter, shard index)."""

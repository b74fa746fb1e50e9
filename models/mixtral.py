"""The Mixtral family: Mistral's decoder with every MLP replaced by a sparse MoE layer.

Attention is Llama's (GQA, rotary, a sliding window on every layer when `sliding_window` is set),
so it is reused from `llama.py`; the MoE layer lives in `moe.py`. Mixtral always renormalises its
top-k routing weights.

Checkpoint names: real checkpoints (and transformers 5's default `save_pretrained`) hold
`block_sparse_moe.gate.weight` and per-expert `block_sparse_moe.experts.{i}.w1/w2/w3.weight`;
transformers 5 with `save_original_format=False` writes `mlp.gate.weight` and the stacked
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`. Both load.

`MoeModel` and `MixtralForCausalLM` take their decoder layer class from the causal-LM class, so
the Qwen MoE families reuse them with their own layer (`qwen_moe.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import QKV_PACKING, RMSNorm, rotary_embedding
from fastgen.models.llama import LlamaAttention
from fastgen.models.moe import MoeConfig, SparseMoeBlock
from fastgen.models.parallel import ParallelLMHead, VocabParallelEmbedding
from fastgen.ops import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


class MixtralDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then the sparse MoE layer."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        moe = MoeConfig.from_model_config(
            config,
            {"num_experts": ("num_local_experts",), "top_k": ("num_experts_per_tok",)},
            intermediate_size=config.intermediate_size,
            renormalize=True,
            hidden_act=config.hidden_act,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_sparse_moe = SparseMoeBlock(config.hidden_size, moe, config.parallel)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_metadata, kv_cache)
        return hidden + self.block_sparse_moe(self.post_attention_layernorm(hidden))


class MoeModel(nn.Module):
    """Embedding, decoder layers of class `layer_cls`, final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, layer_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.parallel)
        self.rotary_emb = rotary_embedding(config)
        self.layers = nn.ModuleList(layer_cls(config, i, self.rotary_emb) for i in range(config.num_layers))
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


class MixtralForCausalLM(nn.Module):
    """Causal LM over the Mixtral decoder."""

    decoder_layer_cls: type[nn.Module] = MixtralDecoderLayer
    """The decoder layer the model stacks (subclasses for other MoE families swap it)."""

    packed_modules_mapping = {
        **QKV_PACKING,
        # transformers 5's fused layout calls the MoE layer `mlp`: a plain rename (no shard).
        "mlp": ("block_sparse_moe", None),
    }
    """Checkpoint module name -> (our module, shard index or None for a plain rename)."""

    stacked_experts_mapping = {
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", None),
    }
    """Per-expert checkpoint module `experts.{i}.<name>` -> (our stacked parameter, shard index)."""

    supports_tensor_parallel = True
    """Attention, experts, embedding and LM head are all `parallel.py` layers."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = MoeModel(config, self.decoder_layer_cls)
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

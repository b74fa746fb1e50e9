"""The hybrid Qwen families: qwen3_5_text (Qwen3.5, and the text model of the multimodal `qwen3_5`
checkpoints), qwen3_next (Qwen3-Next) and qwen3_5_moe_text (Qwen3.5's MoE sizes).

Their layers are listed in `layer_types`: "linear_attention" (Gated DeltaNet, `gated_deltanet.py`:
a fixed-size recurrent state per sequence, no K/V) and "full_attention" (three of every four are
linear by default, `full_attention_interval`). Around the token mixer a layer is Qwen3's pre-norm
block with its own details:
- every norm scales by `1 + weight` (zero-centred, Gemma's), the q/k head norms too;
- full attention is gated: `q_proj` yields each head's query and an output gate side by side, and
  the attention output is multiplied by the gate's sigmoid before `o_proj`;
- rotary covers `partial_rotary_factor` of head_dim (0.25 unless the config says otherwise). The
  multimodal rotary's sections (`mrope_section`) all see the same position for text, so text
  tokens rotate as plain rotary does;
- Qwen3-Next and Qwen3.5-MoE replace the MLP with top-k softmax experts plus a sigmoid-gated shared
  expert (Qwen2-MoE's block), on every `decoder_sparse_step`-th layer not in `mlp_only_layers`.

The multimodal `qwen3_5` / `qwen3_5_moe` checkpoints nest the text model under
`model.language_model` beside a vision tower: the text model loads and serves text prompts; the
vision tower's tensors are skipped, so images are not supported (`fastgen` takes text prompts only).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM
from fastgen.models.gated_deltanet import GatedDeltaNet, gated_delta_states, next_projection_rows
from fastgen.models.gemma import GemmaRMSNorm
from fastgen.models.layers import GATE_UP_PACKING, GatedMLP, QKV_PACKING
from fastgen.models.moe import MoeConfig, SparseMoeBlock
from fastgen.models.parallel import MergedLinear
from fastgen.models.qwen_moe import is_sparse_layer
from fastgen.ops import AttentionMetadata, attention

LAYER_TYPES = frozenset({"linear_attention", "full_attention"})
_MOE_TYPES = frozenset({"qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"})
_MULTIMODAL_TYPES = frozenset({"qwen3_5", "qwen3_5_moe"})
logger = logging.getLogger("fastgen")


def layer_types(config: ModelConfig) -> list[str]:
    """Per layer "linear_attention" or "full_attention": `layer_types`, or every
    `full_attention_interval`-th layer (4) full, as HF's config fills it in."""
    types = config.raw.get("layer_types")
    if types is None:
        interval = config.raw.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(config.num_layers)]
    if len(types) != config.num_layers:
        raise ValueError(f"{config.model_type} layer_types has {len(types)} entries for {config.num_layers} layers")
    unknown = sorted(set(types) - LAYER_TYPES)
    if unknown:
        raise ValueError(f"{config.model_type} config.json: layer_types entries {unknown} are not implemented "
                         f"(supported: {sorted(LAYER_TYPES)})")
    return list(types)


class GatedAttention(Attention):
    """Qwen3.5's full attention: per-head q/k norms (`1 + weight`) and an output gate per head that
    `q_proj` computes beside each head's query (`[q_h | gate_h]` rows per head)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        bias = config.attention_bias
        super().__init__(config, layer_idx, rotary, qkv_bias=bias, o_bias=bias,
                         head_norm=functools.partial(GemmaRMSNorm, eps=config.rms_norm_eps))
        tp, head_dim = config.parallel, self.head_dim
        kv_start = self.qkv_proj.shard_starts[1]
        # Twice the query rows: a rank's heads are contiguous [q_h | gate_h] blocks of the checkpoint's q_proj.
        self.qkv_proj = MergedLinear(
            config.hidden_size, [2 * config.num_heads * head_dim, config.num_kv_heads * head_dim,
                                 config.num_kv_heads * head_dim], bias, tp,
            output_sizes=[2 * self.q_size, self.kv_size, self.kv_size],
            shard_starts=[tp.rank * 2 * self.q_size, kv_start, kv_start])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """Attend this step's tokens over their cached K/V, gate each head's output, project."""
        num_tokens = hidden.shape[0]
        q_gate, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self._rotary[0] is not None:
            q, k = self._rotary[0](positions, q, k, attn_metadata.long_rope, attn_metadata.step_plans)
        out = attention(q, k, v, kv_cache, attn_metadata, self.scale, self.sliding_window, self.softcap)
        out = out.reshape(num_tokens, self.q_size) * torch.sigmoid(gate.reshape(num_tokens, self.q_size))
        return self.o_proj(out)


def moe_config(config: ModelConfig) -> MoeConfig:
    """The sparse block of Qwen3-Next / Qwen3.5-MoE: softmax top-k, a gated shared expert."""
    keys = {"num_experts": ("num_experts",), "top_k": ("num_experts_per_tok",),
            "intermediate_size": ("moe_intermediate_size",),
            "shared_expert_intermediate_size": ("shared_expert_intermediate_size",)}
    return MoeConfig.from_model_config(config, keys, renormalize=bool(config.raw.get("norm_topk_prob", True)),
                                       hidden_act=config.hidden_act)


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm block: Gated DeltaNet or gated full attention, then the MLP (or the sparse MoE block)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__()
        self.linear = layer_types(config)[layer_idx] == "linear_attention"
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, fused_projections=config.model_type == "qwen3_next")
        else:
            self.self_attn = GatedAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.model_type in _MOE_TYPES and is_sparse_layer(config, layer_idx):
            self.mlp = SparseMoeBlock(config.hidden_size, moe_config(config), config.parallel)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=config.parallel)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata,
                cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Run one layer over the flat batch; `cache` is its K/V (attention) or its state pools (linear)."""
        normed = self.input_layernorm(hidden)
        if self.linear:
            hidden = hidden + self.linear_attn(normed, attn_metadata, cache)
        else:
            hidden = hidden + self.self_attn(positions, normed, attn_metadata, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3_5ForCausalLM(DecoderLM):
    """Causal LM over the hybrid Qwen decoder; serves qwen3_5_text, qwen3_5 (its text model),
    qwen3_next, qwen3_5_moe_text and qwen3_5_moe (its text model) checkpoints."""

    layer_cls = Qwen3_5DecoderLayer
    supported_layer_types = LAYER_TYPES

    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING, "in_proj_b": ("in_proj_ba", 0),
                              "in_proj_a": ("in_proj_ba", 1)}
    """Checkpoint module name -> (our merged module, shard index): attention, MLPs, Qwen3.5's b/a gates."""

    stacked_experts_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", None),
    }
    """Per-expert checkpoint module `experts.{i}.<name>` -> (our stacked parameter, shard index)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.model_type in _MULTIMODAL_TYPES:
            logger.warning("fastgen: %s is a multimodal checkpoint; its text model is loaded and serves text "
                           "prompts. Image and video input is not supported yet (the vision tower is not loaded)",
                           config.model_type)

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """Each layer's cache (K/V for full attention, the recurrent state for linear attention) and
        Qwen3.5's default partial rotary resolved."""
        types = layer_types(config)
        states = gated_delta_states(config)
        rope = config.raw.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", config.raw.get("partial_rotary_factor", 0.25))
        return dataclasses.replace(
            config, partial_rotary_factor=partial,
            layer_kv_heads=[None if t == "linear_attention" else (config.num_kv_heads, config.head_dim) for t in types],
            layer_states=[states if t == "linear_attention" else () for t in types])

    def build_norm(self, config: ModelConfig) -> nn.Module:
        """The final norm scales by `1 + weight`, as every norm of these families."""
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The text model of a multimodal checkpoint under our names (its vision tower skipped), and
        Qwen3-Next's per-key-head grouped projections reordered into ours."""
        if name.startswith(("model.visual.", "visual.", "mtp.")):
            return None  # the vision tower, and Qwen3-Next's multi-token-prediction head (never used here)
        name = name.replace("model.language_model.", "model.", 1)
        if self.config.model_type == "qwen3_next" and ".linear_attn.in_proj_" in name:
            raw = self.config.raw
            nk, dk = raw["linear_num_key_heads"], raw["linear_key_head_dim"]
            per_head = raw["linear_num_value_heads"] // nk
            if name.endswith("in_proj_qkvz.weight"):
                tensor = next_projection_rows(tensor, nk, [dk, dk, per_head * raw["linear_value_head_dim"],
                                                           per_head * raw["linear_value_head_dim"]])
            elif name.endswith("in_proj_ba.weight"):
                tensor = next_projection_rows(tensor, nk, [per_head, per_head])
        return name, tensor

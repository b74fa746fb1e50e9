"""The Qwen MoE families: qwen2_moe (Qwen1.5-MoE, Qwen2-57B-A14B) and qwen3_moe (Qwen3-30B-A3B, ...).

Both are the Mixtral skeleton (`mixtral.py`) with their own decoder layer:
- attention is the dense sibling's: Qwen2's (q/k/v biases when `qkv_bias`, none on o_proj) or
  Qwen3's (per-head q/k RMSNorm, `attention_bias` on all four projections);
- a layer is sparse unless listed in `mlp_only_layers`, and only every `decoder_sparse_step`-th
  layer is (layer i when (i + 1) % step == 0); the others have a dense gated MLP of
  `intermediate_size`, while experts have `moe_intermediate_size`;
- the top-k routing weights are renormalised only when `norm_topk_prob` says so;
- Qwen2-MoE adds an always-on shared expert scaled by a sigmoid gate.

Checkpoints name the MoE layer `mlp` with per-expert `mlp.experts.{i}.gate_proj/up_proj/down_proj`
(transformers 5 with `save_original_format=False`: the stacked `mlp.experts.gate_up_proj` and
`mlp.experts.down_proj`, which match our parameters name for name).
"""

from __future__ import annotations

from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import GATE_UP_PACKING, GatedMLP, QKV_PACKING
from fastgen.models.llama import LlamaDecoderLayer, llama_attention
from fastgen.models.mixtral import MixtralForCausalLM
from fastgen.models.moe import MoeConfig, SparseMoeBlock


def is_sparse_layer(config: ModelConfig, layer_idx: int) -> bool:
    """Whether layer `layer_idx` holds the MoE layer (else a dense MLP), by transformers' rule."""
    step = config.raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"{config.model_type} decoder_sparse_step must be a positive integer, got {step!r}")
    mlp_only = config.raw.get("mlp_only_layers") or []
    num_experts = config.raw.get("num_experts", config.raw.get("num_local_experts", 0))
    return layer_idx not in mlp_only and bool(num_experts) and (layer_idx + 1) % step == 0


def moe_config(config: ModelConfig) -> MoeConfig:
    """The MoE settings of a qwen2_moe / qwen3_moe config."""
    keys = {
        # transformers 5 saves Qwen3-MoE's expert count as num_local_experts; hub configs say num_experts.
        "num_experts": ("num_experts", "num_local_experts"),
        "top_k": ("num_experts_per_tok",),
        "intermediate_size": ("moe_intermediate_size",),
    }
    if config.model_type == "qwen2_moe":
        keys["shared_expert_intermediate_size"] = ("shared_expert_intermediate_size",)
    return MoeConfig.from_model_config(
        config, keys, renormalize=bool(config.raw.get("norm_topk_prob", False)), hidden_act=config.hidden_act
    )


def attention_options(config: ModelConfig) -> dict[str, bool]:
    """`llama_attention` options: these families attend exactly like their dense siblings
    (Qwen2: q/k/v biases unless `qkv_bias` is false, no o_proj bias; Qwen3: q/k RMSNorm, which
    `llama_attention` adds for qwen3_moe)."""
    if config.model_type == "qwen3_moe":
        return {}
    return {"qkv_bias": bool(config.raw.get("qkv_bias", True)), "o_bias": False}


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    """Pre-norm residual block: attention then the sparse MoE layer or a dense gated MLP."""

    def build_attention(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> nn.Module:
        """The dense sibling's attention (`attention_options`)."""
        return llama_attention(config, layer_idx, rotary, **attention_options(config))

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The MoE block on sparse layers (`is_sparse_layer`), else a dense gated MLP."""
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(config.hidden_size, moe_config(config), config.parallel)
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=config.parallel)


class QwenMoeForCausalLM(MixtralForCausalLM):
    """Causal LM over the Qwen MoE decoder; serves qwen2_moe and qwen3_moe checkpoints."""

    layer_cls = QwenMoeDecoderLayer

    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING}
    """Checkpoint module name -> (our merged module, shard index): attention, dense MLPs, shared expert."""

    stacked_experts_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", None),
    }
    """Per-expert checkpoint module `experts.{i}.<name>` -> (our stacked parameter, shard index)."""

"""DeepSeek-V3 (and checkpoints of its shape: Kimi-K2): multi-head latent attention over a latent KV
cache, and a MoE of routed experts picked group by group plus shared experts.

Attention (MLA), as HF's `modeling_deepseek_v3.py` defines it: the query comes from `q_proj`, or
through a low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (`q_lora_rank`); each head's query is
`qk_nope_head_dim` plain + `qk_rope_head_dim` rotated columns. K and V come from one compressed
latent: `kv_a_proj_with_mqa` gives `c` (`kv_lora_rank`, normed by `kv_a_layernorm`) and one rotated
key part shared by all heads, `k_rope`; `kv_b_proj` up-projects `c` into each head's `k_nope` and
value. fastgen caches only `[c, k_rope]` per token and layer (`ModelConfig.kv_latent_dim`) and
absorbs the up-projections: the query's plain part goes through `W_UK` into the latent space, the
heads attend over the cached vectors (`fastgen.ops.latent_attention`), and `W_UV` maps each head's
latent output to its value space, for prompt chunks and decodes alike. The scale is
`qk_head_dim ** -0.5`, times YaRN's `mscale_all_dim` factor squared when the rope is scaled.
`rope_interleave` rotates interleaved pairs: their columns are gathered (evens, then odds) before the
usual half rotation, which gives the same scores.

MoE (`first_k_dense_replace` layers first stay dense): sigmoid router scores; for the choice only,
`e_score_correction_bias` is added, experts fall into `n_group` groups scored by their top two, the
best `topk_group` groups stay eligible, and the top `num_experts_per_tok` experts among them are
picked; their (uncorrected) scores are renormalised (`norm_topk_prob`) and multiplied by
`routed_scaling_factor`. `n_shared_experts` always-on experts form one MLP beside them. That is
GLM-4.5's MoE too: both are `SparseMoeBlock` with a sigmoid router (`moe.route_grouped`).

Checkpoint names are HF's: per-expert `mlp.experts.{i}.{gate,up,down}_proj.weight` stack into
`StackedExperts`; the multi-token-prediction layers past `num_hidden_layers` (DeepSeek-V3's layer
61) are skipped, as HF skips them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM
from fastgen.models.glm4_moe import Glm4MoeForCausalLM
from fastgen.models.layers import GATE_UP_PACKING, GatedMLP, RMSNorm
from fastgen.models.llama import LlamaDecoderLayer
from fastgen.models.moe import MoeConfig, SparseMoeBlock
from fastgen.models.parallel import MergedLinear, RowParallelLinear
from fastgen.models.rope import build_rotary_embedding
from fastgen.ops import AttentionMetadata, latent_attention

KVCache = tuple[torch.Tensor, ...]


def check_config(config: ModelConfig) -> None:
    """ValueError naming what a deepseek_v3 config asks for that this file does not implement."""
    raw = config.raw
    for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(key) not in (None, supported):
            raise ValueError(f"deepseek_v3 {key} {raw[key]!r} is not implemented (supported: {supported!r})")
    quant = raw.get("quantization_config") or {}
    if quant:
        raise ValueError(f"deepseek_v3 quantization_config quant_method {quant.get('quant_method')!r} is not "
                         "implemented: give a checkpoint in float16/bfloat16/float32")
    if not raw.get("kv_lora_rank"):
        raise ValueError("deepseek_v3 config.json lacks kv_lora_rank (the latent KV width)")
    experts, groups = raw.get("n_routed_experts"), raw.get("n_group") or 1
    if experts and experts % groups:
        raise ValueError(f"deepseek_v3 n_routed_experts ({experts}) must divide into n_group ({groups}) groups")


def softmax_scale(config: ModelConfig) -> float:
    """`qk_head_dim ** -0.5`, with YaRN's `mscale_all_dim` factor squared (HF's `yarn_apply_mscale`)."""
    raw = config.raw
    scale = (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]) ** -0.5
    scaling = config.rope_scaling or {}
    mscale_all_dim = scaling.get("mscale_all_dim") or 0
    factor = scaling.get("factor", 1.0)
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    """MLA over the latent cache, up-projections absorbed (this rank's heads under TP; the latent whole)."""

    unquantized_children = ("kv_b_proj",)
    """Read as per-head weight matrices (absorbed into the query and output), never run as a linear."""

    def __init__(self, config: ModelConfig, rotary: nn.Module | None) -> None:
        super().__init__()
        raw, tp = config.raw, config.parallel
        self.num_heads = tp.split(config.num_heads, "the attention heads")
        self.nope_dim, self.rope_dim = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
        self.v_dim, self.rank = raw["v_head_dim"], raw["kv_lora_rank"]
        qk_dim = self.nope_dim + self.rope_dim
        bias = config.attention_bias
        self.q_lora_rank = raw.get("q_lora_rank")
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(config.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = MergedLinear(self.q_lora_rank, [config.num_heads * qk_dim], False, tp)
        else:
            self.q_proj = MergedLinear(config.hidden_size, [config.num_heads * qk_dim], False, tp)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = MergedLinear(self.rank, [config.num_heads * (self.nope_dim + self.v_dim)], False, tp)
        self.o_proj = RowParallelLinear(config.num_heads * self.v_dim, config.hidden_size, bias, tp)
        self.scale = softmax_scale(config)
        self.interleaved = raw.get("rope_interleave", True)
        self._rotary = [rotary]

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        """Interleaved rotary pairs (x0, x1), (x2, x3)... as halves (x0, x2, ..., x1, x3, ...), HF's layout."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleaved else x

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Attend this step's tokens `hidden` `[T, hidden]` over their sequences' cached latents."""
        num_tokens = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_rope = q.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        q_rope, k_rope = self._rotary[0](positions, self._deinterleave(q_rope),
                                         self._deinterleave(k_rope).unsqueeze(1), attn_metadata.long_rope,
                                         attn_metadata.step_plans)
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim:]
        # [H, T, nope] @ [H, nope, rank]: each head's plain query part in the latent space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_rope), dim=-1)
        latent = torch.cat((c.unsqueeze(1), k_rope), dim=-1)
        out = latent_attention(query, latent, kv_cache, attn_metadata, self.scale)[..., : self.rank]
        # [H, T, rank] @ [H, rank, v]: each head's latent output through its value projection.
        values = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(values.reshape(num_tokens, self.num_heads * self.v_dim))


def deepseek_moe_config(config: ModelConfig) -> MoeConfig:
    """The MoE settings of a deepseek_v3 config (the routing GLM-4.5 shares: `SparseMoeBlock`'s sigmoid path)."""
    raw = config.raw
    return MoeConfig.from_model_config(
        config,
        {"num_experts": ("n_routed_experts",), "top_k": ("num_experts_per_tok",),
         "intermediate_size": ("moe_intermediate_size",)},
        renormalize=bool(raw.get("norm_topk_prob", True)), hidden_act=config.hidden_act,
        shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("n_shared_experts", 1) or 0),
        shared_expert_gate=False, scoring="sigmoid", score_correction_bias=True,
        num_groups=raw.get("n_group") or 1, topk_groups=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Pre-norm residual block: MLA, then a dense MLP (the first `first_k_dense_replace`) or the MoE."""

    def build_attention(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> nn.Module:
        """Multi-head latent attention."""
        return DeepseekV3Attention(config, rotary)

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The MoE from `first_k_dense_replace` on (when the config has routed experts), a dense gated MLP before."""
        if layer_idx >= (config.raw.get("first_k_dense_replace") or 0) and config.raw.get("n_routed_experts"):
            return SparseMoeBlock(config.hidden_size, deepseek_moe_config(config), config.parallel)
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=config.parallel)


class DeepseekV3ForCausalLM(DecoderLM):
    """Causal LM over the DeepSeek-V3 decoder; serves deepseek_v3 and kimi_k2 checkpoints."""

    layer_cls = DeepseekV3DecoderLayer
    packed_modules_mapping = {**GATE_UP_PACKING, "shared_experts": ("shared_expert", None)}
    stacked_experts_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                               "down_proj": ("down_proj", None)}
    """Per-expert checkpoint module `experts.{i}.<name>` -> (our stacked parameter, shard index)."""

    # The multi-token-prediction layers past the decoder's (DeepSeek-V3's layer 61) are skipped, as GLM-4.5's.
    adapt_checkpoint_tensor = Glm4MoeForCausalLM.adapt_checkpoint_tensor

    def adapt_lora_pair(self, hf_module: str, a: torch.Tensor, b: torch.Tensor
                        ) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """`DecoderLM.adapt_lora_pair`; ValueError for `kv_b_proj`, whose weight the attention reads per head."""
        adapted = super().adapt_lora_pair(hf_module, a, b)
        if adapted is not None and adapted[0].endswith(".kv_b_proj"):
            raise ValueError(f"{hf_module} cannot carry LoRA: fastgen absorbs its weight into each head's query "
                             "and output (attention over the latent cache), so it never runs as a linear whose "
                             "output an adapter's delta could join")
        return adapted

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """`config` as is, once what it asks for that this file does not implement is refused."""
        check_config(config)
        return config

    def build_rotary(self, config: ModelConfig) -> nn.Module | None:
        """The rotary of the shared key part: `qk_rope_head_dim` wide, YaRN and all."""
        rope_dim = config.raw["qk_rope_head_dim"]
        return build_rotary_embedding(rope_dim, rope_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)

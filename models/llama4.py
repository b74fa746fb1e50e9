"""Llama 4's text decoder (`llama4_text`, HF's `Llama4ForCausalLM`).

The Llama block (pre-norm attention, then a feed-forward), with what Llama 4 changes, each as HF's
`modeling_llama4.py` does it:
- NoPE layers (`no_rope_layers`: 1 = rotary, 0 = none; by default every 4th layer has none);
- chunked local attention on the rotary layers (`layer_types` "chunked_attention", by default every
  rotary layer when `attention_chunk_size` is set): positions are cut into chunks of
  `attention_chunk_size` from position 0 and a token attends only to the earlier tokens of its own
  chunk (`fastgen.ops.attention(..., attention_chunk=)`); NoPE layers attend to everything;
- on rotary layers with `use_qk_norm`, a weightless RMS norm of each q and k head after the rotary;
- on NoPE layers with `attn_temperature_tuning`, q scaled by `1 + attn_scale * log1p(floor((pos + 1) /
  floor_scale))` of its absolute position;
- the rotary rotates interleaved pairs (dims 2i, 2i + 1, a complex product in fp32): the checkpoint's
  q/k rows are permuted per head at load so the shared NeoX-layout rotary does the same rotation (the
  permutation is the same for q and k, so q.k, the weightless norm and the output are unchanged);
- MoE layers (`moe_layers`, by default every `interleave_moe_layer_step`-th): a sigmoid router over the
  top-k logits whose score scales the routed expert's INPUT (not its output), plus an always-on shared
  expert; the other layers have a dense gated MLP of `intermediate_size_mlp`.

Checkpoint layout: `feed_forward.experts.gate_up_proj` `[E, H, 2I]` (gate columns, then up) and
`down_proj` `[E, I, H]`, transposed at load into `StackedExperts`' `[E, 2I, H]` and `[E, H, I]`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM
from fastgen.models.layers import GATE_UP_PACKING, GatedMLP, QKV_PACKING, RMSNorm, get_activation
from fastgen.models.llama import rope_layers
from fastgen.models.moe import StackedExperts
from fastgen.models.parallel import all_reduce
from fastgen.ops import AttentionMetadata, attention

LAYER_TYPES = ("full_attention", "chunked_attention")
"""The `layer_types` entries Llama 4 defines; any other is refused at load."""

_DEFAULTS = dict(use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                 interleave_moe_layer_step=1)
"""HF `Llama4TextConfig`'s defaults of the switches this file reads, for configs that omit them."""


def _positive_int(raw: dict, key: str) -> int:
    """`raw[key]` checked to be a positive integer (ValueError naming the key otherwise)."""
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"llama4_text {key} must be a positive integer, got {value!r}")
    return value


def resolve_config(config: ModelConfig) -> ModelConfig:
    """`config` with Llama 4's defaults resolved into `raw` as HF's config class resolves them
    (`no_rope_layers`, `moe_layers`, `layer_types`, the q/k norm and temperature settings); ValueError
    naming any field whose value this file does not implement."""
    raw = {**_DEFAULTS, **config.raw}
    num_layers = config.num_layers
    if config.partial_rotary_factor != 1.0:
        raise ValueError(f"llama4_text partial_rotary_factor {config.partial_rotary_factor!r} is not implemented "
                         "(Llama 4 rotates whole heads)")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method")
        raise ValueError(f"llama4_text quantization_config quant_method {method!r} is not implemented "
                         "(load an unquantized checkpoint; fastgen quantizes through its `quantization` plan field)")
    get_activation(config.hidden_act)
    rotary = rope_layers(config)
    raw["no_rope_layers"] = [int(r) for r in rotary]

    moe_layers = raw.get("moe_layers")
    if moe_layers is None:
        step = _positive_int(raw, "interleave_moe_layer_step")
        moe_layers = list(range(step - 1, num_layers, step))
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in moe_layers):
        raise ValueError(f"llama4_text moe_layers {moe_layers!r} must be layer indices in [0, {num_layers})")
    raw["moe_layers"] = sorted(set(moe_layers))
    if raw["moe_layers"]:
        experts, top_k = _positive_int(raw, "num_local_experts"), _positive_int(raw, "num_experts_per_tok")
        if top_k > experts:
            raise ValueError(f"llama4_text num_experts_per_tok ({top_k}) exceeds num_local_experts ({experts})")
    if len(raw["moe_layers"]) < num_layers:
        _positive_int(raw, "intermediate_size_mlp")

    chunk = raw.get("attention_chunk_size")
    types = raw.get("layer_types")
    if types is None:
        types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rotary]
    if len(types) != num_layers:
        raise ValueError(f"llama4_text layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"llama4_text layer_types entries {unknown} are not implemented "
                         f"(supported: {list(LAYER_TYPES)})")
    if "chunked_attention" in types:
        _positive_int(raw, "attention_chunk_size")
    raw["layer_types"] = list(types)
    if raw["attn_temperature_tuning"] and not all(rotary):
        _positive_int(raw, "floor_scale")
        if isinstance(raw["attn_scale"], bool) or not isinstance(raw["attn_scale"], (int, float)):
            raise ValueError(f"llama4_text attn_scale must be a number, got {raw['attn_scale']!r}")
    # Llama 4 has no sliding windows: a stray `sliding_window` key must not give its layers one.
    return dataclasses.replace(config, raw=raw, layer_sliding_windows=[0] * num_layers)


def _weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of each head `[T, heads, D]` with no weight, in fp32 and cast back (HF's `L2Norm`)."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(Attention):
    """The shared attention with Llama 4's per-layer switches: rotary or NoPE, the q/k norm after the
    rotary, the temperature of NoPE layers, and chunked local attention."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        raw = config.raw
        use_rope = bool(raw["no_rope_layers"][layer_idx])
        bias = config.attention_bias
        super().__init__(config, layer_idx, rotary if use_rope else None, qkv_bias=bias, o_bias=bias)
        self.qk_norm_eps = config.rms_norm_eps if use_rope and raw["use_qk_norm"] else None
        self.temperature_tuning = not use_rope and bool(raw["attn_temperature_tuning"])
        self.floor_scale = float(raw["floor_scale"])
        self.attn_scale = float(raw["attn_scale"])
        chunked = raw["layer_types"][layer_idx] == "chunked_attention"
        self.attention_chunk = int(raw["attention_chunk_size"]) if chunked else 0

    def project(self, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k and v `[T, Hkv, D]`: rotated, then normed (rotary layers), or q scaled by its
        position's temperature (NoPE layers)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        rotary = self._rotary[0]
        if rotary is not None:
            # HF rotates in fp32 (a complex product) and casts back.
            dtype = q.dtype
            q, k = rotary(positions, q.float(), k.float(), attn_metadata.long_rope, attn_metadata.step_plans)
            q, k = q.to(dtype), k.to(dtype)
        if self.qk_norm_eps is not None:
            q, k = _weightless_rms_norm(q, self.qk_norm_eps), _weightless_rms_norm(k, self.qk_norm_eps)
        if self.temperature_tuning:
            # Absolute positions, as HF counts them (cached tokens + this one).
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return q, k, v

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Attend this step's tokens `hidden` `[T, hidden]` over their sequences' cached K/V (their chunk's only,
        on chunked layers)."""
        q, k, v = self.project(positions, hidden, attn_metadata)
        out = attention(q, k, v, kv_cache, attn_metadata, self.scale, attention_chunk=self.attention_chunk)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))


class Llama4Moe(nn.Module):
    """Sigmoid top-k router scaling each routed expert's input, stacked experts, and a shared expert.

    Parameter names follow transformers: `router.weight`, `experts.gate_up_proj`, `experts.down_proj`,
    `shared_expert.*`.
    """

    unquantized_children = ("router",)
    """Kept in the plan dtype under `quantization`: the router picks which experts a token meets."""

    has_shared_expert = True
    """An always-on expert beside the routed ones (the planner asks)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        raw = config.raw
        self.tp = config.parallel
        self.top_k = raw["num_experts_per_tok"]
        self.router = nn.Linear(config.hidden_size, raw["num_local_experts"], bias=False)
        self.experts = StackedExperts(raw["num_local_experts"], config.hidden_size, config.intermediate_size,
                                      config.hidden_act, config.parallel)
        self.shared_expert = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                      tp=config.parallel, reduce=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the layer to `hidden` `[T, H]`."""
        top_logits, ids = torch.topk(self.router(hidden), self.top_k, dim=-1)
        scores = torch.sigmoid(top_logits.float()).to(hidden.dtype)
        out = self.shared_expert(hidden)
        # The score scales the expert's input, and experts are not linear: each of a token's k experts
        # gets its own scaled input, so one experts call per pick (k is 1 in every released Llama 4).
        unit = torch.ones_like(scores[:, :1])
        for pick in range(self.top_k):
            out = out + self.experts(hidden * scores[:, pick:pick + 1], unit, ids[:, pick:pick + 1])
        # One all-reduce sums the ranks' partial routed and shared outputs together.
        return all_reduce(out, self.tp)


class Llama4DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MoE or the dense gated MLP (`feed_forward`)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Llama4Attention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_idx in config.raw["moe_layers"]:
            self.feed_forward = Llama4Moe(config)
        else:
            self.feed_forward = GatedMLP(config.hidden_size, config.raw["intermediate_size_mlp"], config.hidden_act,
                                         tp=config.parallel)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_metadata, kv_cache)
        return hidden + self.feed_forward(self.post_attention_layernorm(hidden))


def _deinterleave_heads(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q or k projection rows (weight `[heads * D, H]` or bias) with each head's dims reordered from
    interleaved pairs (0, 1), (2, 3), ... to halves (0, 2, ..., 1, 3, ...): NeoX's rotary on the result
    rotates as the interleaved rotary does on the original."""
    heads = tensor.shape[0] // head_dim
    order = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    return tensor.reshape(heads, head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)


class Llama4ForCausalLM(DecoderLM):
    """Causal LM over the Llama 4 text decoder."""

    layer_cls = Llama4DecoderLayer
    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING}
    supported_layer_types = frozenset(LAYER_TYPES)

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """Llama 4's defaults resolved; what it cannot run refused (`resolve_config`)."""
        return resolve_config(config)

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """q/k rows into the NeoX rotary's layout; expert stacks into `StackedExperts`' layout."""
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                          "self_attn.k_proj.bias")):
            return name, _deinterleave_heads(tensor, self.config.head_dim)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> [E, out, in]
            return name, tensor.transpose(1, 2)
        return name, tensor

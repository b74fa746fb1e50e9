"""Gemma 4's text decoder (HF `model_type` "gemma4_text", `Gemma4ForCausalLM`).

Gemma 3's layer (`gemma3.py`: four norms per layer, GeGLU, scaled embedding, local and global layers
with their own rotary, per-head q/k norms) with, as HF's `modeling_gemma4.py` does it:
- RMSNorms that scale by `weight` (not `1 + weight`), in fp32; a weightless norm on v too;
- attention scores scaled by 1 (the q/k norms set the scale); no score soft-capping;
- global (`full_attention`) layers with their own head width and KV heads (`global_head_dim`,
  `num_global_key_value_heads`, or the config's `per_layer_config` overrides) and HF's
  "proportional" rotary: of the `head_dim / 2` rotate-half frequency pairs the first
  `partial_rotary_factor` share turn at `base ** (-2i / head_dim)`, the others stand still;
- `attention_k_eq_v`: global layers have no v_proj, their V is K's projection (v-normed, not rotated);
- KV sharing (`num_kv_shared_layers`): the last layers compute no K/V; each attends the cache of the
  last earlier layer of its kind, which is therefore the only cache they use (`layer_kv_heads` None:
  the runner allocates none and the planner counts none for them);
- `use_double_wide_mlp`: the KV-sharing layers' MLP is twice as wide;
- per-layer input embeddings (PLE, `hidden_size_per_layer_input`): one packed table
  `[vocab_size_per_layer_input, layers * P]` looked up per token plus a projection of the embedding,
  normed and mixed; each layer gates its `[T, P]` slice into a residual branch of its own;
- the optional MoE block (`enable_moe_block`): beside the dense MLP (same input, its own norms), a
  router (weightless norm, learned scale, softmax top-k renormalised, a learned scale per expert)
  over stacked GeGLU experts; the two outputs are summed before the feed-forward post-norm;
- a learned `layer_scalar` multiplying each layer's output, and final-logit soft-capping.

Gemma 4 has no AltUp or Laurel (those are Gemma 3n's). Refused at load, naming the key:
`use_bidirectional_attention="all"` (an encoder), rope types other than default and proportional,
`per_layer_config` overrides other than `head_dim` and `num_key_value_heads`, KV sharing without an
earlier layer of the sharing layer's kind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM, KVCache, softcap_value
from fastgen.models.layers import GATE_UP_PACKING, QKV_PACKING, GatedMLP, get_activation
from fastgen.models.moe import StackedExperts
from fastgen.models.parallel import MergedLinear, RowParallelLinear, VocabParallelEmbedding, all_reduce
from fastgen.models.rope import DEFAULT_MAX_CACHE_POSITIONS, RotaryEmbedding, build_rotary_embedding
from fastgen.ops import AttentionMetadata, attention

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The `layer_types` entries Gemma 4 defines."""

_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_ROPE_KEYS = {"default": {"rope_type", "rope_theta"},
              "proportional": {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}}
_LAYER_OVERRIDES = {"head_dim", "num_key_value_heads"}


@dataclass(frozen=True, slots=True)
class Gemma4LayerSpec:
    """What differs between Gemma 4 layers, resolved from the config as HF resolves it."""

    layer_type: str
    """"sliding_attention" or "full_attention"."""
    head_dim: int
    """Width of this layer's heads (global layers: `global_head_dim`)."""
    num_kv_heads: int
    """KV heads of this layer (global layers with `attention_k_eq_v`: `num_global_key_value_heads`)."""
    kv_source: int
    """The layer whose K/V cache this layer attends: itself, or for a KV-sharing layer the last
    earlier non-sharing layer of its kind."""
    k_eq_v: bool
    """V is the K projection (no v_proj): `attention_k_eq_v` on a global layer."""
    mlp_size: int
    """Intermediate width of the dense MLP (doubled on KV-sharing layers by `use_double_wide_mlp`)."""


def _layer_types(raw: dict, num_layers: int) -> list[str]:
    """`layer_types`, or HF's default (five local, one global); the last layer is global, as HF forces it."""
    types = list(raw.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)])
    if len(types) != num_layers:
        raise ValueError(f"gemma4_text layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"gemma4_text layer_types entries {unknown} are not implemented "
                         f"(supported: {list(LAYER_TYPES)})")
    types[-1] = "full_attention"
    return types


def _layer_overrides(raw: dict, types: list[str]) -> dict[int, dict]:
    """Per layer index, the attributes that differ from the top level: the config's `per_layer_config`
    (what transformers 5.24 writes), else derived from `global_head_dim` and `num_global_key_value_heads`
    as `Gemma4TextConfig` derives them."""
    if raw.get("per_layer_config") is not None:
        overrides = {int(i): dict(values) for i, values in raw["per_layer_config"].items()}
        for index, values in overrides.items():
            unknown = sorted(set(values) - _LAYER_OVERRIDES)
            if unknown:
                raise ValueError(f"gemma4_text per_layer_config[{index}] overrides {unknown}, which are not "
                                 f"implemented (supported: {sorted(_LAYER_OVERRIDES)})")
            if not 0 <= index < len(types):
                raise ValueError(f"gemma4_text per_layer_config names layer {index} of {len(types)}")
        return overrides
    override = {"head_dim": raw.get("global_head_dim") or 512}
    # HF gates the global KV-head count on attention_k_eq_v.
    if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads") is not None:
        override["num_key_value_heads"] = raw["num_global_key_value_heads"]
    return {i: dict(override) for i, t in enumerate(types) if t == "full_attention"}


def layer_specs(config: ModelConfig) -> list[Gemma4LayerSpec]:
    """Each layer's `Gemma4LayerSpec`; ValueError naming what the config asks for that is not implemented."""
    raw, num_layers = config.raw, config.num_layers
    types = _layer_types(raw, num_layers)
    overrides = _layer_overrides(raw, types)
    shared = raw.get("num_kv_shared_layers") or 0
    if not 0 <= shared < num_layers:
        raise ValueError(f"gemma4_text num_kv_shared_layers={shared} must leave at least one of the "
                         f"{num_layers} layers computing K/V")
    first_shared = num_layers - shared
    specs = []
    for i, layer_type in enumerate(types):
        source = i
        if i >= first_shared:
            earlier = [j for j in range(first_shared) if types[j] == layer_type]
            if not earlier:
                raise ValueError(f"gemma4_text num_kv_shared_layers={shared}: layer {i} ({layer_type}) has no "
                                 "earlier layer of its kind to share K/V with")
            source = earlier[-1]
        values = overrides.get(i, {})
        double = bool(raw.get("use_double_wide_mlp")) and source != i
        specs.append(Gemma4LayerSpec(
            layer_type=layer_type,
            head_dim=values.get("head_dim", config.head_dim),
            num_kv_heads=values.get("num_key_value_heads", config.num_kv_heads),
            kv_source=source,
            k_eq_v=bool(raw.get("attention_k_eq_v")) and layer_type == "full_attention",
            mlp_size=config.intermediate_size * (2 if double else 1),
        ))
    return specs


def rope_parameters(raw: dict, types: list[str]) -> dict[str, dict]:
    """The rope dict of each layer type in use (HF's defaults when `rope_parameters` is absent)."""
    params = raw.get("rope_parameters") or _DEFAULT_ROPE
    out = {}
    for layer_type in sorted(set(types)):
        rope = params.get(layer_type)
        if not isinstance(rope, dict):
            raise ValueError(f"gemma4_text rope_parameters has no entry for {layer_type!r}")
        rope_type = rope.get("rope_type", "default")
        if rope_type not in _ROPE_KEYS:
            raise ValueError(f"gemma4_text rope_parameters[{layer_type!r}] rope_type {rope_type!r} is not implemented "
                             f"(supported: {sorted(_ROPE_KEYS)})")
        unknown = sorted(set(rope) - _ROPE_KEYS[rope_type])
        if unknown:
            raise ValueError(f"gemma4_text rope_parameters[{layer_type!r}] keys {unknown} are not implemented for "
                             f"rope_type {rope_type!r}")
        out[layer_type] = {"rope_type": rope_type, **rope}
    return out


def gemma4_model_config(config: ModelConfig) -> ModelConfig:
    """`config` with Gemma 4's layer kinds, windows, per-layer caches, activation and tying resolved."""
    raw = config.raw
    if raw.get("use_bidirectional_attention") == "all":
        raise ValueError("gemma4_text with use_bidirectional_attention='all' (an encoder) is not supported: "
                         "fastgen serves causal decoders")
    types = _layer_types(raw, config.num_layers)
    raw = {**raw, "layer_types": types}
    rope_parameters(raw, types)
    if raw.get("enable_moe_block"):
        missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not raw.get(k)]
        if missing:
            raise ValueError(f"gemma4_text enable_moe_block=True needs {missing} in config.json")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    get_activation(act)
    window = raw.get("sliding_window") or 0
    config = dataclasses.replace(
        config, raw=raw, hidden_act=act, tie_word_embeddings=raw.get("tie_word_embeddings", True),
        layer_sliding_windows=[window if t == "sliding_attention" else 0 for t in types])
    specs = layer_specs(config)
    kv_heads = [(s.num_kv_heads, s.head_dim) if s.kv_source == i else None for i, s in enumerate(specs)]
    return dataclasses.replace(config, layer_kv_heads=kv_heads)


class Gemma4RMSNorm(nn.Module):
    """RMSNorm in fp32 scaling by `weight` (HF's Gemma4RMSNorm), or by nothing with `scale=False`."""

    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of `x`."""
        out = x.float()
        # HF's torch.pow(..., -0.5), not rsqrt: the two may differ in the last bit.
        out = out * torch.pow(out.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.to(x.dtype)


class ProportionalRotary(nn.Module):
    """HF's "proportional" rotary over `head_dim`-wide heads: `angles` frequency pairs turning at
    `base ** (-2i / head_dim) / factor`, the other `head_dim / 2 - angles` pairs at frequency 0.

    Rotate-half pairs dim `i` with `i + head_dim / 2`, so the turning dims are `[0, angles)` and
    `[head_dim / 2, head_dim / 2 + angles)`: those are gathered and rotated by a `RotaryEmbedding`
    of their width, the rest pass through (HF rotates them by angle 0, which is the identity).
    """

    def __init__(self, head_dim: int, angles: int, base: float, factor: float, max_position: int) -> None:
        super().__init__()
        self.half, self.angles = head_dim // 2, angles
        exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponents) / factor
        positions = torch.arange(min(max_position, DEFAULT_MAX_CACHE_POSITIONS), dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq
        self.turning = RotaryEmbedding(2 * angles, torch.cat((freqs.cos(), freqs.sin()), dim=-1))

    def _pick(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x[..., : self.angles], x[..., self.half : self.half + self.angles]), dim=-1)

    def _put(self, x: torch.Tensor, turned: torch.Tensor) -> torch.Tensor:
        a, h = self.angles, self.half
        return torch.cat((turned[..., :a], x[..., a:h], turned[..., a:], x[..., h + a :]), dim=-1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                long_rope: torch.Tensor | None = None, step_cache: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`query` and `key` `[T, heads, head_dim]` rotated by `positions` (`RotaryEmbedding.forward`)."""
        q, k = self.turning(positions, self._pick(query), self._pick(key), long_rope, step_cache)
        return self._put(query, q), self._put(key, k)


def build_rotaries(config: ModelConfig) -> nn.Module:
    """One rotary per layer type in use, as children named by the type, each over its layers' heads."""
    specs = layer_specs(config)
    rotaries = nn.Module()
    for layer_type, rope in rope_parameters(config.raw, [s.layer_type for s in specs]).items():
        head_dim = next(s.head_dim for s in specs if s.layer_type == layer_type)
        base = float(rope["rope_theta"])
        if rope["rope_type"] == "default":
            # Gemma 4's default rotary turns every pair, whatever partial_rotary_factor says.
            rotary = build_rotary_embedding(head_dim, head_dim, config.max_position_embeddings, base)
        else:
            angles = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
            rotary = ProportionalRotary(head_dim, angles, base, float(rope.get("factor", 1.0)),
                                        config.max_position_embeddings) if angles else None
        setattr(rotaries, layer_type, rotary)
    return rotaries


class Gemma4Attention(nn.Module):
    """Self-attention of one layer (this rank's heads under tensor parallelism): q/k normed per head,
    v normed without weight, scale 1; a KV-sharing layer projects only q and attends its source's K/V."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        spec = layer_specs(config)[layer_idx]
        tp, eps = config.parallel, config.rms_norm_eps
        self.num_heads = tp.split(config.num_heads, "the attention heads")
        self.num_kv_heads = tp.kv_heads(spec.num_kv_heads)
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.shares_kv = spec.kv_source != layer_idx
        self.k_eq_v = spec.k_eq_v
        self.sliding_window = config.layer_sliding_windows[layer_idx]
        # q, then (unless K/V come from another layer) k, then (unless V is K's projection) v.
        full, local, starts = [config.num_heads * self.head_dim], [self.q_size], [tp.rank * self.q_size]
        if not self.shares_kv:
            kv_local = self.num_kv_heads * self.head_dim
            projections = 1 if self.k_eq_v else 2
            full += [spec.num_kv_heads * self.head_dim] * projections
            local += [kv_local] * projections
            starts += [tp.kv_head_start(spec.num_kv_heads) * self.head_dim] * projections
        self.sizes = local
        self.qkv_proj = MergedLinear(config.hidden_size, full, config.attention_bias, tp,
                                     output_sizes=local, shard_starts=starts)
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, config.attention_bias, tp)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        if not self.shares_kv:
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, scale=False)
        # Shared across layers; kept out of the module tree.
        self._rotary = [getattr(rotary, spec.layer_type)]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: KVCache, shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attend this step's tokens `hidden` `[T, hidden]`; returns the output and the step's K/V it
        attended with (this layer's own, or `shared_kv`: its source layer's, whose cache `kv_cache` is)."""
        num_tokens = hidden.shape[0]
        parts = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        q = self.q_norm(parts[0].view(num_tokens, self.num_heads, self.head_dim))
        rotary = self._rotary[0]
        if shared_kv is None:
            k = parts[1].view(num_tokens, self.num_kv_heads, self.head_dim)
            v = self.v_norm(k if self.k_eq_v else parts[2].view(num_tokens, self.num_kv_heads, self.head_dim))
            k = self.k_norm(k)
            if rotary is not None:
                q, k = rotary(positions, q, k, attn_metadata.long_rope, attn_metadata.step_plans)
        else:
            k, v = shared_kv
            if rotary is not None:
                # Only q turns: a zero-head view stands in for the key.
                q, _ = rotary(positions, q, q[:, :0], attn_metadata.long_rope, attn_metadata.step_plans)
        # The op writes K/V into the cache before attending: for a sharing layer that rewrites the
        # source layer's values into the same slots, which leaves the cache as it was.
        out = attention(q, k, v, kv_cache, attn_metadata, 1.0, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size)), (k, v)


class Gemma4Router(nn.Module):
    """Expert choice: weightless norm, learned scale times hidden ** -0.5, softmax (fp32) top-k
    renormalised, each weight times its expert's learned scale."""

    unquantized_children = ("proj",)
    """Kept in the plan dtype under `quantization`: the choice of experts hinges on it."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.root_size = hidden_size**-0.5
        self.norm = Gemma4RMSNorm(hidden_size, eps, scale=False)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 routing weights and expert ids `[T, k]` for `hidden` `[T, H]`."""
        probs = torch.softmax(self.proj(self.norm(hidden) * self.scale * self.root_size), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    """Attention, dense MLP (plus the MoE block), per-layer-input branch, each with Gemma's sandwich
    norms; the output scaled by `layer_scalar`."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        raw, tp = config.raw, config.parallel
        spec = layer_specs(config)[layer_idx]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(config, layer_idx, rotary)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, spec.mlp_size, config.hidden_act, tp=tp)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.experts: StackedExperts | None = None
        if raw.get("enable_moe_block"):
            self.top_k = raw["top_k_experts"]
            self.router = Gemma4Router(hidden, raw["num_experts"], self.top_k, eps)
            self.experts = StackedExperts(raw["num_experts"], hidden, raw["moe_intermediate_size"],
                                          config.hidden_act, tp)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.per_layer_size = raw.get("hidden_size_per_layer_input") or 0
        if self.per_layer_size:
            self.act = get_activation(config.hidden_act)
            # P is small (256 in the released models): replicated on every rank, not split.
            self.per_layer_input_gate = nn.Linear(hidden, self.per_layer_size, bias=False)
            self.per_layer_projection = nn.Linear(self.per_layer_size, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        # A checkpoint tensor (a persistent buffer in HF), kept in fp32 and rounded to the activations'
        # dtype where it is used, as HF's model-dtype buffer is.
        self.register_buffer("layer_scalar", torch.ones(1))

    @property
    def has_shared_expert(self) -> bool:
        """With the MoE block the dense MLP runs on every token beside the experts (the planner asks)."""
        return self.experts is not None

    @property
    def shared_expert(self) -> GatedMLP:
        """The dense MLP, the always-on part of the MoE block (the planner sizes it)."""
        return self.mlp

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: KVCache, per_layer_input: torch.Tensor | None = None,
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Run one layer over the flat batch; also returns the K/V it attended with (for the layers
        that share them)."""
        attn, kv = self.self_attn(positions, self.input_layernorm(hidden), attn_metadata, kv_cache, shared_kv)
        hidden = hidden + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.experts is not None:
            weights, ids = self.router(hidden)
            routed = all_reduce(self.experts(self.pre_feedforward_layernorm_2(hidden), weights, ids), self.tp)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        hidden = hidden + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar.to(hidden.dtype), kv


class Gemma4ForCausalLM(DecoderLM):
    """Causal LM over Gemma 4's text decoder."""

    layer_cls = Gemma4DecoderLayer
    packed_modules_mapping = {**QKV_PACKING, **GATE_UP_PACKING}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        config = self.config
        raw, tp = config.raw, config.parallel
        # Buffers, not Python floats: HF multiplies by these factors rounded to the model dtype, and a
        # buffer stays valid under CUDA-graph capture.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.final_logit_softcap = softcap_value(raw, "final_logit_softcapping")
        self.kv_sources = [spec.kv_source for spec in layer_specs(config)]
        self.kv_producers = frozenset(s for i, s in enumerate(self.kv_sources) if s != i)
        self.per_layer_size = raw.get("hidden_size_per_layer_input") or 0
        if self.per_layer_size:
            width = config.num_layers * self.per_layer_size
            body = self.body
            body.embed_tokens_per_layer = VocabParallelEmbedding(raw.get("vocab_size_per_layer_input", 262_144),
                                                                 width, tp)
            body.per_layer_model_projection = nn.Linear(config.hidden_size, width, bias=False)
            body.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_size, config.rms_norm_eps)
            self.register_buffer("per_layer_embed_scale", torch.tensor(self.per_layer_size**0.5), persistent=False)

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """Gemma 4's reading of the config (`gemma4_model_config`)."""
        return gemma4_model_config(config)

    def build_rotary(self, config: ModelConfig) -> nn.Module:
        """One rotary per layer type (`build_rotaries`)."""
        return build_rotaries(config)

    def build_norm(self, config: ModelConfig) -> nn.Module:
        """Gemma 4's RMSNorm."""
        return Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The embedding scaled by sqrt(hidden_size) rounded to the model dtype."""
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale.to(hidden.dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Each token's per-layer inputs `[T, layers, P]`: its row of the per-layer table (scaled by
        sqrt(P)) and the normed projection of its embedding, summed and scaled by 1 / sqrt(2)."""
        body, num_tokens = self.body, input_ids.shape[0]
        shape = (num_tokens, self.config.num_layers, self.per_layer_size)
        rows = body.embed_tokens_per_layer(input_ids)
        rows = (rows * self.per_layer_embed_scale.to(rows.dtype)).view(shape)
        projected = body.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        projected = body.per_layer_projection_norm(projected.view(shape))
        return (projected + rows) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """Hidden states `[T, hidden]`; a KV-sharing layer gets its source layer's cache and this step's K/V."""
        hidden = self.embed(input_ids, positions)
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.per_layer_size else None
        step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (layer, source) in enumerate(zip(self.layers, self.kv_sources)):
            layer_input = None if per_layer is None else per_layer[:, i]
            hidden, kv = layer(positions, hidden, attn_metadata, kv_caches[source], layer_input, step_kv.get(source))
            if i in self.kv_producers:
                step_kv[i] = kv
        return self.finish(hidden)

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Soft-capped by `final_logit_softcapping`, in fp32."""
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Skip the K/V projections and norms a checkpoint may hold for KV-sharing layers (HF ignores them too)."""
        parts = name.split(".")
        if (len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn"
                and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")
                and self.kv_sources[int(parts[2])] != int(parts[2])):
            return None
        return name, tensor

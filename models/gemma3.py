"""Gemma 3's text decoder (HF `model_type` "gemma3_text"; the language model of Gemma 3 1B-27B).

Gemma 2's layer (`gemma.py`: `1 + w` RMSNorms, four norms per layer, GeGLU, scaled embedding,
`query_pre_attn_scalar`) with:
- per-head q/k norms (Gemma's RMSNorm) before the rotary;
- local (sliding-window) and global layers, `layer_types` or, in configs written by transformers
  4.x, every `sliding_window_pattern`-th layer global (default 6: five local, one global);
- each kind its own rotary: local layers `rope_local_base_freq` (10k) unscaled, global layers
  `rope_theta` (1M) with `rope_scaling` (linear x8 on the 4B+ models). transformers 5 writes both
  as `rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}`.

Bidirectional attention (`use_bidirectional_attention`, EmbeddingGemma) is refused: a causal
engine cannot serve it.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn

from fastgen.models.attention import Attention
from fastgen.models.config import ModelConfig
from fastgen.models.gemma import GemmaDecoderLayer, GemmaForCausalLM, GemmaRMSNorm, gemma_attention, gemma_model_config
from fastgen.models.rope import build_rotary_embedding

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The `layer_types` entries Gemma 3 defines."""

_DEFAULT_THETA = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}


def gemma3_rope_parameters(raw: dict) -> dict[str, dict]:
    """Per layer type, the rope dict (`rope_type`, `rope_theta`, scaling keys), from transformers 5's
    nested `rope_parameters` or 4.x's `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and any(t in params for t in LAYER_TYPES):
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"gemma3_text rope_parameters has entries for unknown layer types {unknown}")
        out = {t: dict(params.get(t) or {}) for t in LAYER_TYPES}
    else:
        scaling = dict(raw.get("rope_scaling") or {})
        out = {"sliding_attention": {"rope_theta": raw.get("rope_local_base_freq")},
               "full_attention": {**scaling, "rope_theta": raw.get("rope_theta")}}
    for layer_type, rope in out.items():
        rope["rope_type"] = rope.pop("rope_type", rope.pop("type", "default")) or "default"
        if rope.get("rope_theta") is None:
            rope["rope_theta"] = _DEFAULT_THETA[layer_type]
    return out


def gemma3_model_config(config: ModelConfig) -> ModelConfig:
    """`config` with Gemma 3's layer kinds, windows, activation and tying resolved as HF does."""
    raw = config.raw
    if raw.get("use_bidirectional_attention"):
        raise ValueError("gemma3_text with use_bidirectional_attention=True (an embedding model) is not supported: "
                         "fastgen serves causal decoders")
    layer_types = raw.get("layer_types")
    if not layer_types:
        pattern = raw.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config.num_layers)]
    window = raw.get("sliding_window") or 0
    windows = [window if t == "sliding_attention" else 0 for t in layer_types]
    config = gemma_model_config(config)
    raw = {**raw, "layer_types": list(layer_types), "query_pre_attn_scalar": raw.get("query_pre_attn_scalar", 256)}
    return dataclasses.replace(config, layer_sliding_windows=windows, raw=raw)


class Gemma3DecoderLayer(GemmaDecoderLayer):
    """Gemma 2's layer with per-head q/k norms and the rotary of its layer kind."""

    def build_attention(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> Attention:
        """Gemma attention over this layer kind's rotary, q and k normed per head."""
        layer_type = config.raw["layer_types"][layer_idx]
        return gemma_attention(config, layer_idx, getattr(rotary, layer_type),
                               head_norm=functools.partial(GemmaRMSNorm, eps=config.rms_norm_eps))


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Causal LM over Gemma 3's text decoder."""

    layer_cls = Gemma3DecoderLayer
    supported_layer_types = frozenset(LAYER_TYPES)

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """Gemma 3's reading of the config (`gemma3_model_config`)."""
        return gemma3_model_config(config)

    def build_rotary(self, config: ModelConfig) -> nn.Module:
        """Both rotaries, as `sliding_attention` and `full_attention` children (one table each)."""
        rotaries = nn.Module()
        for layer_type, rope in gemma3_rope_parameters(config.raw).items():
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            setattr(rotaries, layer_type, build_rotary_embedding(
                head_dim=config.head_dim, rotary_dim=config.head_dim, max_position=config.max_position_embeddings,
                base=float(rope["rope_theta"]), rope_scaling=None if scaling["rope_type"] == "default" else scaling))
        return rotaries

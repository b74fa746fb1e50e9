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
from fastgen.models.layers import layer_type_rope_parameters, layer_type_rotaries


_DEFAULT_THETA = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
_LEGACY_THETA_KEYS = {"sliding_attention": "rope_local_base_freq", "full_attention": "rope_theta"}


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

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """Gemma 3's reading of the config (`gemma3_model_config`)."""
        return gemma3_model_config(config)

    def build_rotary(self, config: ModelConfig) -> nn.Module:
        """Both rotaries, as `sliding_attention` and `full_attention` children."""
        return layer_type_rotaries(config, layer_type_rope_parameters(config.raw, _DEFAULT_THETA, _LEGACY_THETA_KEYS))

"""GGUF metadata -> a Hugging Face-style config dict, per llama.cpp architecture.

The keys and their meaning are those llama.cpp's `convert_hf_to_gguf.py` writes and its loader
reads, including what the loader assumes when a key is absent. Two settings arrive as tensors:
Llama 3.1's rope scaling (`rope_freqs`, per-frequency divisors) and Phi-3's LongRoPE factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from fastgen.models.gguf.reader import Metadata, check_tensor_types, open_gguf, tensor_values, torch_shape


@dataclass(frozen=True, slots=True)
class Family:
    """How one GGUF architecture maps onto an HF `model_type`."""

    model_type: str
    """The HF `model_type` (the registry key) it loads as."""
    architecture: str
    """The HF class name written into config.json's `architectures`."""
    block: MappingProxyType[str, str]
    """GGUF tensor inside `blk.N.` -> HF module under `model.layers.N.`."""
    permute_qk: bool = False
    """llama.cpp's convert script interleaves Q/K rows for its GPT-J-style rotary; HF rotates halves."""
    norm_offset: float = 0.0
    """llama.cpp stores Gemma's RMSNorm weights as `1 + w` (ggml scales by the weight itself)."""
    hidden_act: str = "silu"


_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Phi-3's q/k/v and gate/up stay fused, in the row order of HF's qkv_proj and gate_up_proj.
_PHI3_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2 names its four norms differently: `ffn_norm` is the one before the MLP.
_GEMMA2_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

GGUF_FAMILIES: MappingProxyType[str, Family] = MappingProxyType({
    # Mistral GGUFs say "llama" too: the same decoder (llama.cpp records no sliding window for them).
    "llama": Family("llama", "LlamaForCausalLM", MappingProxyType(_LLAMA_BLOCK), permute_qk=True),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", MappingProxyType(_LLAMA_BLOCK)),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", MappingProxyType(
        {**_LLAMA_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"})),
    "phi3": Family("phi3", "Phi3ForCausalLM", MappingProxyType(_PHI3_BLOCK)),
    "gemma": Family("gemma", "GemmaForCausalLM", MappingProxyType(_LLAMA_BLOCK), norm_offset=1.0,
                    hidden_act="gelu_pytorch_tanh"),
    "gemma2": Family("gemma2", "Gemma2ForCausalLM", MappingProxyType(_GEMMA2_BLOCK), norm_offset=1.0,
                     hidden_act="gelu_pytorch_tanh"),
    # llama.cpp's convert adds 1 to every `*norm.weight` of Gemma 3, the per-head q/k norms included.
    "gemma3": Family("gemma3_text", "Gemma3ForCausalLM", MappingProxyType(
        {**_GEMMA2_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}),
        norm_offset=1.0, hidden_act="gelu_pytorch_tanh"),
})
"""GGUF `general.architecture` -> the family that loads it."""


# A file whose matrices are all of one float type says what dtype the model was saved in.
_FLOAT_DTYPES = MappingProxyType({"F32": "float32", "F16": "float16", "BF16": "bfloat16"})


def family_of(meta: Metadata) -> tuple[str, Family]:
    """The file's architecture and family, or a ValueError naming an unsupported architecture."""
    arch = meta.require("general.architecture")
    family = GGUF_FAMILIES.get(arch)
    if family is None:
        raise ValueError(f"{meta.path}: GGUF architecture {arch!r} is not supported; fastgen loads GGUF files "
                         f"of: {', '.join(sorted(GGUF_FAMILIES))}")
    if (meta.get("split.count") or 1) > 1:
        raise ValueError(f"{meta.path} is one part of a split GGUF ({meta.get('split.count')} parts); merge them "
                         "first with llama.cpp's `llama-gguf-split --merge`")
    if meta.get(f"{arch}.expert_count"):
        raise ValueError(f"{meta.path}: mixture-of-experts GGUF files ({arch} with {meta.get(f'{arch}.expert_count')} "
                         "experts) are not supported yet; load the Hugging Face checkpoint instead")
    return arch, family


def gguf_config_dict(path: str, reader=None) -> dict:
    """The Hugging Face-style config dict (transformers 5 key names) that a GGUF file's metadata describes.

    Pass an open `reader` to avoid reopening the file.
    """
    reader = reader if reader is not None else open_gguf(path)
    meta = Metadata(reader, path)
    arch, family = family_of(meta)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    hidden = meta.require(key("embedding_length"))
    heads = meta.uniform(key("attention.head_count"))
    head_dim = meta.get(key("attention.key_length")) or hidden // heads
    layers = meta.require(key("block_count"))
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": torch_shape(tensors["token_embd.weight"])[0],
        "hidden_size": hidden,
        "intermediate_size": meta.uniform(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.uniform(key("attention.head_count_kv"), heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta.get(key("context_length"), 2048),
        "rms_norm_eps": meta.get(key("attention.layer_norm_rms_epsilon"), 1e-6),
        "hidden_act": family.hidden_act,
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": _rope_parameters(meta, arch, tensors, head_dim),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if family.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    window = meta.get(key("attention.sliding_window")) or 0
    scale = meta.get(key("attention.scale"))
    if family.model_type == "gemma2":
        # llama.cpp's gemma2 defaults, its every-other-layer sliding window and its attention scale
        # (1/sqrt(hidden/heads) for the 46-layer 27B, 1/sqrt(head_dim) otherwise).
        config["attn_logit_softcapping"] = meta.get(key("attn_logit_softcapping"), 50.0)
        config["final_logit_softcapping"] = meta.get(key("final_logit_softcapping"), 30.0)
        config["sliding_window"] = window or None
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 and window else "full_attention"
                                 for i in range(layers)]
        query_scalar = hidden // heads if layers == 46 else head_dim
        config["query_pre_attn_scalar"] = 1.0 / scale**2 if scale else query_scalar
    elif family.model_type == "gemma3_text":
        config.update(_gemma3_settings(meta, arch, config, window, scale))
    elif scale and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        raise ValueError(f"{path}: {key('attention.scale')} = {scale} is not 1/sqrt(head_dim); fastgen's "
                         f"{family.model_type} attention has no other scale")
    elif window and family.model_type == "phi3":
        config["sliding_window"] = window  # llama.cpp runs the other families with full attention
    if family.model_type == "phi3":
        config["original_max_position_embeddings"] = meta.get(key("rope.scaling.original_context_length"),
                                                              config["max_position_embeddings"])
    check_tensor_types(reader, path)
    weight_types = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    if len(weight_types) == 1 and (dtype := _FLOAT_DTYPES.get(next(iter(weight_types)))):
        config["dtype"] = dtype  # a quantized file leaves the dtype to the policy
    return config


# llama.cpp's Gemma 3 constants: its local layers rotate with base 10000, unscaled, whatever the file's
# rope keys say (those describe the global layers), and every sixth layer is global.
_GEMMA3_LOCAL_ROPE = MappingProxyType({"rope_type": "default", "rope_theta": 10_000.0})
_GEMMA3_PATTERN = 6


def _gemma3_settings(meta: Metadata, arch: str, config: dict, window: int, scale: float | None) -> dict:
    """The Gemma 3 config keys llama.cpp's loader derives (`llama_load_hparams_gemma3` /
    `set_swa_pattern(6)`): layer `il` slides when `il % 6 < 5` and the file has a window (without one
    every layer is global), local layers rotate with `_GEMMA3_LOCAL_ROPE`, the file's rope keys (base,
    linear scaling) are the global layers', no attention soft-cap, an optional final-logit soft-cap,
    and the query scale of the 62-layer 27B (`1/sqrt(hidden/heads)`) or otherwise `1/sqrt(head_dim)`."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    layer_types = ["sliding_attention" if window and i % _GEMMA3_PATTERN < _GEMMA3_PATTERN - 1 else "full_attention"
                   for i in range(layers)]
    query_scalar = config["hidden_size"] // heads if layers == 62 else config["head_dim"]
    return {
        "layer_types": layer_types,
        "sliding_window": window or None,
        "rope_parameters": {"sliding_attention": dict(_GEMMA3_LOCAL_ROPE),
                            "full_attention": config["rope_parameters"]},
        "query_pre_attn_scalar": 1.0 / scale**2 if scale else query_scalar,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping") or None,
    }


def _rope_parameters(meta: Metadata, arch: str, tensors: dict, head_dim: int) -> dict:
    """transformers 5 `rope_parameters` from llama.cpp's rope keys and its rotary tensors."""
    key = lambda name: f"{arch}.rope.{name}"  # noqa: E731
    theta = meta.get(key("freq_base"), 10000.0)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    rotary_dim = meta.get(key("dimension_count")) or head_dim
    if rotary_dim != head_dim:
        params["partial_rotary_factor"] = rotary_dim / head_dim
    kind = meta.get(key("scaling.type"), "none")
    factor = meta.get(key("scaling.factor"))
    original = meta.get(key("scaling.original_context_length"))
    if kind == "linear" and factor and factor != 1.0:
        params.update(rope_type="linear", factor=factor)
    elif kind == "yarn":
        if meta.get(key("scaling.yarn_log_multiplier")):
            raise ValueError(f"{meta.path}: {key('scaling.yarn_log_multiplier')} (DeepSeek-style YaRN) is not supported")
        params["rope_type"] = "yarn"
        optional = {"factor": factor, "original_max_position_embeddings": original,
                    "beta_fast": meta.get(key("scaling.yarn_beta_fast")), "beta_slow": meta.get(key("scaling.yarn_beta_slow"))}
        params.update({k: v for k, v in optional.items() if v is not None})
    elif kind == "longrope" and "rope_factors_long.weight" not in tensors:
        raise ValueError(f"{meta.path}: rope scaling type 'longrope' without rope_factors_long/short tensors")
    elif kind not in ("none", "linear", "longrope", ""):
        raise ValueError(f"{meta.path}: rope scaling type {kind!r} is not supported (supported: none, linear, yarn, "
                         "longrope)")
    if "rope_freqs.weight" in tensors:
        params.update(llama3_rope_settings(tensor_values(tensors["rope_freqs.weight"]), theta, rotary_dim, meta.path))
    if "rope_factors_long.weight" in tensors:
        params.update(rope_type="longrope",
                      long_factor=tensor_values(tensors["rope_factors_long.weight"]).tolist(),
                      short_factor=tensor_values(tensors["rope_factors_short.weight"]).tolist())
        if original is not None:
            params["original_max_position_embeddings"] = original
        if (attn_factor := meta.get(key("scaling.attn_factor"))) is not None:
            params["attention_factor"] = attn_factor
    return params


def llama3_rope_settings(divisors: np.ndarray, theta: float, dim: int, path: str) -> dict:
    """Llama 3.1 rope settings recovered from llama.cpp's `rope_freqs` tensor (per-frequency divisors).

    llama.cpp's convert script stores only the divisors. They depend on the settings through the
    scaling `factor` (the largest divisor) and the line `smooth(1/wavelength)` between the two
    wavelength bounds, so with `low_freq_factor` fixed at 1 the others follow from the divisors.
    The result is checked by recomputing the divisors from it.
    """
    divisors = divisors.astype(np.float64).reshape(-1)
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return {}
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    medium = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    smooth = (1 / divisors[medium] - 1 / factor) / (1 - 1 / factor)
    low, high = 1.0, 4.0  # Llama 3.1's values, used where the divisors leave them open
    if medium.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[medium], smooth, 1)
        high = 1 - 1 / intercept if intercept < 0 else high
        original = slope * (high - low)
    elif medium.sum() == 1:
        original = float(wavelen[medium][0] * (smooth[0] * (high - low) + low))
    else:
        # Any bound between the last unscaled and the first fully scaled wavelength reproduces them.
        unscaled, scaled = wavelen[divisors <= 1 + 1e-4], wavelen[divisors >= factor * (1 - 1e-4)]
        original = math.sqrt(high * unscaled.max() * scaled.min()) if len(unscaled) and len(scaled) else 8192.0
    # The divisors are fp32: snap the fitted values to the round numbers they came from.
    original, high = _tidy(original), _tidy(high)
    expected = np.where(wavelen < original / high, 1.0,
                        np.where(wavelen > original / low, factor,
                                 1 / ((1 - (original / wavelen - low) / (high - low)) / factor
                                      + (original / wavelen - low) / (high - low))))
    if not np.allclose(expected, divisors, rtol=1e-4):
        raise ValueError(f"{path}: rope_freqs.weight does not follow Llama 3.1's rope scaling; fastgen cannot "
                         "reproduce these rotary frequencies")
    return {"rope_type": "llama3", "factor": _tidy(factor), "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}


def _tidy(value: float) -> float | int:
    """`value` as a plain Python number, snapped to the nearest integer, else to 3 decimals, when within
    1e-4 (relative) of it: fitted from fp32 divisors, Llama's 4.0 and 8192 come back as 3.999999 and 8191.999."""
    value = float(value)
    for snapped in (round(value), round(value, 3)):
        if abs(value - snapped) <= 1e-4 * max(abs(value), 1.0):
            return snapped
    return value

"""What the policy needs to know about a model, read from its config.json alone (no weights).

The parameter count is estimated from the architecture: embeddings, attention, the MLP (gated or
not, dense or mixture-of-experts), norms and biases, and the LM head unless it is tied. Family
differences that change the count by more than a rounding error are spelled out per family.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fastgen.models.config import ModelConfig
from fastgen.models.loader import resolve_model_dir

# Families whose MLP is fc1 -> activation -> fc2 (two matrices); every other family is gated (three).
_PLAIN_MLP = frozenset({"gpt2", "opt", "falcon", "phi"})
# Families that carry q/k/v biases whatever `attention_bias` says (their HF code hard-codes them).
_QKV_BIAS = frozenset({"qwen2", "qwen2_moe"})
# Families with a per-head RMSNorm on q and k.
_QK_NORM = frozenset({"qwen3", "qwen3_moe"})
# Families with four norms per layer (pre and post of both attention and MLP).
_FOUR_NORMS = frozenset({"gemma2", "gemma3", "gemma3_text"})


@dataclass(slots=True)
class ModelFacts:
    """A model's size and shape, as the policy sees it."""

    model_type: str
    """HF `model_type` (the family)."""
    num_params: int
    """Estimated parameter count of the weights held in memory."""
    active_params: int
    """Parameters one token multiplies: each layer's attention, its top-k experts (MoE) and the LM
    head, but not the embedding lookup; FLOPs per token are about 2x this."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer."""
    head_dim: int
    """Per-head width."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """MLP width one token goes through (top-k experts plus any shared expert for MoE)."""
    vocab_size: int
    """Rows of the embedding and the LM head."""
    num_experts: int
    """Experts per MoE layer (0 for a dense model)."""
    dtype: torch.dtype | None
    """dtype the checkpoint was saved in (None when config.json does not say)."""
    max_position_embeddings: int
    """Longest context the checkpoint claims."""
    kv_bytes_per_token: int
    """K and V bytes of one token over all layers, in the checkpoint dtype (fp32 when unsaid)."""
    quantizable_params: int = 0
    """Weights of the decoder layers' linears (attention, dense MLPs, shared experts): what
    `quantization` stores in int8/int4. Embeddings, the LM head, norms, biases, routers and
    routed experts stay in the plan dtype."""

    def kv_bytes(self, dtype: torch.dtype, tensor_parallel: int = 1) -> int:
        """K and V bytes of one token on one device, in `dtype`, with KV heads split over ranks."""
        kv_heads = -(-self.num_kv_heads // tensor_parallel)  # ranks beyond the KV heads hold a copy
        return 2 * self.num_layers * kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def weight_bytes(self, dtype: torch.dtype, quantization: str = "none", group_size: int = 128) -> int:
        """Bytes of all weights in `dtype`, the quantizable ones in int8 (plus a `dtype` scale per
        output channel, taken as one per `hidden_size` weights) or int4 (plus a scale and a zero per
        `group_size` weights)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if quantization == "none":
            return self.num_params * itemsize
        per_weight = 1 + itemsize / self.hidden_size if quantization == "int8" else 0.5 + 2 * itemsize / group_size
        return int((self.num_params - self.quantizable_params) * itemsize + self.quantizable_params * per_weight)


def model_facts(model_name_or_path: str) -> ModelFacts:
    """Facts about the model at `model_name_or_path` (a checkpoint directory or cached hub id),
    from its config.json only."""
    path = os.path.join(resolve_model_dir(model_name_or_path), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_name_or_path!r} has no config.json")
    return facts_from_config(ModelConfig.from_file(path))


def facts_from_config(config: ModelConfig) -> ModelFacts:
    """Facts about the model that `config` describes."""
    total, active, quantizable = estimate_params(config)
    itemsize = torch.empty((), dtype=config.dtype or torch.float32).element_size()
    raw = config.raw
    return ModelFacts(
        model_type=config.model_type,
        num_params=total,
        active_params=active,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_size=config.hidden_size,
        intermediate_size=_active_mlp_width(config),
        vocab_size=config.vocab_size,
        num_experts=int(raw.get("num_local_experts") or raw.get("num_experts") or 0),
        dtype=config.dtype,
        max_position_embeddings=config.max_position_embeddings,
        kv_bytes_per_token=2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize,
        quantizable_params=quantizable,
    )


def estimate_params(config: ModelConfig) -> tuple[int, int, int]:
    """(total parameters, parameters used per token, weights `quantization` may store in int8/int4) of
    the model `config` describes."""
    raw, h, v = config.raw, config.hidden_size, config.vocab_size
    mt = config.model_type
    norm = 2 * h if mt in _PLAIN_MLP else h  # LayerNorm has a bias, RMSNorm does not
    embed_width = (raw.get("word_embed_proj_dim") or h) if mt == "opt" else h
    embedding = v * embed_width
    extra = 0  # learned positions and projections, used by every token
    if mt == "gpt2":
        extra = config.max_position_embeddings * h
    elif mt == "opt":
        extra = (config.max_position_embeddings + 2) * h  # OPT offsets positions by 2
        if embed_width != h:
            extra += 2 * embed_width * h  # project_in / project_out
    head = 0 if config.tie_word_embeddings else v * embed_width + (v if mt == "phi" else 0)
    final_norm = norm if not (mt == "opt" and raw.get("_remove_final_layer_norm")) else 0
    total = active = quantizable = 0
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for layer in range(config.num_layers):
        attn = _attention_params(config) + _norms_per_layer(config) * norm
        mlp_total, mlp_active, mlp_linear = _mlp_params(config, layer)
        total += attn + mlp_total
        active += attn + mlp_active
        quantizable += h * (q + 2 * kv) + q * h + mlp_linear
    total += embedding + extra + head + final_norm
    active += extra + final_norm + (head or v * embed_width)  # a tied head still runs per sampled token
    return total, active, quantizable


def _attention_params(config: ModelConfig) -> int:
    """Weights and biases of one layer's attention."""
    raw, h, mt = config.raw, config.hidden_size, config.model_type
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    params = h * (q + 2 * kv) + q * h
    if mt in ("gpt2", "phi") or (mt == "opt" and raw.get("enable_bias", True)):
        params += q + 2 * kv + h
    elif mt == "falcon":
        params += (q + 2 * kv + h) if raw.get("bias") else 0
    elif config.attention_bias:
        params += q + 2 * kv + h
    elif mt in _QKV_BIAS:
        params += q + 2 * kv
    if mt in _QK_NORM:
        params += 2 * config.head_dim
    elif mt == "phi" and raw.get("qk_layernorm"):
        params += 2 * 2 * config.head_dim
    return params


def _norms_per_layer(config: ModelConfig) -> int:
    """Norm modules in one decoder layer."""
    raw, mt = config.raw, config.model_type
    if mt == "phi":
        return 1  # attention and MLP run in parallel off one norm
    if mt == "falcon":
        if raw.get("new_decoder_architecture"):
            return raw.get("num_ln_in_parallel_attn") or 2
        return 1 if raw.get("parallel_attn", True) else 2
    return 4 if mt in _FOUR_NORMS else 2


def _mlp_params(config: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(total, per-token, linear weights outside the routed experts) parameters of one layer's MLP:
    dense, or experts plus router."""
    raw, h, mt = config.raw, config.hidden_size, config.model_type
    if mt in _PLAIN_MLP:
        bias = config.intermediate_size + h if (mt != "falcon" or raw.get("bias")) and raw.get("enable_bias", True) else 0
        dense = 2 * h * config.intermediate_size + bias
        return dense, dense, dense - bias
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if not experts or not _is_moe_layer(raw, layer):
        dense = 3 * h * config.intermediate_size
        return dense, dense, dense
    width = raw.get("moe_intermediate_size") or config.intermediate_size
    top_k = int(raw.get("num_experts_per_tok") or 2)
    router = h * experts
    shared_width = raw.get("shared_expert_intermediate_size") or 0
    shared = 3 * h * shared_width + (h if shared_width else 0)  # shared expert and its sigmoid gate
    shared_linear = 3 * h * shared_width
    return experts * 3 * h * width + router + shared, top_k * 3 * h * width + router + shared, shared_linear


def _is_moe_layer(raw: dict, layer: int) -> bool:
    """Whether `layer` has experts (Qwen-MoE: `mlp_only_layers` and `decoder_sparse_step`)."""
    if layer in (raw.get("mlp_only_layers") or []):
        return False
    step = raw.get("decoder_sparse_step") or 1
    return (layer + 1) % step == 0


def _active_mlp_width(config: ModelConfig) -> int:
    """MLP width one token passes through in an MoE layer (or the dense width)."""
    raw = config.raw
    if not (raw.get("num_local_experts") or raw.get("num_experts")):
        return config.intermediate_size
    width = raw.get("moe_intermediate_size") or config.intermediate_size
    return int(raw.get("num_experts_per_tok") or 2) * width + (raw.get("shared_expert_intermediate_size") or 0)

"""What the policy needs to know about a model, read from its config.json alone (no weights).

The sizes come from the model itself: the registered class for the config's `model_type` is built
on the meta device (no memory, no initialisation) and its parameters are counted, so a family
added to `models/` is sized by its own code, tied embeddings and all. An unregistered
`model_type` is the registry's ValueError. The quantized bytes come from the linears the loader
would quantize (`quantizable_linears`) and the size of their packed form (`quantized_weight_bytes`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import decoder_layers
from fastgen.models.loader import build_empty_model, resolve_model_dir
from fastgen.models.moe import StackedExperts
from fastgen.models.quant import DEFAULT_GROUP_SIZE, quantizable_linears, quantized_weight_bytes


@dataclass(slots=True)
class ModelFacts:
    """A model's size and shape, as the policy sees it."""

    model_type: str
    """HF `model_type` (the family)."""
    num_params: int
    """Parameters of the model as built (a tied LM head counted once)."""
    active_params: int
    """Parameters one token multiplies: everything but the embedding lookups, the routed experts
    scaled by top-k / experts (MoE), and the LM head even when tied; FLOPs per token are about 2x this."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (MLA: 1, the latent every query head attends)."""
    head_dim: int
    """Per-head width of the attention (MLA: the latent vector's, which the absorbed heads attend over)."""
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
    config: ModelConfig
    """The parsed config the facts were computed from."""
    quantized_linears: tuple[tuple[int, int], ...] = ()
    """(out, in) features of each linear `quantization` stores in int8/int4 (the decoder layers'
    attention, dense MLPs and shared experts); everything else stays in the plan dtype."""
    layer_params: int = 0
    """Parameters inside the decoder layers: what weight offload can stream layer by layer (the
    embeddings, LM head and final norm always stay resident)."""
    lora_linears: tuple[tuple[int, int, int], ...] = ()
    """(out, in, merged projections) of each linear LoRA adapts (the same as `quantized_linears`): what
    sizes the adapter slots' stacks."""

    def layer_weight_bytes(self, dtype: torch.dtype, quantization: str = "none",
                           group_size: int = DEFAULT_GROUP_SIZE) -> int:
        """Bytes of the decoder layers' weights (all of them, every quantized linear lives in a layer)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.weight_bytes(dtype, quantization, group_size) - (self.num_params - self.layer_params) * itemsize

    def head_weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one vocabulary x hidden matrix in `dtype`: the LM head's weight (or a copy of it)."""
        return self.vocab_size * self.hidden_size * torch.empty((), dtype=dtype).element_size()

    def kv_bytes(self, dtype: torch.dtype, tensor_parallel: int = 1) -> int:
        """K and V bytes of one token on one device, in `dtype`, with KV heads split over ranks."""
        return self.config.kv_bytes_per_token(dtype, tensor_parallel)

    def weight_bytes(self, dtype: torch.dtype, quantization: str = "none",
                     group_size: int = DEFAULT_GROUP_SIZE) -> int:
        """Bytes of all weights in `dtype`, the quantizable ones packed in int8 or int4 (with their
        scales, and zeros for int4, in `dtype`)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if quantization == "none":
            return self.num_params * itemsize
        quantized = sum(out * inp for out, inp in self.quantized_linears)
        packed = sum(quantized_weight_bytes(out, inp, quantization, dtype, group_size)
                     for out, inp in self.quantized_linears)
        return (self.num_params - quantized) * itemsize + packed


def model_facts(model_name_or_path: str) -> ModelFacts:
    """Facts about the model at `model_name_or_path` (a checkpoint directory or cached hub id),
    from its config.json only."""
    path = os.path.join(resolve_model_dir(model_name_or_path), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_name_or_path!r} has no config.json")
    return facts_from_config(ModelConfig.from_file(path))


def facts_from_config(config: ModelConfig) -> ModelFacts:
    """Facts about the model that `config` describes, counted on its model built on the meta device."""
    model = build_empty_model(config)
    # An MoE block (`SparseMoeBlock` or a family's own) holds its routed experts as `experts`.
    moe_blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), StackedExperts)]
    intermediate = config.intermediate_size
    if moe_blocks:
        block = moe_blocks[0]
        shared = block.shared_expert.intermediate_size if block.has_shared_expert else 0
        intermediate = block.top_k * block.experts.intermediate_size + shared
    return ModelFacts(
        model_type=config.model_type,
        num_params=sum(p.numel() for p in model.parameters()),
        active_params=_active_params(model, moe_blocks),
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=1 if config.kv_latent_dim else config.num_kv_heads,
        head_dim=config.kv_latent_dim or config.head_dim,
        hidden_size=config.hidden_size,
        intermediate_size=intermediate,
        vocab_size=config.vocab_size,
        num_experts=moe_blocks[0].experts.num_experts if moe_blocks else 0,
        dtype=config.dtype,
        max_position_embeddings=config.max_position_embeddings,
        # The model's own config: its family's reading (per-layer caches, tying defaults) resolved.
        kv_bytes_per_token=model.config.kv_bytes_per_token(config.dtype or torch.float32, 1),
        config=model.config,
        quantized_linears=tuple((m.out_features, m.in_features) for m in quantizable_linears(model).values()),
        layer_params=sum(p.numel() for p in decoder_layers(model).parameters()),
        lora_linears=tuple((m.out_features, m.in_features, len(getattr(m, "output_sizes", (m.out_features,))))
                           for m in quantizable_linears(model).values()),
    )


def _active_params(model: nn.Module, moe_blocks: list[nn.Module]) -> int:
    """Parameters one token multiplies, counted module by module on `model`."""
    share = {id(b.experts): b.top_k / b.experts.num_experts for b in moe_blocks}
    active = 0.0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue  # a lookup multiplies nothing; a tied LM head is counted as the head it also is
        params = sum(p.numel() for p in module.parameters(recurse=False))
        active += params * share.get(id(module), 1.0)
    return int(active)

"""Building blocks shared by the model families: norms, merged linears, the gated MLP, and the
config-to-rotary and checkpoint-packing conventions every family uses.

Rotary embeddings live in `rope.py`; paged attention in `fastgen.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.parallel import SINGLE, MergedLinear, RowParallelLinear, TensorParallel
from fastgen.models.rope import RotaryEmbedding, build_rotary_embedding

QKV_PACKING = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
"""Checkpoint q/k/v projections -> shards of our merged `qkv_proj` (for `packed_modules_mapping`)."""

GATE_UP_PACKING = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
"""Checkpoint gate/up projections -> shards of our merged `gate_up_proj`."""


def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
    """The model's rotary embedding (one per model, shared by its layers) from its config."""
    return build_rotary_embedding(
        head_dim=config.head_dim,
        rotary_dim=int(config.head_dim * config.partial_rotary_factor),
        max_position=config.max_position_embeddings,
        base=config.rope_theta,
        rope_scaling=config.rope_scaling,
    )

def layer_type_rope_parameters(raw: dict, default_theta: dict[str, float],
                               legacy_theta_keys: dict[str, str]) -> dict[str, dict]:
    """Per layer type (`sliding_attention`, `full_attention`), the rope dict of a model whose layer
    kinds rotate differently (Gemma 3, OLMo 3): transformers 5's nested `rope_parameters`, or 4.x's
    top-level keys (`legacy_theta_keys[type]` names each kind's base; `rope_scaling` applies to the
    full layers, as transformers 5 converts it). Bases default to `default_theta`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and any(t in params for t in default_theta):
        unknown = sorted(set(params) - set(default_theta))
        if unknown:
            raise ValueError(f"{raw.get('model_type')} rope_parameters has entries for unknown layer types {unknown}")
        out = {t: dict(params.get(t) or {}) for t in default_theta}
    else:
        out = {t: {"rope_theta": raw.get(key)} for t, key in legacy_theta_keys.items()}
        out["full_attention"].update(raw.get("rope_scaling") or {})
    for layer_type, rope in out.items():
        rope["rope_type"] = rope.pop("rope_type", rope.pop("type", "default")) or "default"
        if rope.get("rope_theta") is None:
            rope["rope_theta"] = default_theta[layer_type]
    return out


def layer_type_rotaries(config: ModelConfig, rope_parameters: dict[str, dict]) -> nn.Module:
    """One rotary per layer type, as children named by the type (the layers pick theirs)."""
    rotaries = nn.Module()
    for layer_type, rope in rope_parameters.items():
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        setattr(rotaries, layer_type, build_rotary_embedding(
            head_dim=config.head_dim, rotary_dim=int(config.head_dim * config.partial_rotary_factor),
            max_position=config.max_position_embeddings, base=float(rope["rope_theta"]),
            rope_scaling=None if scaling["rope_type"] == "default" else scaling))
    return rotaries


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str):
    """The activation function for an HF `hidden_act` name."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as HF's Llama does, then cast back."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of `x`."""
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's one-call norm computes HF's formula below in this order (bitwise equal in fp32,
            # checked by test_norm), in ~8 against ~11 us at one row: 61 calls a step at batch 1.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # HF's cast-normalise-cast, the normalising in torch's one call (bitwise the same in fp32): 4 ops
        # against 8, 61 norms a step.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(dtype)


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up merged into one projection.

    Under tensor parallelism gate/up are column-parallel and down row-parallel: one all-reduce,
    or none with `reduce=False` (the caller sums this partial output with others first).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False,
                 tp: TensorParallel = SINGLE, reduce: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp, reduce=reduce)
        self.act = get_activation(hidden_act)
        self.intermediate_size = self.gate_up_proj.output_sizes[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` `[T, hidden]`."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        # In place: `act(gate)` is this call's own tensor (or a view of `gate`, which nothing reads
        # after), so the product needs no `[T, intermediate]` allocation of its own.
        return self.down_proj(self.act(gate).mul_(up))


class MLP(nn.Module):
    """`fc2(act(fc1(x)))`, not gated: fc1 column-parallel, fc2 row-parallel (one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = True,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.fc1 = MergedLinear(hidden_size, [intermediate_size], bias=bias, tp=tp)
        self.fc2 = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` `[T, hidden]`."""
        return self.fc2(self.act(self.fc1(x)))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the `nn.ModuleList` of `config.num_layers` modules nearest
    the root (`model.layers`, `transformer.h`, ...), found by shape so no family declares it.

    Nearest the root because a layer may itself hold lists (experts, per-head modules) whose length
    happens to match. ValueError when there is none.
    """
    num_layers = model.config.num_layers
    best: tuple[int, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            depth = name.count(".")
            if best is None or depth < best[0]:
                best = (depth, module)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of its {num_layers} decoder layers")
    return best[1]

"""Whether a pre-norm gated-MLP block can run as the C++ decode layer (`fastgen.ops.cpu_kernels.decode_layer`),
and its fixed arguments where it can.

The op computes exactly one block shape: `h + attn(norm1(h))`, then `+ down(silu(gate) * up)(norm2(.))`, with
RMSNorms, a merged q/k/v (its bias and per-head q/k RMSNorms optional: Qwen2, Qwen3), no query prescaling, NeoX
rotary from one cos/sin cache (or none), and every linear on fastgen's int4, Q8_0, bf16-tile or fp32-tile CPU
kernel on one rank. Anything else (another norm or activation, another bias, LoRA, tensor parallelism, LongRoPE's two factor
sets, torch's int4 kernel) keeps the layer's own forward; the reason says which part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastgen.models.attention import Attention
from fastgen.models.layers import GatedMLP, RMSNorm
from fastgen.models.packed import PackedLinear
from fastgen.models.quant import QuantizedLinear
from fastgen.models.rope import RotaryEmbedding
from fastgen.ops.cpu_kernels.decode_layer import BF16_KIND, F32_KIND, Q8_0_KIND, TILE_KINDS, DecodeLayerWeights
from fastgen.ops.cpu_kernels.q8 import TILE as Q8_TILE
from fastgen.ops.gemv import GEMV_MAX_ROWS

_KINDS = {"int4_q4": None, "int8_q8_0": Q8_0_KIND}
"""`QuantizedLinear.kernel`s the op multiplies (int4: its group size is the kind)."""


def _linear(name: str, linear: nn.Module, bias: bool = False) -> tuple[tuple, int] | str:
    """(its two weight tensors, its kind) or why the op cannot multiply it (`bias`: the op adds this one's)."""
    if linear.tp.size > 1 or (linear.bias is not None and not bias):
        return f"{name} has a bias or is split over tensor-parallel ranks"
    if type(linear) is PackedLinear:
        tiles = linear.gemv_weight
        if tiles is None or tiles.dim() != 2:
            return f"{name} is a packed linear without bf16 or fp32 tiles for fastgen's C++ kernels (gemv_weights)"
        return (tiles, tiles), BF16_KIND if tiles.dtype == torch.bfloat16 else F32_KIND
    if type(linear) is not QuantizedLinear:
        return f"{name} is a {type(linear).__name__}, not an int4/int8/tiled linear on fastgen's C++ kernels"
    if linear.kernel not in _KINDS:
        return f"{name} runs the {linear.kernel or 'unloaded'} kernel, not fastgen's int4 or Q8_0 one"
    if linear.kernel == "int8_q8_0":
        if linear.out_features % Q8_TILE:
            return f"{name} has {linear.out_features} outputs, not whole {Q8_TILE}-column tiles of the Q8_0 kernel"
        return (linear.qweight, linear.scales), Q8_0_KIND
    return (linear.qweight, linear.scales_zeros), linear.group_size


def pre_norm_decode_weights(input_norm: nn.Module, attn: nn.Module, post_norm: nn.Module,
                            mlp: nn.Module) -> DecodeLayerWeights | str:
    """The op's arguments for the block `h + attn(input_norm(h))`, then `+ mlp(post_norm(.))`, or why it
    cannot run it."""
    for name, norm in (("input norm", input_norm), ("post-attention norm", post_norm)):
        if type(norm) is not RMSNorm:
            return f"the {name} is a {type(norm).__name__}, not an RMSNorm"
    if input_norm.eps != post_norm.eps:
        return "the two norms have different epsilons"
    if type(attn) is not Attention or attn.full_norm or attn.prescale_query:
        return "the attention has whole-projection q/k norms, query prescaling or another shape"
    head_norms = (attn.q_norm, attn.k_norm) if attn.head_norm else ()
    if any(type(norm) is not RMSNorm for norm in head_norms) or len({norm.eps for norm in head_norms}) > 1:
        return "the per-head q/k norms are not RMSNorms of one epsilon"
    if type(mlp) is not GatedMLP or mlp.act is not F.silu:
        return "the MLP is not a SiLU-gated one"
    rotary = attn._rotary[0]
    if rotary is not None and (type(rotary) is not RotaryEmbedding or rotary.original_max is not None):
        return "the rotary embedding has LongRoPE's two factor sets or another form"
    linears = []
    for name, linear in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj), ("gate_up_proj", mlp.gate_up_proj),
                         ("down_proj", mlp.down_proj)):
        got = _linear(name, linear, bias=name == "qkv_proj")
        if isinstance(got, str):
            return got
        linears.append(got)
    (qkv, _), (o, _), (gate_up, _), (down, _) = linears
    weights = (input_norm.weight, *qkv, *o, post_norm.weight, *gate_up, *down)
    kinds = tuple(kind for _, kind in linears)
    return DecodeLayerWeights(
        weights=weights, kinds=kinds, cos_sin=None if rotary is None else rotary.cos_sin_cache.float(),
        qkv_bias=attn.qkv_proj.bias, q_norm=head_norms[0].weight if head_norms else None,
        k_norm=head_norms[1].weight if head_norms else None,
        head_eps=float(head_norms[0].eps) if head_norms else 0.0,
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, eps=float(input_norm.eps),
        scale=float(attn.scale), sliding_window=int(attn.sliding_window or 0), softcap=float(attn.softcap),
        **({"max_rows": GEMV_MAX_ROWS} if set(TILE_KINDS) & set(kinds) else {}))

"""A pre-norm gated-MLP decoder layer of a few-row step as one C++ call (`decode_layer.cpp`).

At batch 1 a layer's kernels are about half its time; the other half is the Python around them, whichever way
the layer runs (a compiled graph's guards and wrapper, or eager op calls). This op runs the whole layer
(RMSNorm, q/k/v with its bias, per-head q/k RMSNorms, rotary, the paged attention with its KV write, output
projection, residual, RMSNorm, gate/up, SiLU-and-mul, down, residual) from C++, calling the same kernels:
fastgen's int4, Q8_0, bf16-tile or fp32-tile linears and its paged decode attention. The model decides which layers it can take (`DecodeLayerWeights`); a step
takes it where the attention kernel serves every row (`DecodeLayerStep`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgen.ops.cpu_kernels.build import active_op
from fastgen.ops.cpu_kernels.decode import KernelStep

Q8_0_KIND = 0
"""The kind of a Q8_0 linear (packed and scales in `fastgen.ops.cpu_kernels.q8`'s layout, whole tiles); an int4
linear's kind is its group size (packed and scales_zeros in `fastgen.ops.cpu_kernels.q4`'s layout)."""

BF16_KIND = -1
"""The kind of a bf16 linear in `fastgen.ops.cpu_kernels.bf16`'s tiles (the tiles, then any tensor: unused)."""

F32_KIND = -2
"""The kind of an fp32 linear in `fastgen.ops.cpu_kernels.f32`'s tiles (the tiles, then any tensor: unused)."""

TILE_KINDS = (BF16_KIND, F32_KIND)
"""The kinds of linears in column tiles: GEMV kernels, which take steps of at most `GEMV_MAX_ROWS` rows."""

MAX_ROWS = 16
"""Most tokens in a step the layer op takes: decode steps of up to that many sequences, verification rows,
short prompt chunks. Larger steps keep the layer's own forward (compiled), whose per-call cost they amortise."""


@dataclass(frozen=True, slots=True)
class DecodeLayerWeights:
    """One layer's fixed arguments of the op, gathered once when the engine installs it."""

    weights: tuple[torch.Tensor, ...]
    """input_layernorm.weight, qkv_proj's two tensors, o_proj's two, post_attention_layernorm.weight,
    gate_up_proj's two, down_proj's two (each linear: int4 packed and scales_zeros, or Q8_0 values and scales)."""
    kinds: tuple[int, int, int, int]
    """Per linear (qkv, o, gate_up, down): its int4 group size, `Q8_0_KIND`, `BF16_KIND` or `F32_KIND`."""
    cos_sin: torch.Tensor | None
    """The rotary cache, fp32 `[positions, rotary_dim]` (cos then sin, NeoX rotate-half); None: no rotary."""
    qkv_bias: torch.Tensor | None
    """q/k/v's bias (Qwen2), added to the product; None: none."""
    q_norm: torch.Tensor | None
    """Per-head RMSNorm weight `[head_dim]` of the queries before the rotary (Qwen3); None: no head norms."""
    k_norm: torch.Tensor | None
    """The keys' per-head RMSNorm weight (with `q_norm`)."""
    head_eps: float
    """The head norms' epsilon."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """KV heads (the cache's)."""
    head_dim: int
    """Width of a head."""
    eps: float
    """Both norms' epsilon."""
    scale: float
    """Attention score scale."""
    sliding_window: int
    """The layer's window (0: full attention)."""
    softcap: float
    """Soft-capping of the scores (0: none)."""
    max_rows: int = MAX_ROWS
    """Most tokens a step may have for this layer to take the op: bf16 and fp32 tiles are GEMV kernels (each row a
    pass over the weight), which oneDNN's GEMM overtakes past a few rows."""


def decode_layer_op() -> torch._ops.OpOverloadPacket | None:
    """`fastgen::decode_layer_<isa>` of the variant this process runs; None where the kernels are off or could not
    be built."""
    return active_op("decode_layer")


@dataclass(frozen=True, slots=True)
class DecodeLayerStep:
    """A step the layer op takes: the attention kernel's plan of it, which serves every row."""

    op: torch._ops.OpOverloadPacket
    """`fastgen::decode_layer_<isa>`."""
    kernel: KernelStep
    """The paged decode kernel's metadata and longest query for this step."""

    def run(self, layer: DecodeLayerWeights, hidden: torch.Tensor, positions: torch.Tensor,
            kv_cache: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor) -> torch.Tensor:
        """The layer's output `[T, H]` for `hidden` `[T, H]`, the step's K/V written into `kv_cache`."""
        return self.op(hidden, positions, layer.cos_sin, layer.weights, layer.kinds, layer.qkv_bias, layer.q_norm,
                       layer.k_norm, kv_cache[0], kv_cache[1], slot_mapping, *self.kernel.metadata, layer.num_heads,
                       layer.num_kv_heads, layer.head_dim, layer.eps, layer.head_eps, layer.scale, layer.sliding_window,
                       layer.softcap, self.kernel.max_query_len)


def plan_decode_layer_step(num_tokens: int, kernel: KernelStep | None) -> DecodeLayerStep | None:
    """The layer op's part in a step of `num_tokens` tokens whose attention kernel plan is `kernel`: None where
    the step is larger than `MAX_ROWS`, or the kernel leaves rows to the torch path (or is off)."""
    if kernel is None or not kernel.every_row or num_tokens > MAX_ROWS:
        return None
    op = decode_layer_op()
    return None if op is None else DecodeLayerStep(op, kernel)

"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 and Qwen3-Next, as a layer over the
engine's flat ragged batch.

Instead of K/V per token, the layer keeps two fixed-size states per sequence (`gated_delta_states`):
its causal conv window and its delta-rule state matrix per value head. The engine gives each
running sequence one slot of each pool (`AttentionMetadata.state_slots`); the layer's cache is the
pair of pools, as an attention layer's is its K/V blocks. The recurrence itself is
`fastgen.ops.gated_delta_batch`.

Under tensor parallelism the heads split: each rank holds its key heads' q/k channels and its value
heads' v/z channels, gates and state (the value heads of a key head stay on its rank, since they
are consecutive), and `out_proj` is row-parallel: one all-reduce per layer, as for attention.

Checkpoints come in two layouts, both loaded into the same modules: Qwen3.5's `in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a` (the family's `packed_modules_mapping` merges b and a), and
Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, grouped per key head, which `next_projection_rows`
reorders into ours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastgen.models.config import ModelConfig, StateSpec
from fastgen.models.parallel import MergedLinear, RowParallelLinear, read_merged_rows, read_slice
from fastgen.ops import AttentionMetadata
from fastgen.ops.gated_delta import conv_state_shape, gating, recurrent_state_shape
from fastgen.ops.gated_delta_batch import gated_delta_net, torch_gated_delta_net


def _linear_attention_sizes(config: ModelConfig) -> tuple[int, int, int, int, int]:
    """(num_k_heads, k_head_dim, num_v_heads, v_head_dim, conv_kernel) of the config's linear layers."""
    raw = config.raw
    keys = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
            "linear_conv_kernel_dim")
    missing = [k for k in keys if not isinstance(raw.get(k), int) or raw[k] < 1]
    if missing:
        raise ValueError(f"{config.model_type} config.json: linear-attention sizes {missing} must be positive ints")
    nk, dk, nv, dv, kernel = (raw[k] for k in keys)
    if nv % nk:
        raise ValueError(f"{config.model_type}: linear_num_value_heads ({nv}) must be a multiple of "
                         f"linear_num_key_heads ({nk})")
    return nk, dk, nv, dv, kernel


def gated_delta_states(config: ModelConfig) -> tuple[StateSpec, StateSpec]:
    """The per-sequence state of one Gated DeltaNet layer: the conv window (model dtype) and the
    delta-rule state matrices (fp32), both split over tensor-parallel ranks by head."""
    nk, dk, nv, dv, kernel = _linear_attention_sizes(config)
    return (StateSpec(conv_state_shape(2 * nk * dk + nv * dv, kernel)),
            StateSpec(recurrent_state_shape(nv, dk, dv), torch.float32))


def next_projection_rows(weight: torch.Tensor, num_k_heads: int, group_sizes: list[int]) -> torch.Tensor:
    """Qwen3-Next's projection rows, grouped per key head (`[h0: a0|b0|..., h1: a1|b1|..., ...]`, piece
    `i` of `group_sizes[i]` rows per head), reordered to ours: every head's piece 0, then piece 1, ..."""
    grouped = weight.reshape(num_k_heads, sum(group_sizes), *weight.shape[1:])
    return torch.cat([piece.reshape(-1, *weight.shape[1:]) for piece in grouped.split(group_sizes, dim=1)])


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times SiLU of its gate z (HF's `RMSNormGated`: norm in fp32,
    weight applied in the input dtype, gate in fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """`x`, `gate`: `[rows, dim]`."""
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)


class ConvChannels(nn.Module):
    """The depthwise conv's weight `[channels, 1, kernel]` (an `nn.Conv1d`'s, as checkpoints name it),
    holding this rank's q, k and v channels."""

    def __init__(self, full_sizes: list[int], local_sizes: list[int], starts: list[int], kernel: int) -> None:
        super().__init__()
        self.full_sizes, self.local_sizes, self.starts = full_sizes, local_sizes, starts
        self.weight = nn.Parameter(torch.empty(sum(local_sizes), 1, kernel))

    def load_checkpoint_shard(self, attr: str, shard: int | None, full) -> torch.Tensor:
        """This rank's q, k and v channels of the checkpoint's conv weight."""
        return read_merged_rows(full, self.full_sizes, self.starts, self.local_sizes)


class GatedDeltaNet(nn.Module):
    """One layer's Gated DeltaNet over the flat batch: projections, causal conv, gated delta rule on
    each sequence's state slot, gated norm, output projection. `fused_projections`: the checkpoint is
    Qwen3-Next's (`in_proj_qkvz`, `in_proj_ba`), else Qwen3.5's."""

    def __init__(self, config: ModelConfig, fused_projections: bool) -> None:
        super().__init__()
        tp = config.parallel
        nk, dk, nv, dv, kernel = _linear_attention_sizes(config)
        self.num_k_heads = tp.split(nk, "the linear-attention key heads")
        self.num_v_heads = tp.split(nv, "the linear-attention value heads")
        self.k_head_dim, self.v_head_dim = dk, dv
        key_dim, value_dim = nk * dk, nv * dv
        self.key_size, self.value_size = self.num_k_heads * dk, self.num_v_heads * dv
        self.fused = fused_projections
        hidden = config.hidden_size
        if fused_projections:
            self.in_proj_qkvz = MergedLinear(hidden, [key_dim, key_dim, value_dim, value_dim], bias=False, tp=tp)
        else:
            self.in_proj_qkv = MergedLinear(hidden, [key_dim, key_dim, value_dim], bias=False, tp=tp)
            self.in_proj_z = MergedLinear(hidden, [value_dim], bias=False, tp=tp)
        self.in_proj_ba = MergedLinear(hidden, [nv, nv], bias=False, tp=tp)
        local = [self.key_size, self.key_size, self.value_size]
        self.conv1d = ConvChannels([key_dim, key_dim, value_dim], local, [tp.rank * size for size in local], kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, hidden, bias=False, tp=tp)
        self._value_head_start = tp.rank * self.num_v_heads

    def load_checkpoint_shard(self, attr: str, shard: int | None, full) -> torch.Tensor:
        """This rank's value heads of `dt_bias` and `A_log`."""
        return read_slice(full, 0, self._value_head_start, self.num_v_heads)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's input q|k|v `[T, conv channels]`, the gate z `[T, value]`, and b, a `[T, value heads]`."""
        conv_size = 2 * self.key_size + self.value_size
        if self.fused:
            mixed_qkv, z = self.in_proj_qkvz(hidden).split([conv_size, self.value_size], dim=-1)
        else:
            mixed_qkv, z = self.in_proj_qkv(hidden), self.in_proj_z(hidden)
        b, a = self.in_proj_ba(hidden).split([self.num_v_heads, self.num_v_heads], dim=-1)
        return mixed_qkv, z, b, a

    def forward(self, hidden: torch.Tensor, attn_metadata: AttentionMetadata,
                cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mix this step's tokens `hidden` `[T, hidden]` with their sequences' states; `cache` is the
        layer's (conv window pool, state matrix pool)."""
        num_tokens = hidden.shape[0]
        mixed_qkv, z, b, a = self.project(hidden)
        g, beta = gating(a, b, self.A_log, self.dt_bias)
        md = attn_metadata
        # Eager calls skip the op dispatcher (a compiled layer needs the op: one opaque graph node).
        mixer = gated_delta_net if torch.compiler.is_compiling() else torch_gated_delta_net
        out = mixer(mixed_qkv, g, beta, self.conv1d.weight[:, 0], cache[0], cache[1], md.query_start_loc,
                    md.seq_lens, md.state_slots, self.num_k_heads, self.k_head_dim, self.num_v_heads, self.v_head_dim)
        out = self.norm(out.reshape(-1, self.v_head_dim), z.reshape(-1, self.v_head_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_size))

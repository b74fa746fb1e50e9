"""The self-attention block the families share: merged q/k/v, optional q/k norms, rotary, paged
attention, output projection, all tensor-parallel.

Under tensor parallelism `qkv_proj` is column-parallel (this rank's query heads and its KV heads,
copied when ranks outnumber them) and `o_proj` row-parallel: one all-reduce per block. What the
families vary is passed in: biases, the score scale, soft-capping, the layer's window, per-head
q/k norms (Qwen3's RMSNorm, Phi's LayerNorm, Gemma's `1 + w` norm), norms over the whole q/k
projection (OLMo 2), whether the rotary applies at all on this layer (NoPE layers).

Module names are fixed (`qkv_proj`, `o_proj`, `q_norm`, `k_norm`); a family whose checkpoint
says otherwise renames through its `packed_modules_mapping`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.parallel import SINGLE, RowParallelLinear, TensorParallel, all_reduce, qkv_linear, read_slice
from fastgen.ops import AttentionMetadata, attention

KVCache = tuple[torch.Tensor, torch.Tensor]


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a whole projection whose columns are split over the tensor-parallel ranks
    (OLMo 2's q/k norm over all heads): the ranks sum their squares with one all-reduce.

    `dim` is the full width; this rank holds `local_dim` columns starting at `start`.
    """

    def __init__(self, dim: int, local_dim: int, start: int, eps: float, tp: TensorParallel) -> None:
        super().__init__()
        self.dim, self.local_dim, self.start, self.eps, self.tp = dim, local_dim, start, eps, tp
        self.weight = nn.Parameter(torch.ones(local_dim))

    def load_checkpoint_shard(self, attr: str, shard: int | None, full) -> torch.Tensor:
        """This rank's columns of the norm weight."""
        return read_slice(full, 0, self.start, self.local_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise `x` `[T, local_dim]` by the mean square over all `dim` columns (fp32 and the weight
        multiplied before the cast back, as HF's OLMo 2 does)."""
        dtype = x.dtype
        x = x.float()
        if self.tp.size == 1:
            variance = x.pow(2).mean(-1, keepdim=True)
        else:
            variance = all_reduce(x.pow(2).sum(-1, keepdim=True), self.tp) / self.dim
        return (self.weight * (x * torch.rsqrt(variance + self.eps))).to(dtype)


class Attention(nn.Module):
    """Self-attention of one layer over the paged KV cache (this rank's heads under tensor parallelism)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: nn.Module | None,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        scale: float | None = None,
        softcap: float = 0.0,
        sliding_window: int | None = None,
        head_norm: Callable[[int], nn.Module] | None = None,
        full_norm_eps: float | None = None,
        prescale_query: bool = False,
    ) -> None:
        """`scale` defaults to head_dim ** -0.5 and `sliding_window` to the config's for this layer.
        `head_norm(head_dim)` builds the per-head q and k norms; `full_norm_eps` instead normalises
        the whole q and k projections (`ShardedRMSNorm`). `prescale_query` multiplies q by the scale
        and attends with scale 1 (OPT's rounding order). `rotary` None: no positions (NoPE, learned
        absolute positions)."""
        super().__init__()
        tp = config.parallel
        # Under tensor parallelism this rank holds only its heads; the sizes below are its share.
        self.num_heads = tp.split(config.num_heads, "the attention heads")
        self.num_kv_heads = tp.kv_heads(config.num_kv_heads)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.prescale_query = prescale_query
        self.softcap = softcap
        self.sliding_window = config.layer_sliding_windows[layer_idx] if sliding_window is None else sliding_window
        self.qkv_proj = qkv_linear(config.hidden_size, config.num_heads, config.num_kv_heads, self.head_dim,
                                   qkv_bias, tp)
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, o_bias, tp)
        self.head_norm = head_norm is not None
        self.full_norm = full_norm_eps is not None
        if self.head_norm:
            self.q_norm = head_norm(self.head_dim)
            self.k_norm = head_norm(self.head_dim)
        elif self.full_norm:
            q_start, kv_start = self.qkv_proj.shard_starts[:2]
            self.q_norm = ShardedRMSNorm(config.num_heads * self.head_dim, self.q_size, q_start, full_norm_eps, tp)
            # With KV heads copied over ranks, each rank normalises its copy over the full K width.
            self.k_norm = ShardedRMSNorm(config.num_kv_heads * self.head_dim, self.kv_size, kv_start,
                                         full_norm_eps, tp if config.num_kv_heads >= tp.size else SINGLE)
        # Shared across layers; kept out of the module tree so it is neither a parameter
        # nor registered once per layer.
        self._rotary = [rotary]

    def project(self, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k and v `[T, Hkv, D]` of this step's tokens, normed and rotated."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.full_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self._rotary[0] is not None:
            q, k = self._rotary[0](positions, q, k, attn_metadata.long_rope, attn_metadata.step_plans)
        return q, k, v

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Attend this step's tokens `hidden` `[T, hidden]` over their sequences' cached K/V."""
        q, k, v = self.project(positions, hidden, attn_metadata)
        scale = self.scale
        if self.prescale_query:
            q, scale = q * self.scale, 1.0
        out = attention(q, k, v, kv_cache, attn_metadata, scale, self.sliding_window, self.softcap)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))


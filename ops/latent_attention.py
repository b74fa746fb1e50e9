"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) over a paged latent cache, as one op.

MLA caches, per token and layer, one vector instead of K and V: the normalised KV latent `c`
(`kv_lora_rank` wide) followed by the rotated key part every head shares, `k_rope`
(`qk_rope_head_dim`). Per head, K and V are up-projections of `c` (`k_nope = W_UK c`,
`v = W_UV c`), so with those absorbed into the query and the output (the model's work) a head
attends over the cached vectors themselves:

    score_j = q_nope . W_UK c_j + q_rope . k_rope_j = [W_UK^T q_nope, q_rope] . [c_j, k_rope_j]
    out     = sum_j p_j W_UV c_j = W_UV (sum_j p_j c_j)

That is multi-query attention (every query head over one KV "head") whose keys are the cached
vectors and whose values are the same vectors, of which the caller keeps the first `kv_lora_rank`
columns (the `k_rope` columns ride along through the value sum: 64 of 576 columns for DeepSeek-V3,
in exchange for reusing every paged-attention path as is). So the op runs the paged-attention
implementations with the one cache as both K and V cache: `torch_paged_attention` on the CPU
(decode rows block by block, prompt chunks through SDPA) and `triton_paged_attention` on CUDA, both
tested against a float64 MLA oracle (`tests/test_latent_attention.py`).

Three ops share one signature, as in `fastgen.ops.paged_attention`: `fastgen::latent_attention`
picks by device, `fastgen::latent_attention_torch` / `fastgen::latent_attention_triton` force one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fastgen.ops.paged_attention import torch_paged_attention
from fastgen.ops.triton_attention import triton_paged_attention

if TYPE_CHECKING:
    from fastgen.ops.attention_metadata import AttentionMetadata


def _check(query: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor) -> None:
    """ValueError naming the mismatch unless query `[T, H, D]`, latent `[T, 1, D]` and cache `[B, S, 1, D]` agree."""
    width = cache.shape[-1]
    if cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(f"the latent cache must be [num_blocks, block_size, 1, width], got {tuple(cache.shape)}")
    if query.dim() != 3 or query.shape[-1] != width or tuple(latent.shape) != (query.shape[0], 1, width):
        raise ValueError(f"query must be [tokens, heads, {width}] and latent [tokens, 1, {width}] to match the "
                         f"latent cache, got {tuple(query.shape)} and {tuple(latent.shape)}")


def torch_latent_attention(
    query: torch.Tensor,
    latent: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    step_plans: dict | None = None,
) -> torch.Tensor:
    """Write this step's latent vectors into `cache`, then attend (plain torch).

    `query` `[T, num_heads, width]` holds the absorbed queries `[W_UK^T q_nope, q_rope]`, `latent`
    `[T, 1, width]` each token's `[c, k_rope]`, `cache` one layer's `[num_blocks, block_size, 1, width]`;
    the metadata is `AttentionMetadata`'s. Returns `[T, num_heads, width]`: each head's softmax-weighted
    sum of the cached vectors (zeros for padded tokens); its first `kv_lora_rank` columns are the latent
    output. `step_plans` as in `torch_paged_attention`.
    """
    _check(query, latent, cache)
    return torch_paged_attention(query, latent, latent, cache, cache, slot_mapping, block_tables, seq_lens,
                                 query_start_loc, scale, step_plans=step_plans)


def triton_latent_attention(
    query: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
) -> torch.Tensor:
    """`torch_latent_attention`'s contract through the Triton kernels (widths up to their 256-column head
    limit: DeepSeek-V3's 576-wide latent is refused there, naming the width)."""
    _check(query, latent, cache)
    return triton_paged_attention(query, latent, latent, cache, cache, slot_mapping, block_tables, seq_lens,
                                  query_start_loc, scale)


# Registered like `fastgen::paged_attention` (see there for why `torch.library.Library`).
_SCHEMA = ("(Tensor query, Tensor latent, Tensor(a!) cache, Tensor slot_mapping, Tensor block_tables, "
           "Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor")
_LIBRARY = torch.library.Library("fastgen", "FRAGMENT")
for _name in ("latent_attention", "latent_attention_torch", "latent_attention_triton"):
    _LIBRARY.define(_name + _SCHEMA)
_LIBRARY.impl("latent_attention", torch_latent_attention, "CompositeExplicitAutograd")
_LIBRARY.impl("latent_attention", triton_latent_attention, "CUDA")
_LIBRARY.impl("latent_attention_torch", torch_latent_attention, "CompositeExplicitAutograd")
_LIBRARY.impl("latent_attention_triton", triton_latent_attention, "CompositeExplicitAutograd")

_OPS = {"auto": torch.ops.fastgen.latent_attention, "torch": torch.ops.fastgen.latent_attention_torch,
        "triton": torch.ops.fastgen.latent_attention_triton,
        # The backend "cpu" names fastgen's C++ kernel for paged attention; latent attention has none: torch.
        "cpu": torch.ops.fastgen.latent_attention_torch}


def latent_attention(
    query: torch.Tensor,
    latent: torch.Tensor,
    kv_cache: tuple[torch.Tensor, ...],
    attn_metadata: "AttentionMetadata",
    scale: float,
) -> torch.Tensor:
    """What MLA model code calls: one layer's latent attention through `attn_metadata.backend`.
    `kv_cache` is the layer's `(latent_cache,)` (`ModelConfig.kv_cache_shapes`)."""
    md = attn_metadata
    if md.backend not in _OPS:
        raise ValueError(f"unknown attention backend {md.backend!r} (supported: {', '.join(_OPS)})")
    torch_path = md.backend in ("torch", "cpu") or (md.backend == "auto" and query.device.type != "cuda")
    if torch_path and not torch.compiler.is_compiling():
        # Eager: the implementation itself, keeping the step's plans for the other layers (as `attention`).
        return torch_latent_attention(query, latent, kv_cache[0], md.slot_mapping, md.block_tables, md.seq_lens,
                                      md.query_start_loc, scale, md.step_plans)
    return _OPS[md.backend](query, latent, kv_cache[0], md.slot_mapping, md.block_tables, md.seq_lens,
                            md.query_start_loc, scale)


def _fake(query, latent, cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    return torch.empty_like(query)


for _name in ("latent_attention", "latent_attention_torch", "latent_attention_triton"):
    torch.library.register_fake(f"fastgen::{_name}", _fake, lib=_LIBRARY)

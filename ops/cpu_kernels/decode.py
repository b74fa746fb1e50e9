"""The short-query rows of a paged-attention step (decode rows, speculative verification rows, short prompt
chunks) on the C++ CPU kernel, or nothing where it cannot serve them."""

from __future__ import annotations

import torch

from fastgen.ops.cpu_kernels.build import load_paged_decode
from fastgen.ops.cpu_kernels.isa import cpu_kernel_isa

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Cache dtypes the kernel reads (the query in the same dtype)."""

MAX_GROUP = 16
"""Most query heads per KV head the kernel takes (`kMaxGroup`)."""

MAX_QUERY_LEN = 16
"""Longest query (one sequence's tokens in a step) sent to the kernel: a decode row, a verification row (1 +
its drafts), a short prompt chunk. The kernel reads a sequence's keys once per query token, while torch's
flash path over a longer chunk reads them once for all its rows after gathering them from the blocks."""

MAX_HEAD_DIM = 512
"""Largest head dim the kernel takes (`kMaxHeadDim`); it must also be a multiple of 16."""


def kernel_serves(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes, dtypes and layouts (any block size, sliding window, softcap,
    sinks and attention chunk are its own flags)."""
    head_dim, kv_heads = k_cache.shape[3], k_cache.shape[2]
    return (query.device.type == "cpu" and query.dtype in KERNEL_DTYPES
            and k_cache.dtype == query.dtype and v_cache.dtype == query.dtype
            and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and query.shape[1] % kv_heads == 0 and query.shape[1] // kv_heads <= MAX_GROUP
            and k_cache.stride(3) == 1 and v_cache.stride(3) == 1)


def cpu_decode_rows(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, sliding_window: int,
                    softcap: float, sinks: torch.Tensor | None, attention_chunk: int, out: torch.Tensor,
                    max_query_len: int = 1) -> bool:
    """Attend the query tokens of every sequence that has 1 to `max_query_len` of them (`query_start_loc`),
    each at its causal position, over its blocks, in one kernel call, into `out` (contiguous, like `query`);
    the other rows of `out` are left as they are.
    False, with nothing done, where the kernel is off (`FASTGEN_CPU_KERNELS`), could not be built, or does
    not take these tensors (`kernel_serves`). This step's K/V must already be in the cache."""
    if not kernel_serves(query, k_cache, v_cache):
        return False
    isa = cpu_kernel_isa()
    op = load_paged_decode(isa) if isa is not None else None
    if op is None:
        return False
    int32 = (t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
             for t in (block_tables, seq_lens, query_start_loc))
    op(out, query, k_cache, v_cache, *int32, scale, sliding_window, softcap,
       None if sinks is None else sinks.to(torch.float32).contiguous(), attention_chunk, max_query_len)
    return True

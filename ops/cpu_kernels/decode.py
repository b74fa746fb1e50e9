"""The short-query rows of a paged-attention step (decode rows, speculative verification rows, short prompt
chunks) on the C++ CPU kernel, or nothing where it cannot serve them."""

from __future__ import annotations

import torch

from fastgen.ops.cpu_kernels.build import active_op

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Cache dtypes the kernel reads (the query in the same dtype)."""

MAX_GROUP = 16
"""Most query heads per KV head the kernel takes (`kMaxGroup`)."""

MAX_QUERY_LEN = 16
"""Longest query (one sequence's tokens in a step) always sent to the kernel, whatever its context: a decode
row, a verification row (1 + its drafts), a short prompt chunk. The kernel reads a sequence's keys once per
query token, while torch's flash path over a longer chunk reads them once for all its rows after gathering
them from the blocks: longer chunks take the kernel only within `MAX_CHUNK_PAIRS`."""

MAX_CHUNK_PAIRS = 1 << 18
"""Longer prompt chunks go to the kernel too while their query tokens x the sequence's length stay within
this. There the kernel, reading a sequence's keys once per query token from cache, beats gathering the
blocks for torch's flash kernel; deeper or longer chunks it does not (2-core EPYC, SmolLM2-135M bf16,
prefill tok/s kernel against torch: a 512-token first chunk 1035 / 907, chunks of 300 + 212 tokens 1310 /
1045, four of 128 1383 / 1117; a 1024-token first chunk 916 / 909; a 2048-token one 648 / 740; a 3000-token
prompt in 512-token chunks 414 / 516)."""

MAX_HEAD_DIM = 512
"""Largest head dim the kernel takes (`kMaxHeadDim`); it must also be a multiple of 16."""


def kernel_query_len(chunks: list[tuple[int, int]]) -> int:
    """The longest query (a sequence's tokens in the step) the kernel takes in a step whose sequences have
    `chunks` (query tokens, sequence length after the step): `MAX_QUERY_LEN`, or a longer chunk's length
    while every chunk up to it keeps within `MAX_CHUNK_PAIRS` (the kernel takes every query up to one length)."""
    refused = min((q for q, n in chunks if q > MAX_QUERY_LEN and q * n > MAX_CHUNK_PAIRS), default=None)
    return max([MAX_QUERY_LEN] + [q for q, _ in chunks if refused is None or q < refused])


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
    op = active_op("paged_decode")
    if op is None:
        return False
    int32 = (t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
             for t in (block_tables, seq_lens, query_start_loc))
    op(out, query, k_cache, v_cache, *int32, scale, sliding_window, softcap,
       None if sinks is None else sinks.to(torch.float32).contiguous(), attention_chunk, max_query_len)
    return True

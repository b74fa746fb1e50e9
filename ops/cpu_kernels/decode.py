"""The rows of a paged-attention step the C++ CPU kernel takes (decode rows, speculative verification rows,
prompt chunks up to a bound), which writes the step's K/V into the cache too; or nothing where it cannot
serve them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgen.ops.cpu_kernels.build import kernel_op
from fastgen.ops.cpu_kernels.isa import cpu_kernel_isa

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Cache dtypes the kernel reads (the query in the same dtype)."""

MAX_QUERY_LEN = 16
"""Longest query (one sequence's tokens in a step) always sent to the kernel, whatever its context: a decode
row, a verification row (1 + its drafts), a short prompt chunk. Longer chunks take the kernel while their
query tokens x sequence length stay within `chunk_pairs_limit`, where it beats torch's flash kernel over
blocks gathered for it."""

MAX_CHUNK_PAIRS = 1 << 18
"""Where the kernel attends one row at a time (AVX2), longer chunks take it while their query tokens x the
sequence's length stay within this. There the kernel, reading a sequence's keys once per query token from
cache, beats gathering the blocks for torch's flash kernel; deeper or longer chunks it does not (2-core EPYC,
the AVX512-BF16 variant's row path before it had lanes, SmolLM2-135M bf16, prefill tok/s kernel against
torch: a 512-token first chunk 1035 / 907, chunks of 300 + 212 tokens 1310 / 1045, four of 128 1383 / 1117;
a 1024-token first chunk 916 / 909; a 2048-token one 648 / 740; a 3000-token prompt in 512-token chunks 414 /
516)."""

MAX_LANE_CHUNK_PAIRS = 1 << 23
"""The same bound where the kernel attends chunks 16 rows to a vector without bf16 dot products (the AVX512
variant: fp32, and bf16 or fp16 widened to fp32). One layer of SmolLM2-135M's shape, kernel against torch
(`scripts/bench_cpu_attention.py`, 2-core EPYC, `FASTGEN_CPU_KERNELS=avx512`): 1.24-2.5x up to 2048 x 2048
and 512 x 8192 pairs, 0.77-1.01x at 2048 x 9728."""


def chunk_pairs_limit(isa: str) -> int | None:
    """The most query tokens x sequence length a chunk longer than `MAX_QUERY_LEN` may have to take kernel
    variant `isa`; None: no bound. The AVX512-BF16 variant has none: every chunk measured ran faster on the
    kernel, in every dtype (one layer of SmolLM2-135M's shape, 2-core EPYC, first chunks of 128-2048 tokens
    and chunks of 128-2048 over up to 7680 cached: bf16 2.1-3.2x torch's flash kernel, fp16 2.0-3.4x, fp32
    1.32-2.4x)."""
    return {"avx2": MAX_CHUNK_PAIRS, "avx512": MAX_LANE_CHUNK_PAIRS}.get(isa)


def kernel_query_len(chunks: list[tuple[int, int]], max_pairs: int | None) -> int:
    """The longest query (a sequence's tokens in the step) the kernel takes in a step whose sequences have
    `chunks` (query tokens, sequence length after the step): `MAX_QUERY_LEN`, or a longer chunk's length
    while every chunk up to it keeps within `max_pairs` query tokens x sequence length (None: no bound; the
    kernel takes every query up to one length)."""
    refused = None if max_pairs is None else min(
        (q for q, n in chunks if q > MAX_QUERY_LEN and q * n > max_pairs), default=None)
    return max([MAX_QUERY_LEN] + [q for q, _ in chunks if refused is None or q < refused])


@dataclass(frozen=True, slots=True)
class KernelStep:
    """How every layer of one step calls the kernel, worked out by the step's first layer (`plan_kernel_step`):
    the layer's call is then `op(query, key, value, k_cache, v_cache, slot_mapping, *metadata, scale,
    sliding_window, softcap, sinks, attention_chunk, max_query_len)`, `fastgen::paged_attention`'s arguments.

    The op writes every token's K/V to its slot, then returns the output with the rows of every sequence
    of 1 to `max_query_len` query tokens attended and zeros in every other row (padding, longer chunks); or
    None, having touched nothing, where it does not take the layer's tensors (a dtype other than
    `KERNEL_DTYPES` or not the cache's, a head dim not a multiple of 16 or above 512, more than 16 query heads
    per KV head, head vectors not contiguous in the cache)."""

    op: torch._ops.OpOverloadPacket
    """`fastgen::paged_decode_<isa>` (`paged_decode.cpp`), of the variant this process runs."""
    metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """The step's block_tables, seq_lens and query_start_loc as contiguous int32, the kernel's types."""
    max_query_len: int
    """The longest query the kernel attends this step (`kernel_query_len`)."""
    every_row: bool
    """No sequence has a longer query: the op's output is the layer's whole answer."""


def plan_kernel_step(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
                     ) -> KernelStep | None:
    """The kernel's part of a step, the same for each layer; None where the kernel is off
    (`FASTGEN_CPU_KERNELS`), could not be built, or attends none of the step's sequences."""
    isa = cpu_kernel_isa() if seq_lens.device.type == "cpu" else None
    op = kernel_op("paged_decode", isa) if isa is not None else None
    if op is None:
        return None
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    queries = [(starts[s + 1] - starts[s], n) for s, n in enumerate(lens) if n > 0 and starts[s + 1] > starts[s]]
    max_query_len = kernel_query_len(queries, chunk_pairs_limit(isa))
    if not any(q <= max_query_len for q, _ in queries):
        return None
    metadata = tuple(t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
                     for t in (block_tables, seq_lens, query_start_loc))
    return KernelStep(op, metadata, max_query_len, all(q <= max_query_len for q, _ in queries))

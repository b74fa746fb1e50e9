"""Linears of a few rows (batch-1 decode): the weight's output rows split over the CPU's cores, or bf16 tiles.

At one to four rows a linear is a matrix-vector product (GEMV) that streams its whole weight for
a handful of FLOPs, so its speed is the memory bandwidth it reaches. MKL's GEMV behind `F.linear`
and oneDNN's packed kernel both run it on one core; `torch.bmm` over the weight viewed as `groups`
stacked slices of its output rows runs one slice per core. Measured on a 2-core AMD EPYC (AVX2,
fp32, 30 distinct weights so that none is read from the caches), GB/s of weight streamed:

| weight (out x in) | rows | oneDNN packed | `F.linear` | grouped bmm |
|---|---:|---:|---:|---:|
| 960 x 576 (q/k/v) | 1 | 5.9 | 6.2-6.9 | 10.5-11.1 |
| 3072 x 576 (gate/up) | 1 | 6.8 | 7.1-7.2 | 13.0-13.8 |
| 576 x 1536 (down) | 1 | 8.4 | 9.8-10.3 | 11.7-13.5 |
| 49152 x 576 (LM head) | 1 | 8.8 | 7.3 | 14.7-15.4 |
| 3072 x 576 | 4 | 5.7 | — | 8.6-9.1 |
| 3072 x 576 | 8 | 4.4 | — | 5.8-5.9 |

against 19.6 GB/s for `torch.sum` over 256 MiB. From eight rows on the packed kernel is as fast and
its lead grows with the rows, so `GEMV_MAX_ROWS` is 4. The sums run in another order than
`F.linear`'s: results differ by fp32 rounding only.

bf16 and fp32 weights take fastgen's C++ kernels instead where they build (`fastgen.ops.cpu_kernels.bf16`
and `.f32`: 16 output columns interleaved, each column's sum in its own lane): bf16 ~31 GB/s over
SmolLM2-135M's 30 layers on a 2-core EPYC with AVX512-BF16, against ~18 for oneDNN's packed kernel and ~10 for
ATen's `mv`.
"""

from __future__ import annotations

import torch

from fastgen.ops.cpu_kernels.bf16 import bf16_layout_blocker, bf16_matmul_op, pack_bf16
from fastgen.ops.cpu_kernels.f32 import f32_layout_blocker, f32_matmul_op, pack_f32

GEMV_MAX_ROWS = 4
"""Inputs of at most this many rows take the grouped GEMV (`gemv_linear`); more rows are a GEMM."""

# One row of these dtypes takes `torch.mv`: with no BLAS GEMV for them, ATen runs its own kernel over
# all cores, and it streamed bf16 weights faster than the grouped bmm on a 2-core AMX Xeon (GB/s, 30
# distinct weights: 960 x 576 16.3-19.1 against 15.3-16.4, 3072 x 576 20.2-20.3 against 19.7-19.9,
# 576 x 1536 19.9-20.2 against 11.3-11.7; the 49152 x 576 LM head 18.3-32.5 against 31.1-35.3, a tie
# within that machine's noise). fp32 keeps the grouped bmm: its `mv` is MKL's one-core GEMV.
_ATEN_MV_DTYPES = (torch.bfloat16, torch.float16)


def gemv_groups(out_features: int, threads: int) -> int:
    """Slices to split `out_features` output rows into for `threads` cores: the largest count up to
    `threads` that divides them evenly (1 for a single thread or a prime row count)."""
    if out_features < 1 or threads < 1:
        raise ValueError(f"gemv_groups needs positive out_features and threads, got {out_features} and {threads}")
    return next(g for g in range(min(threads, out_features), 0, -1) if out_features % g == 0)


def group_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """`weight` `[N, K]` as `[groups, N / groups, K]`: a view, no copy (the layout `gemv_linear` reads)."""
    if weight.dim() != 2 or weight.shape[0] % groups:
        raise ValueError(f"cannot split a weight of shape {tuple(weight.shape)} into {groups} groups of output rows")
    return weight.view(groups, weight.shape[0] // groups, weight.shape[1])


def gemv_weight(weight: torch.Tensor, threads: int) -> torch.Tensor:
    """The form of `weight` `[N, K]` that `gemv_linear` multiplies: for bf16 and fp32 where fastgen's C++ kernel
    runs, a copy in its tiles (`pack_bf16`, `pack_f32`; 2-D: bf16 read ~31 GB/s where ATen's `mv` read ~10 on a
    2-core EPYC, SmolLM2-135M's shapes); otherwise `group_weight` over `threads` cores (a view)."""
    if bf16_layout_blocker(weight) is None and bf16_matmul_op() is not None:
        return pack_bf16(weight)
    if f32_layout_blocker(weight) is None and f32_matmul_op() is not None:
        return pack_f32(weight)
    return group_weight(weight.detach(), gemv_groups(weight.shape[0], threads))


def tiles_op(tiles: torch.Tensor) -> torch._ops.OpOverload:
    """The C++ kernel that multiplies `gemv_weight`'s tiles of this dtype; RuntimeError where it is off or failed to
    build since the tiles were made."""
    op = bf16_matmul_op() if tiles.dtype == torch.bfloat16 else f32_matmul_op()
    if op is None:
        raise RuntimeError(f"{tiles.dtype} tiles need fastgen's C++ CPU kernels, which are off or failed to build "
                           "since the engine started (FASTGEN_CPU_KERNELS)")
    return op


def gemv_linear(x: torch.Tensor, grouped_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` over the last dimension of `x`, `W` given as `gemv_weight(W)`: bf16 or fp32 tiles on the
    C++ kernel, or `group_weight(W, groups)`, one `bmm` whose batch entries (output row slices) the CPU runs on
    separate cores."""
    if grouped_weight.dim() == 2:
        flat = x.reshape(-1, x.shape[-1])
        out = tiles_op(grouped_weight)(flat if flat.stride(-1) == 1 else flat.contiguous(), grouped_weight)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias
    groups, rows_per_group, in_features = grouped_weight.shape
    flat = x.reshape(-1, in_features)
    out_shape = (*x.shape[:-1], groups * rows_per_group)
    if flat.shape[0] == 1 and grouped_weight.dtype in _ATEN_MV_DTYPES:
        out = torch.mv(grouped_weight.view(-1, in_features), flat[0]).view(out_shape)
        return out if bias is None else out + bias
    # The columns keep the transposed strides even for one row: an input column of strides (0, 1, 1)
    # took a bmm path 2.7x slower (840 against 310 us a call, 2-core EPYC).
    out = torch.bmm(grouped_weight, flat.t().expand(groups, in_features, flat.shape[0]))
    if flat.shape[0] == 1:
        # One row (batch-1 decode, the common case): [groups, N / groups, 1] is already the output's layout.
        out = out.view(out_shape)
    else:
        # [groups, N / groups, M] -> [M, N]: output row n of slice g is feature g * N / groups + n. Made
        # contiguous as `F.linear`'s output is (a copy of M x N values): a permuted view would be a valid
        # tensor, but kernels that ignore strides exist (see `torch_paged_attention`).
        out = out.permute(2, 0, 1).contiguous().view(out_shape)
    return out if bias is None else out + bias

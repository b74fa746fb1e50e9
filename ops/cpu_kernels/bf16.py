"""bf16 linears of a few rows on the C++ CPU kernel (`bf16_matmul.cpp`): its weight layout, and its op.

The kernel reads the output columns in tiles of 16, interleaved so that one 64-byte load holds one input pair
of each column of a tile (`pack_bf16`), and leaves each column's sum in its own lane: batch-1 decode reads the
weight at the machine's rate, where oneDNN's packed kernel and ATen's `mv` do not.
"""

from __future__ import annotations

import torch

from fastgen.ops.cpu_kernels.build import traced_op

TILE = 16
"""Output columns interleaved together: the kernel takes weights whose output width is a multiple of this."""


def bf16_layout_blocker(weight: torch.Tensor) -> str | None:
    """Why `weight` cannot take the kernel's layout (None: it can)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return f"the kernel multiplies bf16 CPU weights, not {weight.dtype} on {weight.device.type}"
    if weight.dim() != 2 or weight.shape[0] % TILE or weight.shape[1] % 2:
        return f"the kernel takes [N, K] with N a multiple of {TILE} and K even, not {list(weight.shape)}"
    return None


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[N, K]` in the kernel's layout `[N / 16, K * 16]`: tile, input pair, column, the pair's two
    values. ValueError where `bf16_layout_blocker` says no."""
    blocker = bf16_layout_blocker(weight)
    if blocker is not None:
        raise ValueError(blocker)
    n, k = weight.shape
    tiles = weight.detach().view(n // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3)
    return tiles.reshape(n // TILE, k * TILE).contiguous()


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """The `[N, K]` weight of a `pack_bf16` layout (its inverse)."""
    tiles, width = packed.shape
    k = width // TILE
    return packed.view(tiles, k // 2, TILE, 2).permute(0, 2, 1, 3).reshape(tiles * TILE, k)


def _bf16_matmul_fake(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0] * TILE))


def bf16_matmul_op() -> torch._ops.OpOverload | None:
    """`fastgen::bf16_matmul_<isa>` (x `[M, K]` bf16, packed `[N / 16, K * 16]`) -> `[M, N]` bf16, of the variant
    this process runs now; None where the kernels are off or could not be built."""
    return traced_op("bf16_matmul", _bf16_matmul_fake)

"""fp32 linears of a few rows on the C++ CPU kernel (`f32_matmul.cpp`): its weight layout, and its op.

The kernel reads the output columns in tiles of 16, interleaved so that one 64-byte line holds one input of each
column of a tile (`pack_f32`), and leaves each column's sum in its own lane, as the bf16 kernel does
(`fastgen.ops.cpu_kernels.bf16`) with input pairs.
"""

from __future__ import annotations

import torch

from fastgen.ops.cpu_kernels.bf16 import TILE
from fastgen.ops.cpu_kernels.build import traced_op


def f32_layout_blocker(weight: torch.Tensor) -> str | None:
    """Why `weight` cannot take the kernel's layout (None: it can)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return f"the kernel multiplies fp32 CPU weights, not {weight.dtype} on {weight.device.type}"
    if weight.dim() != 2 or weight.shape[0] % TILE:
        return f"the kernel takes [N, K] with N a multiple of {TILE}, not {list(weight.shape)}"
    return None


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[N, K]` in the kernel's layout `[N / 16, K * 16]`: tile, input, column. ValueError where
    `f32_layout_blocker` says no."""
    blocker = f32_layout_blocker(weight)
    if blocker is not None:
        raise ValueError(blocker)
    n, k = weight.shape
    return weight.detach().view(n // TILE, TILE, k).transpose(1, 2).reshape(n // TILE, k * TILE).contiguous()


def unpack_f32(packed: torch.Tensor) -> torch.Tensor:
    """The `[N, K]` weight of a `pack_f32` layout (its inverse)."""
    tiles, width = packed.shape
    k = width // TILE
    return packed.view(tiles, k, TILE).transpose(1, 2).reshape(tiles * TILE, k)


def _f32_matmul_fake(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0] * TILE))


def f32_matmul_op() -> torch._ops.OpOverload | None:
    """`fastgen::f32_matmul_<isa>` (x `[M, K]` fp32, packed `[N / 16, K * 16]`) -> `[M, N]` fp32, of the variant
    this process runs now; None where the kernels are off or could not be built."""
    return traced_op("f32_matmul", _f32_matmul_fake)

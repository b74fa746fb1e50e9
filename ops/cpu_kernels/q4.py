"""int4 linears on the C++ CPU kernel (`q4_matmul.cpp`): its weight layout, and one op a compiled layer calls.

The values are fastgen's int4 (`fastgen.models.quant.quantize_int4`: w = (q - 8) * scale + zero, q in [0, 15],
one scale and zero per group of inputs). The kernel reads the output columns in tiles of 16, interleaved so that
one 64-byte load holds 4 bytes of every column of a tile: within a 64-input chunk, sub-block b (0..7) holds for
each column inputs 4b..4b+3 in its low nibbles and 32+4b..32+4b+3 in its high ones. It quantizes each row of x to
int8 per weight group (scale = max |x| / 127, as llama.cpp's Q8 activations) and sums integer products, each
column's in its own lane.
"""

from __future__ import annotations

import torch

from fastgen.ops.cpu_kernels.build import traced_op

CHUNK = 64
"""Inputs per 32 packed bytes of a column: the kernel takes group sizes that are a multiple of this."""

TILE = 16
"""Output columns interleaved together: the kernel takes layers whose output width is a multiple of this."""


def q4_blocker(device: torch.device, group_size: int) -> str | None:
    """Why an int4 linear with this group size on `device` cannot take the kernel in this process (None: it
    can; the kernel is built, or found in the cache, by this call)."""
    if device.type != "cpu":
        return f"the kernel runs on the CPU, and the layer is on {device.type}"
    if group_size % CHUNK:
        return f"its chunks are {CHUNK} inputs, and the group size is {group_size}"
    if q4_matmul_op() is None:
        return "fastgen's C++ CPU kernels are off (FASTGEN_CPU_KERNELS) or could not be built"
    return None


def pack_q4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of int4 values `q` `[N, K]` (uint8 in [0, 15], N a multiple of `TILE`, K of `CHUNK`)
    with their `scales` and `zeros` `[N, K / group]`: (packed `[N / 16, K * 8]` uint8, scales_zeros
    `[N / 16, K / group, 2, 16]` in the scales' dtype: per tile and group, its 16 scales then its 16 zeros)."""
    n, k = q.shape
    if n % TILE or k % CHUNK:
        raise ValueError(f"the int4 kernel's layout takes [N, K] with N a multiple of {TILE} and K of {CHUNK}, "
                         f"got {list(q.shape)}")
    # k = 64 chunk + 32 half + 4 b + i; a byte is (half 0) | (half 1) << 4; bytes ordered tile, chunk, b, column, i.
    split = q.view(n // TILE, TILE, k // CHUNK, 2, 8, 4)
    nibbles = split[:, :, :, 0] | split[:, :, :, 1] << 4
    packed = nibbles.permute(0, 2, 3, 1, 4).reshape(n // TILE, k * 8).contiguous()
    groups = scales.shape[1]
    scales_zeros = torch.stack((scales, zeros), dim=-1).view(n // TILE, TILE, groups, 2).permute(0, 2, 3, 1)
    return packed, scales_zeros.contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """The uint8 values `[N, K]` of a `pack_q4` layout (its inverse)."""
    tiles, width = packed.shape
    k = width // 8
    nibbles = packed.view(tiles, k // CHUNK, 8, TILE, 4).permute(0, 3, 1, 2, 4)
    return torch.stack((nibbles & 15, nibbles >> 4), dim=3).reshape(tiles * TILE, k)


def dequantize_q4(packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight `[N, K]` a `pack_q4` layout stands for."""
    q = unpack_q4(packed).float()
    n, k = q.shape
    scales, zeros = scales_zeros.float().permute(0, 3, 1, 2).reshape(n, k // group_size, 2).unbind(-1)
    return ((q.view(n, k // group_size, group_size) - 8) * scales[..., None] + zeros[..., None]).view(n, k)


def _q4_matmul_fake(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0] * TILE))


def q4_matmul_op() -> torch._ops.OpOverload | None:
    """`fastgen::q4_matmul_<isa>` (x `[M, K]`, packed `[N / 16, K * 8]`, scales_zeros `[N / 16, K / group, 2, 16]`,
    group) -> `[M, N]` in x's dtype, of the variant this process runs now, traceable by a compiled layer; None where
    the kernels are off or could not be built."""
    return traced_op("q4_matmul", _q4_matmul_fake)

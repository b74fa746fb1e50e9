"""Matmuls against GGUF's Q8_0 on the C++ CPU kernel (`q8_matmul.cpp`): the quantization and the kernel's layout.

Q8_0 holds a weight `[N, K]` as int8 values in blocks of 32 along K with one fp16 scale a block: the
precision llama.cpp gives a model's output layer (SmolLM2's Q4_1 file keeps its tied embedding, the LM
head, in Q8_0). The kernel quantizes each row of x to Q8_0 too and sums int8 products, as llama.cpp does. It
reads the output columns in tiles of 16 (`pack_q8_0`): one 64-byte load holds 4 values of each column of a
tile, whose sums stay in separate lanes.
"""

from __future__ import annotations

import torch

from fastgen.ops.cpu_kernels.build import active_op, traced_op

BLOCK = 32
"""Values per Q8_0 block (one scale each)."""

TILE = 16
"""Output columns the kernel interleaves (the last tile padded with zero columns)."""


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[N, K]` (K a multiple of 32) as Q8_0: int8 values `[N, K]` and fp16 scales `[N, K / 32]`,
    scale = max |w| / 127 of each block and values rounded to nearest (llama.cpp's quantize_row_q8_0)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs a width that is a multiple of {BLOCK}, got {k}")
    blocks = weight.detach().float().view(n, k // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    values = torch.round(blocks * inverse.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).view(n, k)
    return values, scales.to(torch.float16)


def dequantize_q8_0(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight `[N, K]` that Q8_0 `values` and `scales` stand for."""
    n, k = values.shape
    return (values.float().view(n, k // BLOCK, BLOCK) * scales.float().unsqueeze(-1)).view(n, k)


def pack_q8_0(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 `values` `[N, K]` and `scales` `[N, K / 32]` (`quantize_q8_0`) in the kernel's layout: (packed
    `[ceil(N / 16), K * 16]` int8: tile, block, sub-block of 4 inputs, column, value; scales
    `[ceil(N / 16), K / 32, 16]` fp16), the last tile padded with zero columns."""
    n, k = values.shape
    tiles, pad = -(-n // TILE), -n % TILE
    values = torch.cat((values, values.new_zeros(pad, k))) if pad else values
    scales = torch.cat((scales, scales.new_zeros(pad, k // BLOCK))) if pad else scales
    packed = values.view(tiles, TILE, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, k * TILE)
    return packed.contiguous(), scales.view(tiles, TILE, k // BLOCK).transpose(1, 2).contiguous()


def unpack_q8_0(packed: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q8_0 values `[n, K]` and scales `[n, K / 32]` of a `pack_q8_0` layout (its inverse)."""
    tiles, width = packed.shape
    k = width // TILE
    values = packed.view(tiles, k // BLOCK, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k)
    return values[:n], scales.transpose(1, 2).reshape(tiles * TILE, k // BLOCK)[:n]


def cpu_q8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor | None:
    """fp32 `x @ W^T` `[M, n]` for `x` `[M, K]` (fp32, bf16 or fp16) and W in Q8_0 (`pack_q8_0`'s layout, `n`
    columns); None where the kernels are off (`FASTGEN_CPU_KERNELS`) or could not be built, or `x` is not on
    the CPU."""
    op = active_op("q8_matmul") if x.device.type == "cpu" else None
    if op is None:
        return None
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    op(out, x if x.stride(-1) == 1 else x.contiguous(), packed, scales)
    return out


def _q8_matmul_fake(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
    return None


def q8_matmul_op() -> torch._ops.OpOverload | None:
    """`fastgen::q8_matmul_<isa>` (out `[M, N]` fp32, written; x `[M, K]`; `pack_q8_0`'s packed and scales) of the
    variant this process runs now, traceable by a compiled layer; None where the kernels are off or could not be
    built."""
    return traced_op("q8_matmul", _q8_matmul_fake)

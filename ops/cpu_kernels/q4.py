"""int4 linears on the C++ CPU kernel (`q4_matmul.cpp`): its weight layout, and one op a compiled layer calls.

The values are fastgen's int4 (`fastgen.models.quant.quantize_int4`: w = (q - 8) * scale + zero, q in [0, 15],
one scale and zero per group of inputs). The kernel reads them row by row, 32 bytes per 64 inputs: byte j of a
64-input chunk holds input j in its low nibble and input j + 32 in its high one. It quantizes each row of x to
int8 per weight group (scale = max |x| / 127, as llama.cpp's Q8 activations) and sums integer products.
"""

from __future__ import annotations

import torch

from fastgen.ops.cpu_kernels.build import traced_op

CHUNK = 64
"""Inputs per 32 packed bytes: the kernel takes group sizes that are a multiple of this."""


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
    """The kernel's layout of int4 values `q` `[N, K]` (uint8 in [0, 15]) with their `scales` and `zeros`
    `[N, K / group]`: (packed `[N, K / 2]` uint8, scales_zeros `[N, K / group, 2]` in the scales' dtype)."""
    n, k = q.shape
    chunks = q.view(n, k // CHUNK, 2, CHUNK // 2)
    packed = (chunks[:, :, 0] | chunks[:, :, 1] << 4).reshape(n, k // 2).contiguous()
    return packed, torch.stack((scales, zeros), dim=-1).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """The uint8 values `[N, K]` of a `pack_q4` layout (its inverse)."""
    n, half = packed.shape
    chunks = packed.view(n, half // (CHUNK // 2), 1, CHUNK // 2)
    return torch.cat((chunks & 15, chunks >> 4), dim=2).reshape(n, 2 * half)


def dequantize_q4(packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight `[N, K]` a `pack_q4` layout stands for."""
    q = unpack_q4(packed).float()
    n, k = q.shape
    scales, zeros = scales_zeros.float().unbind(-1)
    return ((q.view(n, k // group_size, group_size) - 8) * scales[..., None] + zeros[..., None]).view(n, k)


def _q4_matmul_fake(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


def q4_matmul_op() -> torch._ops.OpOverload | None:
    """`fastgen::q4_matmul_<isa>` (x `[M, K]`, packed `[N, K / 2]`, scales_zeros `[N, K / group, 2]`, group)
    -> `[M, N]` in x's dtype, of the variant this process runs now, traceable by a compiled layer; None where
    the kernels are off or could not be built."""
    return traced_op("q4_matmul", _q4_matmul_fake)

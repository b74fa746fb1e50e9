"""Linear layers over weights prepacked in oneDNN's blocked layout (the CPU's fastest GEMM path).

`F.linear` on the CPU hands MKL the plain `[N, K]` weight, which it re-blocks on every call. oneDNN
takes the weight once, reordered into the blocked layout its kernels read, and then multiplies
without that copy. Measured on a 2-core AMD EPYC (AVX2, fp32, the SmolLM2-135M shapes
576x960 / 576x576 / 576x3072 / 1536x576): 55 against 29 GFLOP/s for 8 rows, 110 against 74 for 32,
126 against 100 for 128 and 130 against 110 for 512. The results differ from MKL's only by
summation order (a few 1e-6 relative in fp32).

`fastgen::packed_linear` is a custom op so `torch.compile` passes the packed weight (an opaque
oneDNN tensor, which Inductor cannot lower) straight to the kernel. Given the weight in
`fastgen.ops.gemv.gemv_weight`'s form too (bf16 tiles for fastgen's C++ kernel, or a grouped view), an
input of at most `GEMV_MAX_ROWS` rows multiplies over that instead (`gemv_linear`: faster at a few rows).
The op picks at run time, so a compiled graph with a symbolic row count serves both without a recompile.
"""

from __future__ import annotations

import torch

from fastgen.ops.gemv import GEMV_MAX_ROWS, gemv_linear

# Same registration style as the paged-attention op: `torch.library.Library` costs ~10 us per call
# against ~100 us for `torch.library.custom_op`'s Python wrapper. The Library object owns the
# registrations for the life of the module.
_LIBRARY = torch.library.Library("fastgen", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, "
                "Tensor? gemv_weight=None) -> Tensor")

PREPACK_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes oneDNN's packed linear takes."""


def prepack_available() -> bool:
    """True when this torch build has oneDNN (the packed kernels)."""
    return torch.backends.mkldnn.is_available()


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[N, K]` (CPU, fp32 or bf16) reordered into oneDNN's blocked layout: an opaque tensor
    that only `packed_linear` reads."""
    if weight.device.type != "cpu":
        raise ValueError(f"weight prepacking is for CPU tensors, got a {weight.device.type} weight")
    if weight.dtype not in PREPACK_DTYPES:
        raise ValueError(f"weight prepacking takes {', '.join(map(str, PREPACK_DTYPES))} weights, got {weight.dtype}")
    if not prepack_available():
        raise RuntimeError("weight prepacking needs a torch build with oneDNN (torch.backends.mkldnn)")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                   gemv_weight: torch.Tensor | None = None) -> torch.Tensor:
    if gemv_weight is not None and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
        return gemv_linear(x, gemv_weight, bias)
    # oneDNN wants a dense 2-d input; an empty step has nothing to multiply.
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if flat.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    out = torch.ops.mkldnn._linear_pointwise(flat, packed_weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], out_features)


def _packed_linear_fake(x, packed_weight, bias, out_features, gemv_weight=None):
    return x.new_empty(*x.shape[:-1], out_features)


_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("fastgen::packed_linear", _packed_linear_fake, lib=_LIBRARY)

packed_linear = torch.ops.fastgen.packed_linear
"""`fastgen::packed_linear(x, packed_weight, bias, out_features, gemv_weight=None)`: `x @ W.T + bias`
over the last dimension of `x`, where `packed_weight` is `pack_linear_weight(W)` and `gemv_weight`,
if given, `gemv_weight(W, threads)`."""


def apply_packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                        gemv_weight: torch.Tensor | None = None) -> torch.Tensor:
    """What model code calls: `packed_linear`'s contract. A graph being compiled records the op; an eager
    call goes straight to its implementation, skipping the dispatcher's round trip into Python (~15 us a
    call on a 2-core EPYC, paid by every linear of every layer: ~2 ms of a batch-1 decode step)."""
    if torch.compiler.is_compiling():
        return packed_linear(x, packed_weight, bias, out_features, gemv_weight)
    return _packed_linear(x, packed_weight, bias, out_features, gemv_weight)

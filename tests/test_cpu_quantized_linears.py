"""Quantized linears on fastgen's C++ CPU kernels. int4 (`q4_matmul.cpp`): the layout against its inverse,
the kernel against a float64 oracle of the same arithmetic (each ISA variant, dtypes, odd shapes, all-zero
groups), its refusals, and `QuantizedLinear` picking it (torch's int4 kernel where it cannot run). int8: the
layer in Q8_0 (`q8_matmul.cpp`, whose kernel tests/test_q8_head.py checks) against the same oracle, and
torch's int8 where the kernels are off; every way close to the dequantized weight's product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastgen.models.quant import QuantizedLinear, quantize_int4
from fastgen.ops.cpu_kernels import ENV_VAR, ISAS, kernel_op, supported_isas
from fastgen.ops.cpu_kernels.q4 import dequantize_q4, pack_q4, q4_matmul_op, unpack_q4
from fastgen.ops.cpu_kernels.q8 import BLOCK, dequantize_q8_0, q8_matmul_op, quantize_q8_0, unpack_q8_0


def _packed(n: int, k: int, group: int, dtype: torch.dtype, generator: torch.Generator):
    weight = torch.randn(n, k, generator=generator) * 0.05
    weight[n // 2, :group] = 0  # a group of zeros: scale at its floor, every value the zero point
    q, scales, zeros = quantize_int4(weight, group, dtype)
    return weight, q, *pack_q4(q, scales, zeros)


def _oracle(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """x @ W^T in float64 with each row of x quantized to int8 per group first (scale = max |x| / 127, values
    rounded to nearest even through the fp32 reciprocal): the kernel's arithmetic."""
    rows, k = x.shape
    xf = x.float().view(rows, k // group, group)
    scale = xf.abs().amax(dim=-1) / 127
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    xq = torch.round(xf * inverse[..., None]).double() * scale.double()[..., None]
    return xq.view(rows, k) @ dequantize_q4(packed, scales_zeros, group).double().t()


def test_layout_round_trips():
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 256), dtype=torch.uint8, generator=generator)
    scales, zeros = torch.randn(48, 2, generator=generator), torch.randn(48, 2, generator=generator)
    packed, scales_zeros = pack_q4(q, scales, zeros)
    assert packed.shape == (3, 2048) and scales_zeros.shape == (3, 2, 2, 16)
    assert torch.equal(unpack_q4(packed), q)
    # tile t, chunk c, sub-block b, column j, byte i: input 64c + 4b + i low, + 32 high, of column 16t + j
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 32]) << 4
    at = 1 * 512 + 2 * 64 + 5 * 4 + 3  # chunk 1, b 2, column 5, byte 3
    assert int(packed[1, at]) == int(q[21, 64 + 8 + 3]) | int(q[21, 64 + 32 + 8 + 3]) << 4
    assert scales_zeros[2, 1, 0, 7] == scales[39, 1] and scales_zeros[2, 1, 1, 7] == zeros[39, 1]
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_q4(q[:40], scales[:40], zeros[:40])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_kernel_equals_float64_oracle(isa, dtype, monkeypatch):
    """Every ISA variant this CPU runs, in each dtype, over 1..9 rows (the 4-row groups and every remainder),
    one to many 16-column tiles, group sizes 64 to 256 and zero groups in x and W."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv(ENV_VAR, isa)
    if kernel_op("q4_matmul", isa) is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    op = q4_matmul_op()
    generator = torch.Generator().manual_seed(1)
    for rows, k, n, group in ((1, 64, 48, 64), (3, 576, 304, 64), (4, 1536, 64, 128), (9, 512, 96, 256),
                              (5, 384, 16, 128), (2, 128, 3072, 64)):
        _, _, packed, scales_zeros = _packed(n, k, group, dtype, generator)
        x = (torch.randn(rows, k, generator=generator) * 3).to(dtype)
        x[0, -group:] = 0
        out = op(x, packed, scales_zeros, group)
        assert out.dtype == dtype and out.shape == (rows, n)
        want = _oracle(x, packed, scales_zeros, group)
        # fp32 sums in another order; bf16/fp16 round the result once
        rtol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(out.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())


def test_kernel_refuses_what_it_cannot_take(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    op = q4_matmul_op()
    if op is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    _, _, packed, scales_zeros = _packed(16, 128, 64, torch.float32, torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(torch.randn(1, 64), packed, scales_zeros, 64)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(torch.randn(1, 128), packed, scales_zeros, 32)  # a group of 32 is not whole chunks
    with pytest.raises(RuntimeError, match="scales_zeros of x's dtype"):
        op(torch.randn(1, 128), packed, scales_zeros.bfloat16(), 64)
    monkeypatch.setenv(ENV_VAR, "off")
    assert q4_matmul_op() is None


def _linear(weight: torch.Tensor, group: int, dtype: torch.dtype, mode: str = "int4") -> QuantizedLinear:
    with torch.device("meta"):
        layer = QuantizedLinear(nn.Linear(weight.shape[1], weight.shape[0], bias=False), mode, dtype, group)
    half = weight.shape[0] // 2  # loaded in two pieces, as the loader hands a merged layer its tensors
    layer.load_rows(0, weight[:half], torch.device("cpu"))
    layer.load_rows(half, weight[half:], torch.device("cpu"))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_takes_the_kernel_where_it_runs(dtype, monkeypatch):
    """A CPU int4 linear packs for the kernel where it can run (groups of whole 64-input chunks), else for
    torch's int4 kernel (group 32, or the kernels off); every way gives the dequantized weight's product
    within the int8 rounding of the activations."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 256, generator=generator) * 0.05
    x = torch.randn(5, 256, generator=generator).to(dtype)
    monkeypatch.delenv(ENV_VAR, raising=False)
    expected_kernel = "int4_q4" if q4_matmul_op() is not None else "int4_cpu"
    cases = [(64, None, expected_kernel), (32, None, "int4_cpu"), (64, "off", "int4_cpu")]
    for group, env, kernel in cases:
        if env is None:
            monkeypatch.delenv(ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(ENV_VAR, env)
        layer = _linear(weight, group, dtype)
        assert layer.kernel == kernel, (group, env)
        q, scales, zeros = quantize_int4(weight, group, dtype)
        dequantized = ((q.float() - 8).view(96, -1, group) * scales.float()[..., None]
                       + zeros.float()[..., None]).view(96, 256)
        want = x.double() @ dequantized.double().t()
        out = layer(x)
        assert out.dtype == dtype and out.shape == (5, 96)
        got = out.double()
        # int8 activations lose ~1/254 of each group's largest |x|; bf16 adds its own rounding
        tol = (1e-2 if kernel == "int4_q4" else 1e-4) + (1e-2 if dtype == torch.bfloat16 else 0)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_linear_holds_q8_0_where_the_kernel_runs(dtype, monkeypatch):
    """A CPU int8 linear is Q8_0 (a scale per 32 inputs) on the kernel, equal to the float64 oracle of x
    quantized to Q8_0 times the Q8_0 weight; with the kernels off it is torch's per-channel int8."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(80, 96, generator=generator) * torch.rand(80, 1, generator=generator)
    weight[7] = 0  # an all-zero row: every block's scale 0
    x = torch.randn(6, 96, generator=generator).to(dtype)
    monkeypatch.delenv(ENV_VAR, raising=False)
    if q8_matmul_op() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    layer = _linear(weight, 32, dtype, "int8")
    assert layer.kernel == "int8_q8_0" and layer.scales.shape == (5, 96 // BLOCK, 16)  # 16-column tiles
    values, scales = quantize_q8_0(weight)
    held = unpack_q8_0(layer.qweight, layer.scales, 80)
    assert torch.equal(held[0], values) and torch.equal(held[1], scales)
    x_values, x_scales = quantize_q8_0(x.float())
    x_q = (x_values.double().view(6, -1, BLOCK) * x_scales.double().unsqueeze(-1)).view(6, 96)
    want = x_q @ dequantize_q8_0(values, scales).double().t()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (6, 80)
    rtol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())
    monkeypatch.setenv(ENV_VAR, "off")
    assert _linear(weight, 32, dtype, "int8").kernel == "int8"

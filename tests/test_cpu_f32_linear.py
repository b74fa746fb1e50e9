"""fp32 linears of a few rows on fastgen's C++ CPU kernel (`f32_matmul.cpp`): the tile layout against its inverse,
the kernel against a float64 oracle (each ISA variant; 1 to 9 rows, one to many tiles, odd widths), its refusals,
the packed layers keeping tiles for their few-row path and a grouped view where the kernels are off, the
decode-layer op over fp32-tiled layers against the layer's forward, and the plan's choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastgen.models.loader import load_model
from fastgen.models.packed import PackedLinear, prepack_linears
from fastgen.ops.cpu_kernels import ENV_VAR, ISAS, kernel_op, supported_isas
from fastgen.ops.cpu_kernels.decode_layer import F32_KIND
from fastgen.ops.cpu_kernels.f32 import f32_matmul_op, pack_f32, unpack_f32
from fastgen.ops.gemv import GEMV_MAX_ROWS, gemv_linear
from fastgen.ops.packed_linear import prepack_available
from fastgen.planning.choices.linears import gemv_copy_bytes
from fastgen.planning.plan import format_bytes
from fastgen.planning.policy import make_plan
from test_policy import BF16_CPU, TINYLLAMA_1B, _cpu, _facts


def test_layout_round_trips_and_refuses_what_it_cannot_hold():
    weight = torch.randn(48, 71)
    packed = pack_f32(weight)
    assert packed.shape == (3, 71 * 16) and torch.equal(unpack_f32(packed), weight)
    # tile 1, input 9, column 5: input 9 of column 21
    assert packed[1, 9 * 16 + 5] == weight[21, 9]
    for bad in (torch.randn(40, 64), torch.randn(48, 64).bfloat16(), torch.randn(3, 16, 4)):
        with pytest.raises(ValueError, match="the kernel"):
            pack_f32(bad)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_equals_float64_oracle(isa, monkeypatch):
    if isa not in supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv(ENV_VAR, isa)
    if kernel_op("f32_matmul", isa) is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    op = f32_matmul_op()
    generator = torch.Generator().manual_seed(0)
    for rows, k, n in ((1, 64, 16), (3, 576, 960), (4, 71, 48), (9, 1536, 64), (2, 1, 3072), (5, 33, 16)):
        weight = torch.randn(n, k, generator=generator)
        x = torch.randn(rows, k, generator=generator)
        out = op(x, pack_f32(weight))
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        want = x.double() @ weight.double().t()
        # fp32 products and sums in another order than the oracle's
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6 * k ** 0.5 * want.abs().max().item())
    # a strided row view of x (rows of a wider tensor) is read in place
    wide = torch.randn(3, 128, generator=generator)
    weight = torch.randn(32, 64, generator=generator)
    torch.testing.assert_close(op(wide[:, :64], pack_f32(weight)), wide[:, :64] @ weight.t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(torch.randn(1, 32), pack_f32(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="must be fp32"):
        op(torch.randn(1, 64).bfloat16(), pack_f32(torch.randn(16, 64)))


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
def test_packed_f32_layers_keep_tiles_where_the_kernel_runs(tiny_checkpoints, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    if f32_matmul_op() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    path = tiny_checkpoints["llama"]
    plain = load_model(path, dtype=torch.float32, progress=False).model
    model = load_model(path, dtype=torch.float32, progress=False).model
    prepack_linears(model, gemv=True, threads=2)
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, PackedLinear) and gate_up.gemv_weight.dim() == 2  # tiles
    assert model.lm_head.gemv_weight.dim() == 2
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 3):
        hidden = torch.randn(rows, plain.config.hidden_size)
        torch.testing.assert_close(gate_up(hidden), plain.model.layers[0].mlp.gate_up_proj(hidden), rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-5, atol=1e-5)
    tiles = gate_up.gemv_weight
    torch.testing.assert_close(gemv_linear(hidden[:2], tiles), hidden[:2] @ unpack_f32(tiles).t(), rtol=1e-5,
                               atol=1e-5)
    monkeypatch.setenv(ENV_VAR, "off")
    off = load_model(path, dtype=torch.float32, progress=False).model
    prepack_linears(off, gemv=True, threads=2)
    assert off.model.layers[0].mlp.gate_up_proj.gemv_weight.dim() == 3  # grouped view over the cores
    assert isinstance(off.model.layers[0].decode_layer_weights(), str)


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
def test_decode_layer_op_over_f32_tiles(tiny_checkpoints, monkeypatch):
    """The decode-layer op with its linears on the fp32 tiles equals the layer's forward to within fp32 sums (at
    most GEMV_MAX_ROWS rows: the layer's forward then multiplies over the same tiles)."""
    from test_decode_layer_kernel import _step

    from fastgen.executor.decode_layers import step_of

    monkeypatch.delenv(ENV_VAR, raising=False)
    if f32_matmul_op() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    model = load_model(tiny_checkpoints["llama"], dtype=torch.float32, progress=False).model
    prepack_linears(model, gemv=True, threads=2)
    config = model.config
    generator = torch.Generator().manual_seed(3)
    chunks = [(9, 1), (0, 2), (4, 1)]
    hidden = torch.randn(4, config.hidden_size, generator=generator)
    for layer in model.layers:
        weights = layer.decode_layer_weights()
        assert weights.kinds == (F32_KIND,) * 4 and weights.max_rows == GEMV_MAX_ROWS
        metadata, positions, caches = _step(chunks, torch.float32, config.num_kv_heads, config.head_dim, generator)
        got_caches = [cache.clone() for cache in caches]
        got = step_of(metadata, hidden).run(weights, hidden, positions, got_caches, metadata.slot_mapping)
        want = type(layer).forward(layer, positions, hidden, metadata, caches)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        for got_cache, cache in zip(got_caches, caches):
            torch.testing.assert_close(got_cache, cache, rtol=1e-5, atol=1e-5, equal_nan=True)
        hidden = want


def test_plan_keeps_fp32_tiles_where_the_kernels_build(tmp_path):
    import transformers

    # 4 of TinyLlama's layers: their fp32 copies stay under the 10% of RAM the plan spends on them
    model = _facts(tmp_path, transformers.LlamaConfig(**{**TINYLLAMA_1B, "num_hidden_layers": 4}))
    with_compiler = dataclasses.replace(_cpu(flags=BF16_CPU), cpp_compiler="c++")
    plan = make_plan(model, with_compiler, dtype="float32")
    assert plan.weight_prepack and plan.gemv_weights and "C++ kernel layout" in plan.reasons["gemv_weights"]
    assert plan.decode_layer_kernel
    without = make_plan(model, dataclasses.replace(with_compiler, cpp_compiler=""), dtype="float32")
    assert without.gemv_weights and "C++ kernel layout" not in without.reasons["gemv_weights"]
    assert not without.decode_layer_kernel
    # the tiles are copies of the layers' weights and of the (untied) head's: the reason counts them all
    tiles = format_bytes(gemv_copy_bytes(model, torch.float32, tiles=True))
    assert f"({tiles} more;" in plan.reasons["gemv_weights"]
    assert gemv_copy_bytes(model, torch.float32, tiles=True) == model.layer_weight_bytes(torch.float32) + \
        model.head_weight_bytes(torch.float32)

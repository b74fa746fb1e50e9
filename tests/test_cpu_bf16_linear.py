"""bf16 linears of a few rows on fastgen's C++ CPU kernel (`bf16_matmul.cpp`): the tile layout against its inverse,
the kernel against a float64 oracle (each ISA variant: pair dots where AVX512-BF16 runs, widened FMAs elsewhere; 1
to 9 rows, one to many tiles, odd widths), its refusals, the packed layers keeping tiles for their few-row path and
a grouped view where the kernels are off, the decode-layer op over tiled layers, and the plan's choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastgen.models.loader import load_model
from fastgen.models.packed import PackedLinear, prepack_linears
from fastgen.ops.cpu_kernels import ENV_VAR, ISAS, kernel_op, supported_isas
from fastgen.ops.cpu_kernels.bf16 import bf16_matmul_op, pack_bf16, unpack_bf16
from fastgen.ops.cpu_kernels.decode_layer import BF16_KIND
from fastgen.ops.gemv import GEMV_MAX_ROWS, gemv_linear
from fastgen.ops.packed_linear import prepack_available
from fastgen.planning.policy import make_plan
from test_policy import BF16_CPU, TINYLLAMA_1B, _cpu, _facts


def test_layout_round_trips_and_refuses_what_it_cannot_hold():
    weight = torch.randn(48, 70).bfloat16()
    packed = pack_bf16(weight)
    assert packed.shape == (3, 70 * 16) and torch.equal(unpack_bf16(packed), weight)
    # tile 1, pair 4, column 5: inputs 8 and 9 of column 21
    at = (4 * 16 + 5) * 2
    assert packed[1, at] == weight[21, 8] and packed[1, at + 1] == weight[21, 9]
    for bad in (torch.randn(40, 64).bfloat16(), torch.randn(48, 63).bfloat16(), torch.randn(48, 64)):
        with pytest.raises(ValueError, match="the kernel"):
            pack_bf16(bad)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_equals_float64_oracle(isa, monkeypatch):
    if isa not in supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv(ENV_VAR, isa)
    if kernel_op("bf16_matmul", isa) is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    op = bf16_matmul_op()
    generator = torch.Generator().manual_seed(0)
    for rows, k, n in ((1, 64, 16), (3, 576, 960), (4, 70, 48), (9, 1536, 64), (2, 2, 3072)):
        weight = torch.randn(n, k, generator=generator).bfloat16()
        x = torch.randn(rows, k, generator=generator).bfloat16()
        out = op(x, pack_bf16(weight))
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        want = x.double() @ weight.double().t()
        # exact products, fp32 sums in another order, one rounding to bf16
        torch.testing.assert_close(out.double(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item())
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(torch.randn(1, 32).bfloat16(), pack_bf16(torch.randn(16, 64).bfloat16()))
    with pytest.raises(RuntimeError, match="must be bf16"):
        op(torch.randn(1, 64), pack_bf16(torch.randn(16, 64).bfloat16()))


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
def test_packed_bf16_layers_keep_tiles_where_the_kernel_runs(tiny_checkpoints, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    if bf16_matmul_op() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    path = tiny_checkpoints["llama"]
    plain = load_model(path, dtype=torch.bfloat16, progress=False).model
    model = load_model(path, dtype=torch.bfloat16, progress=False).model
    prepack_linears(model, gemv=True, threads=2)
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, PackedLinear) and gate_up.gemv_weight.dim() == 2  # tiles
    assert model.lm_head.gemv_weight.dim() == 2
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 3):
        hidden = torch.randn(rows, plain.config.hidden_size).bfloat16()
        want = plain.model.layers[0].mlp.gate_up_proj(hidden).float()
        torch.testing.assert_close(gate_up(hidden).float(), want, rtol=1.6e-2, atol=2e-2 * want.abs().max().item())
        logits = plain.compute_logits(hidden)
        torch.testing.assert_close(model.compute_logits(hidden), logits, rtol=1.6e-2,
                                   atol=2e-2 * logits.abs().max().item())
    tiles = gate_up.gemv_weight
    torch.testing.assert_close(gemv_linear(hidden[:2], tiles), hidden[:2] @ unpack_bf16(tiles).t(), rtol=1.6e-2,
                               atol=1e-1)
    monkeypatch.setenv(ENV_VAR, "off")
    off = load_model(path, dtype=torch.bfloat16, progress=False).model
    prepack_linears(off, gemv=True, threads=2)
    assert off.model.layers[0].mlp.gate_up_proj.gemv_weight.dim() == 3  # grouped view over the cores
    assert isinstance(off.model.layers[0].decode_layer_weights(), str)


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
def test_decode_layer_op_over_bf16_tiles(tiny_checkpoints, monkeypatch):
    """The decode-layer op with its linears on the bf16 tiles equals the layer's forward over oneDNN's packed
    weights (at most GEMV_MAX_ROWS rows: the layer's forward then multiplies over the same tiles)."""
    from test_decode_layer_kernel import _step

    monkeypatch.delenv(ENV_VAR, raising=False)
    if bf16_matmul_op() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    model = load_model(tiny_checkpoints["llama"], dtype=torch.bfloat16, progress=False).model
    prepack_linears(model, gemv=True, threads=2)
    config = model.config
    generator = torch.Generator().manual_seed(3)
    chunks = [(9, 1), (0, 2), (4, 1)]
    hidden = torch.randn(4, config.hidden_size, generator=generator).bfloat16()
    from fastgen.executor.decode_layers import step_of

    for layer in model.layers:
        weights = layer.decode_layer_weights()
        assert weights.kinds == (BF16_KIND,) * 4 and weights.max_rows == GEMV_MAX_ROWS
        metadata, positions, caches = _step(chunks, torch.bfloat16, config.num_kv_heads, config.head_dim, generator)
        got_caches = [cache.clone() for cache in caches]
        got = step_of(metadata, hidden).run(weights, hidden, positions, got_caches, metadata.slot_mapping)
        want = type(layer).forward(layer, positions, hidden, metadata, caches)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * want.abs().max().item())
        hidden = want


def test_plan_keeps_tiles_for_bf16_where_the_kernels_build(tmp_path):
    import transformers

    model = _facts(tmp_path, transformers.LlamaConfig(**TINYLLAMA_1B))
    with_compiler = dataclasses.replace(_cpu(flags=BF16_CPU), cpp_compiler="c++")
    plan = make_plan(model, with_compiler, dtype="bfloat16")
    assert plan.weight_prepack and plan.gemv_weights and "C++ kernel layout" in plan.reasons["gemv_weights"]
    assert plan.decode_layer_kernel
    # the tiles of the layers and of the (tied or not) head are counted against the KV cache's room
    assert (make_plan(model, with_compiler, dtype="bfloat16", gemv_weights=False).kv_cache_memory
            > plan.kv_cache_memory)

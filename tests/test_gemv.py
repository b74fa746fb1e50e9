"""The few-row linear (`fastgen.ops.gemv`): the op against F.linear, the packed layers taking it only
for a few rows, the engine with it against HF, and the plan's choice (on while the plain copies are
cheap, off past its RAM share, a clear error without prepacking)."""

from __future__ import annotations

import pytest
import torch
import transformers

import fastgen
from fastgen.models.loader import load_model
from fastgen.models.packed import PackedLinear, PackedLMHead, prepack_linears
from fastgen.ops.cpu_kernels import ENV_VAR
from fastgen.ops.gemv import GEMV_MAX_ROWS, gemv_groups, gemv_linear, group_weight
from fastgen.ops.packed_linear import prepack_available
from fastgen.planning.policy import make_plan
from kit import hf_greedy
from fastgen.planning.hardware import Hardware
from test_policy import GIB, TINYLLAMA_1B, _cpu, _facts

GREEDY = dict(do_sample=False, ignore_eos=True)


@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("rows", [0, 1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_op_equals_f_linear(groups, rows, bias):
    torch.manual_seed(rows + 10 * groups)
    weight, x = torch.randn(96, 80), torch.randn(2, rows, 80)
    b = torch.randn(96) if bias else None
    got = gemv_linear(x, group_weight(weight, groups), b)
    assert got.shape == (2, rows, 96) and got.is_contiguous() and (rows == 0 or got.stride(-1) == 1)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2])
def test_op_equals_f_linear_in_half_precision(dtype, rows):
    # One row takes torch.mv, two the grouped bmm: both sum in fp32 and round once, as F.linear.
    torch.manual_seed(rows)
    weight, x, b = torch.randn(96, 80).to(dtype), torch.randn(rows, 80).to(dtype), torch.randn(96).to(dtype)
    got = gemv_linear(x, group_weight(weight, 2), b)
    assert got.shape == (rows, 96) and got.dtype == dtype and got.is_contiguous()
    reference = (x.double() @ weight.double().t() + b.double()).to(dtype)
    torch.testing.assert_close(got, reference, rtol=1.6e-2, atol=1e-2)


def test_groups_divide_the_output_rows():
    assert gemv_groups(49152, 2) == 2
    assert gemv_groups(960, 16) == 16
    assert gemv_groups(90, 4) == 3  # the largest divisor up to the thread count
    assert gemv_groups(7, 4) == 1
    assert gemv_groups(3, 8) == 3
    assert group_weight(torch.ones(6, 4), 3).shape == (3, 2, 4)
    with pytest.raises(ValueError, match="cannot split a weight of shape"):
        group_weight(torch.ones(7, 4), 2)
    with pytest.raises(ValueError, match="positive"):
        gemv_groups(8, 0)


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
def test_packed_layers_take_the_gemv_for_a_few_rows_only(tiny_checkpoints, monkeypatch):
    """fp32 weights grouped over the cores, as where fastgen's C++ kernels are off (where they build, fp32 weights
    take their tiles: tests/test_cpu_f32_linear.py)."""
    import fastgen.ops.packed_linear as packed_module

    monkeypatch.setenv(ENV_VAR, "off")
    path = tiny_checkpoints["llama"]  # an untied head: kept only with gemv=True
    plain = load_model(path, dtype=torch.float32, progress=False).model
    model = load_model(path, dtype=torch.float32, progress=False).model
    prepack_linears(model, gemv=True, threads=2)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, PackedLinear) and qkv.gemv_weight.shape[0] == 2
    assert isinstance(model.lm_head, PackedLMHead) and model.lm_head.gemv_weight is not None
    calls = []
    monkeypatch.setattr(packed_module, "gemv_linear", lambda *a: calls.append(a) or gemv_linear(*a))
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 16):
        calls.clear()
        hidden = torch.randn(rows, plain.config.hidden_size)
        torch.testing.assert_close(qkv(hidden), plain.model.layers[0].self_attn.qkv_proj(hidden), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-4, atol=1e-4)
        assert len(calls) == (2 if rows <= GEMV_MAX_ROWS else 0), rows


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
def test_gemv_weights_only_when_asked_and_a_tied_head_is_a_view(tiny_checkpoints, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "off")  # the grouped view (the C++ kernels' tiles are copies)
    tied = load_model(tiny_checkpoints["qwen2"], dtype=torch.float32, progress=False).model
    assert tied.config.tie_word_embeddings
    prepack_linears(tied, gemv=True, threads=2)
    # The embedding's own weight, viewed: no copy.
    assert tied.lm_head.gemv_weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    for family in ("qwen2", "llama"):  # tied and untied heads
        model = load_model(tiny_checkpoints[family], dtype=torch.float32, progress=False).model
        prepack_linears(model, gemv=False, threads=2)
        assert model.model.layers[0].mlp.gate_up_proj.gemv_weight is None and model.lm_head.gemv_weight is None
    assert model.lm_head.weight is None  # the untied head's plain weight is dropped


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied head; tied head and biased q/k/v
@pytest.mark.parametrize("kernels", ["default", "off"])  # fp32 tiles and the decode-layer op; the grouped bmm
def test_engine_with_gemv_weights_equals_hf(family, kernels, tiny_checkpoints, monkeypatch):
    if kernels == "off":
        monkeypatch.setenv(ENV_VAR, "off")
    path = tiny_checkpoints[family]
    # Mixed lengths, one prompt alone (batch-1 decode, all GEMVs) then seven together (GEMMs and GEMVs).
    prompts = [[(5 * i + 11 * j) % 300 + 7 for j in range(n)] for i, n in enumerate([9, 1, 4, 13, 2, 30, 6, 17])]
    expected = [tokens for tokens, _ in hf_greedy(path, prompts, 8)]
    with fastgen.pipeline(path, dtype="float32", weight_prepack=True, gemv_weights=True, token_budget=32,
                          max_seqs=8, progress=False) as pipe:
        assert pipe.engine.plan.gemv_weights is True
        assert kernels == "default" or not pipe.engine.plan.decode_layer_kernel
        got = [pipe([prompts[0]], max_new_tokens=8, **GREEDY)[0].token_ids]
        got += [r.token_ids for r in pipe(prompts[1:], max_new_tokens=8, **GREEDY)]
    assert got == expected


def test_plan_keeps_plain_copies_while_cheap(tmp_path):
    small = _facts(tmp_path, transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
                   "small")
    avx2 = _cpu(flags=frozenset({"avx2"}))
    on = make_plan(small, avx2, dtype="float32")
    assert on.weight_prepack and on.gemv_weights and "more" in on.reasons["gemv_weights"]
    little_ram = Hardware("cpu", 2, frozenset({"avx2"}), "AVX2", GIB)  # so the KV cache takes a share of what is left
    # The copies are counted against the KV cache's room.
    assert (make_plan(small, little_ram, dtype="float32", gemv_weights=False).kv_cache_memory
            > make_plan(small, little_ram, dtype="float32").kv_cache_memory)
    big = _facts(tmp_path, transformers.LlamaConfig(**TINYLLAMA_1B), "big")  # 3.8 GiB of fp32 layers > 10% of 24 GiB
    declined = make_plan(big, avx2, dtype="float32")
    assert declined.weight_prepack and not declined.gemv_weights
    assert "over 10% of the" in declined.reasons["gemv_weights"]
    forced = make_plan(big, avx2, dtype="float32", gemv_weights=True)
    assert forced.gemv_weights and "more" in forced.reasons["gemv_weights"]
    assert not make_plan(small, avx2, dtype="float32", weight_prepack=False).gemv_weights
    with pytest.raises(ValueError, match="gemv_weights=True needs weight_prepack"):
        make_plan(small, avx2, dtype="float32", weight_prepack=False, gemv_weights=True)
    with pytest.raises(TypeError, match="gemv_weights must be a bool"):
        make_plan(small, avx2, gemv_weights="yes")

"""oneDNN weight prepacking: the op against F.linear, the packed model against the plain one and HF,
and the plan's choice (on for CPU fp32, off where it cannot apply, a clear error when forced there)."""

from __future__ import annotations

import pytest
import transformers
import torch

import fastgen
from fastgen.models.loader import load_model
from fastgen.models.packed import PackedLinear, PackedLMHead, prepack_linears
from fastgen.ops.packed_linear import pack_linear_weight, packed_linear, prepack_available
from fastgen.planning.policy import make_plan
from kit import hf_greedy
from fastgen.planning.hardware import Hardware
from test_policy import BF16_CPU, GIB, H100, TINYLLAMA_1B, _cpu, _facts, _gpus

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")

GREEDY = dict(do_sample=False, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 400 + 5 for j in range(n)] for i, n in enumerate([1, 3, 8, 21, 40])]


@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_op_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 80), torch.randn(2, rows, 80)
    b = torch.randn(96) if bias else None
    got = packed_linear(x, pack_linear_weight(weight), b, 96)
    assert got.shape == (2, rows, 96)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="oneDNN packs bf16 only with AVX512-BF16")
def test_op_in_bf16_equals_f_linear_to_bf16_rounding():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 48).bfloat16(), torch.randn(5, 48).bfloat16()
    got = packed_linear(x, pack_linear_weight(weight), None, 64).float()
    torch.testing.assert_close(got, x.float() @ weight.float().T, rtol=2e-2, atol=5e-2)


def test_packing_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="fp32 or bf16|torch.float32"):
        pack_linear_weight(torch.ones(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="CPU tensors"):
        pack_linear_weight(torch.ones(4, 4, device="meta"))


def test_packed_model_equals_the_plain_model(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    plain = load_model(path, dtype=torch.float32, progress=False).model
    packed = load_model(path, dtype=torch.float32, progress=False).model
    names = prepack_linears(packed)
    assert "model.layers.0.self_attn.qkv_proj" in names and "model.layers.1.mlp.down_proj" in names
    assert isinstance(packed.model.layers[0].mlp.gate_up_proj, PackedLinear)
    assert isinstance(packed.lm_head, PackedLMHead)
    # The embedding keeps its plain weight (a lookup cannot read the packed layout).
    assert packed.model.embed_tokens.weight.layout == torch.strided
    hidden = torch.randn(6, plain.config.hidden_size)
    layer_plain, layer_packed = plain.model.layers[0].mlp, packed.model.layers[0].mlp
    torch.testing.assert_close(layer_packed(hidden), layer_plain(hidden), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prepack", [False, True])
def test_engine_greedy_equals_hf_either_way(prepack, tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    expected = [tokens for tokens, _ in hf_greedy(path, PROMPTS, 8)]
    with fastgen.pipeline(path, dtype="float32", weight_prepack=prepack, token_budget=16, max_seqs=4,
                          progress=False) as pipe:
        assert pipe.engine.plan.weight_prepack is prepack
        packed = any(isinstance(m, PackedLinear) for m in pipe.engine.runner.model.modules())
        assert packed is prepack
        got = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=8, **GREEDY)]
    assert got == expected


def test_compiled_packed_layers_share_one_graph_and_equal_hf(tiny_checkpoints):
    from torch._dynamo.utils import counters

    path = tiny_checkpoints["llama"]
    expected = [tokens for tokens, _ in hf_greedy(path, PROMPTS, 6)]
    with fastgen.pipeline(path, dtype="float32", weight_prepack=True, compile="default", token_budget=16,
                          progress=False) as pipe:
        graphs = counters["stats"]["unique_graphs"]
        got = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=6, **GREEDY)]
        assert counters["stats"]["unique_graphs"] == graphs, "serving recompiled after warm-up"
    assert got == expected


def test_plan_prepacks_cpu_fp32_and_says_why_not_elsewhere(tmp_path):
    model = _facts(tmp_path, transformers.LlamaConfig(**TINYLLAMA_1B))
    avx2 = _cpu(flags=frozenset({"avx2"}))
    plan = make_plan(model, avx2, dtype="float32")
    assert plan.weight_prepack is True and "oneDNN" in plan.reasons["weight_prepack"]
    off = make_plan(model, avx2, dtype="bfloat16")
    assert off.weight_prepack is False and "emulates bf16" in off.reasons["weight_prepack"]
    native = make_plan(model, _cpu(flags=BF16_CPU), dtype="bfloat16")
    assert native.weight_prepack is True
    # The packed kernel's bf16 dot products beat the plain-weight GEMV at every row count there.
    assert native.gemv_weights is False and "bf16 dot products" in native.reasons["gemv_weights"]
    assert "bf16" not in make_plan(model, _cpu(flags=BF16_CPU), dtype="float32").reasons["gemv_weights"]
    quantized = make_plan(model, avx2, dtype="float32", quantization="int8")
    assert quantized.weight_prepack is False and "int8" in quantized.reasons["weight_prepack"]
    gpu = make_plan(model, _gpus(H100))
    assert gpu.weight_prepack is False and "CPU kernel" in gpu.reasons["weight_prepack"]
    with pytest.raises(ValueError, match="weight_prepack=True cannot apply: the int4"):
        make_plan(model, avx2, dtype="float32", quantization="int4", weight_prepack=True)
    with pytest.raises(ValueError, match="cannot apply: oneDNN packs bf16 weights only"):
        make_plan(model, avx2, dtype="bfloat16", weight_prepack=True)
    with pytest.raises(ValueError, match="weight_prepack=True cannot apply: oneDNN's packed linear is a CPU kernel"):
        make_plan(model, _gpus(H100), weight_prepack=True)
    with pytest.raises(TypeError, match="weight_prepack must be a bool"):
        make_plan(model, avx2, weight_prepack="yes")


def test_tied_head_copy_is_counted_in_the_memory_plan(tmp_path):
    import transformers

    tied = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                                    tie_word_embeddings=True)
    model = _facts(tmp_path, tied, "tied")
    small = Hardware("cpu", 2, frozenset({"avx2"}), "AVX2", GIB)  # so the KV cache takes a share of what is left
    with_copy = make_plan(model, small, dtype="float32")
    without = make_plan(model, small, dtype="float32", weight_prepack=False)
    assert "62.5 MiB more" in with_copy.reasons["weight_prepack"]
    assert with_copy.kv_cache_memory < without.kv_cache_memory

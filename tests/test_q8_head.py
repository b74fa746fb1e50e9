"""The Q8_0 LM head (`lm_head_quantization="q8_0"`): the layout against the `gguf` package's own Q8_0
quantizer, the C++ kernel against a float64 oracle of the same arithmetic (each ISA variant, dtypes, odd
shapes, all-zero blocks), the head inside an engine (tied and untied, one rank and TP=2), and the plan."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from safetensors.torch import load_file

import fastgen
from fastgen.models.q8_head import Q8_MAX_ROWS, Q8LMHead
from fastgen.ops.cpu_kernels import ENV_VAR, ISAS, kernel_op, supported_isas
from fastgen.ops.cpu_kernels.q8 import BLOCK, cpu_q8_matmul, dequantize_q8_0, pack_q8_0, quantize_q8_0, unpack_q8_0
from fastgen.planning.hardware import GPUInfo, Hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.policy import make_plan

GIB = 1 << 30
SMALL = dict(num_kv_blocks=32, block_size=4, token_budget=32, max_seqs=8, progress=False)


def _oracle(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ W^T in float64 with x's rows quantized to Q8_0 first: the arithmetic llama.cpp does for a Q8_0 weight."""
    x_values, x_scales = quantize_q8_0(x.float())
    x_q = x_values.double().view(x.shape[0], -1, BLOCK) * x_scales.float().double().unsqueeze(-1)
    w = values.double().view(values.shape[0], -1, BLOCK) * scales.double().unsqueeze(-1)
    return x_q.view(x.shape[0], -1) @ w.view(values.shape[0], -1).t()


def test_layout_equals_the_gguf_packages_q8_0():
    """Values and scales byte for byte as `gguf.quants.quantize(..., Q8_0)` writes them (2-byte scale, 32 int8)."""
    weight = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    weight[2, 32:64] = 0  # an all-zero block: scale 0, values 0
    values, scales = quantize_q8_0(weight)
    raw = quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(5, 3, 2 + BLOCK)
    assert np.array_equal(scales.numpy(), raw[:, :, :2].copy().view(np.float16)[..., 0])
    assert np.array_equal(values.view(5, 3, BLOCK).numpy(), raw[:, :, 2:].copy().view(np.int8))
    torch.testing.assert_close(dequantize_q8_0(values, scales), weight, atol=weight.abs().max().item() / 254 + 1e-3,
                               rtol=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.zeros(2, 40))


def test_kernel_layout_round_trips():
    """`pack_q8_0`: 16-column tiles (the last padded with zeros), 4 values of each column per 64 bytes."""
    values, scales = quantize_q8_0(torch.randn(37, 64, generator=torch.Generator().manual_seed(5)))
    packed, tile_scales = pack_q8_0(values, scales)
    assert packed.shape == (3, 64 * 16) and tile_scales.shape == (3, 2, 16)
    # tile 1, block 1, sub-block 2, column 5, value 3: input 32 + 8 + 3 of column 21
    assert packed[1, 512 + 2 * 64 + 5 * 4 + 3] == values[21, 43] and tile_scales[1, 1, 5] == scales[21, 1]
    assert not packed[2, :].view(2, 8, 16, 4)[:, :, 5:].any()  # padding columns 37..47
    got_values, got_scales = unpack_q8_0(packed, tile_scales, 37)
    assert torch.equal(got_values, values) and torch.equal(got_scales, scales)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_kernel_equals_float64_oracle(isa, dtype, monkeypatch):
    """Every ISA variant this CPU runs, in each activation dtype, over 1..9 rows (the 4-row groups and every
    remainder), widths of 1 to 18 blocks, an odd vocabulary and zero blocks in x and W."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv(ENV_VAR, isa)
    if kernel_op("q8_matmul", isa) is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    generator = torch.Generator().manual_seed(1)
    for rows, k, n in ((1, 32, 37), (3, 96, 301), (4, 576, 64), (9, 160, 513)):
        weight = torch.randn(n, k, generator=generator) * 0.05
        weight[n // 2, :BLOCK] = 0
        values, scales = quantize_q8_0(weight)
        x = (torch.randn(rows, k, generator=generator) * 3).to(dtype)
        x[0, -BLOCK:] = 0
        out = cpu_q8_matmul(x, *pack_q8_0(values, scales), n)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        want = _oracle(x, values, scales)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
    strided = x.t().contiguous().t()  # columns not contiguous: copied first
    torch.testing.assert_close(cpu_q8_matmul(strided, *pack_q8_0(values, scales), n), out)


def test_kernel_refuses_what_it_cannot_take(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    values, scales = pack_q8_0(*quantize_q8_0(torch.randn(8, 64)))
    if cpu_q8_matmul(torch.randn(1, 64), values, scales, 8) is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_q8_matmul(torch.randn(1, 32), values, scales, 8)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_q8_matmul(torch.randn(1, 64), values, scales, 17)  # more columns than the tiles hold
    with pytest.raises(RuntimeError, match="packed int8 and scales float16"):
        cpu_q8_matmul(torch.randn(1, 64), values, scales.float(), 8)
    monkeypatch.setenv(ENV_VAR, "off")
    assert cpu_q8_matmul(torch.randn(1, 64), values, scales, 8) is None


def _hidden_rows(pipe: fastgen.Pipeline, prompt: list[int]) -> torch.Tensor:
    """The final hidden states the engine's model gives `prompt` (one sequence, no KV kept)."""
    runner = pipe.engine.runner
    captured = []
    handle = runner.model.lm_head.register_forward_pre_hook(lambda module, args: captured.append(args[0].clone()))
    try:
        pipe([prompt], max_new_tokens=1, do_sample=False)
    finally:
        handle.remove()
    return captured[0]


@pytest.mark.parametrize("model_type,tp", [("qwen2", 1), ("llama", 1), ("llama", 2)],
                         ids=["tied", "untied", "untied-tp2"])
def test_engine_head_equals_the_oracle_over_the_checkpoints_head(model_type, tp, tiny_checkpoints):
    """The engine's head holds the checkpoint's head weight in Q8_0 beside the plain weight (a tied head's is
    the embedding's), its logits are the oracle's over that weight up to Q8_MAX_ROWS rows and the plain
    weight's above, and greedy decoding runs on them."""
    path = tiny_checkpoints[model_type]
    pipe = fastgen.pipeline(path, **SMALL, dtype="float32", lm_head_quantization="q8_0", tensor_parallel=tp)
    if tp == 1:
        head = pipe.engine.runner.model.lm_head
        if not isinstance(head, Q8LMHead):
            pytest.skip("the C++ CPU kernels cannot be built here (the head kept its dtype)")
        tied = model_type == "qwen2"
        weight = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight" if tied else
                                                                     "lm_head.weight"]
        values, scales = quantize_q8_0(weight)
        held = unpack_q8_0(head.qweight, head.scales, head.out_features)
        assert torch.equal(held[0], values) and torch.equal(held[1], scales)
        assert torch.equal(head.weight, weight)
        if tied:
            assert head.weight is pipe.engine.runner.model.model.embed_tokens.weight
        hidden = _hidden_rows(pipe, [5, 9, 13, 2, 7])
        torch.testing.assert_close(head.logits(hidden).double(), _oracle(hidden, values, scales), rtol=1e-5,
                                   atol=1e-5)
        # More rows than Q8_MAX_ROWS: the plain weight's GEMM.
        many = hidden.repeat(Q8_MAX_ROWS + 1, 1)
        torch.testing.assert_close(head.logits(many).double(), many.double() @ weight.double().t(), rtol=1e-5,
                                   atol=1e-5)
    assert pipe.engine.plan.lm_head_quantization == "q8_0"
    out = pipe([[5, 9, 13, 2, 7], [3, 4]], max_new_tokens=6, do_sample=False, ignore_eos=True)
    assert [len(r.token_ids) for r in out] == [6, 6]
    pipe.destroy()


def _epyc() -> Hardware:
    return Hardware("cpu", 2, frozenset({"avx2", "avx512f", "avx512_bf16"}), "AVX512", 24 * GIB,
                    cpp_compiler="/usr/bin/c++")


def test_plan_takes_q8_0_where_it_can_run(tiny_checkpoints, monkeypatch):
    """The default follows the decoder's quantization; asked for, it is taken, and it is refused with the reason on a GPU, with the kernels off, and for a hidden size that is
    not a multiple of 32 (where the default stays "none")."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    facts = model_facts(tiny_checkpoints["llama"])
    default = make_plan(facts, _epyc(), kv_cache_memory=GIB)
    assert default.lm_head_quantization == "none" and "q8_0" in default.reasons["lm_head_quantization"]
    for quantization in ("int8", "int4"):
        plan = make_plan(facts, _epyc(), quantization=quantization, quantization_group_size=32)
        assert plan.lm_head_quantization == "q8_0" and "1.06 bytes" in plan.reasons["lm_head_quantization"]
    asked = make_plan(facts, _epyc(), lm_head_quantization="q8_0", kv_cache_memory=GIB)
    assert asked.lm_head_quantization == "q8_0" and asked.reasons["lm_head_quantization"] == "set by the user"
    h100 = Hardware("cuda", 32, frozenset({"avx512f"}), "AVX512", 500 * GIB,
                    (GPUInfo("NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB, 79 * GIB, 132),))
    with pytest.raises(ValueError, match="lm_head_quantization='q8_0' cannot apply: .*C\\+\\+ CPU kernel"):
        make_plan(facts, h100, lm_head_quantization="q8_0")
    monkeypatch.setenv(ENV_VAR, "off")
    with pytest.raises(ValueError, match=f"{ENV_VAR}"):
        make_plan(facts, _epyc(), lm_head_quantization="q8_0")
    monkeypatch.delenv(ENV_VAR)
    odd = model_facts(tiny_checkpoints["llama"])
    object.__setattr__(odd, "hidden_size", 72)
    with pytest.raises(ValueError, match="hidden size is 72"):
        make_plan(odd, _epyc(), lm_head_quantization="q8_0")
    assert make_plan(odd, _epyc(), quantization="int8").lm_head_quantization == "none"
    with pytest.raises(ValueError, match="lm_head_quantization"):
        make_plan(facts, _epyc(), lm_head_quantization="q4")


def test_head_stays_in_dtype_where_the_kernel_cannot_build(tiny_checkpoints, monkeypatch, caplog):
    """The plan allowed Q8_0 but the build fails at start-up: one log line and the plain head, never an error."""
    import fastgen.models.q8_head as q8_head

    monkeypatch.setattr(q8_head, "active_op", lambda name: None)
    pipe = fastgen.pipeline(tiny_checkpoints["llama"], **SMALL, dtype="float32", lm_head_quantization="q8_0")
    assert not isinstance(pipe.engine.runner.model.lm_head, Q8LMHead)
    assert "keeps its dtype" in caplog.text
    assert len(pipe([[5, 9, 13]], max_new_tokens=3, do_sample=False, ignore_eos=True)[0].token_ids) == 3
    pipe.destroy()

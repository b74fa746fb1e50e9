"""The policy: parameter counts (from the model built on meta) against HF's, hardware detection, the plan chosen for
this CPU and for simulated CPUs and GPUs (with every reason present), overrides that win and
overrides that cannot be honoured, and `python -m fastgen.planning` from a shell."""

import json
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch
import transformers

import fastgen
from fastgen.ops.cpu_kernels import isas_from_flags, pick_isa, requested_isa
from fastgen.planning.hardware import ISA_FLAGS, GPUInfo, Hardware, detect_hardware, measure_cpu_matmul
from fastgen.planning.model_facts import ModelFacts, model_facts
from fastgen.planning.plan import PLAN_FIELDS, Plan
from fastgen.planning.policy import make_plan
from kit import COMMON, TINY_CONFIGS, _rope_kwargs, build_checkpoint

GIB = 2**30
BF16_CPU = frozenset({"avx2", "avx512f", "avx512_bf16"})
A10 = GPUInfo("NVIDIA A10", (8, 6), 24 * GIB, 23 * GIB, 72)
H100 = GPUInfo("NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB, 79 * GIB, 132)
H200 = GPUInfo("NVIDIA H200", (9, 0), 141 * GIB, 140 * GIB, 132)
V100 = GPUInfo("Tesla V100-SXM2-32GB", (7, 0), 32 * GIB, 31 * GIB, 80)


def _cpu(cores: int = 2, flags: frozenset = BF16_CPU) -> Hardware:
    return Hardware("cpu", cores, flags, "AVX512", 24 * GIB)


def _gpus(*gpus: GPUInfo) -> Hardware:
    return Hardware("cuda", 32, BF16_CPU, "AVX512", 500 * GIB, gpus)


def _facts(tmp_path, config: transformers.PretrainedConfig, name: str = "model") -> ModelFacts:
    """Facts read back from a directory holding only the config.json of `config`."""
    path = tmp_path / name
    config.save_pretrained(path)
    return model_facts(str(path))


def _hf_params(config: transformers.PretrainedConfig) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=4096, dtype="float16")
MISTRAL_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, dtype="bfloat16")
LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, dtype="bfloat16")
TINYLLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, dtype="bfloat16")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, ModelFacts]:
    root = tmp_path_factory.mktemp("configs")
    return {
        "tiny": _facts(root, transformers.LlamaConfig(**{**COMMON, "dtype": "float32"}), "tiny"),
        "1b": _facts(root, transformers.LlamaConfig(**TINYLLAMA_1B), "1b"),
        "7b": _facts(root, transformers.MistralConfig(**MISTRAL_7B), "7b"),
        "7b-fp16": _facts(root, transformers.LlamaConfig(**LLAMA2_7B), "7b-fp16"),
        "70b": _facts(root, transformers.LlamaConfig(**LLAMA3_70B), "70b"),
        "405b": _facts(root, transformers.LlamaConfig(**{**LLAMA3_70B, "hidden_size": 16384, "num_hidden_layers": 126,
                                                         "num_attention_heads": 128, "intermediate_size": 53248}), "405b"),
    }


# Model facts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_param_count_equals_hf_for_every_family(tmp_path, model_type):
    cls, extra = TINY_CONFIGS[model_type]
    config = cls(**{**COMMON, **_rope_kwargs(cls, extra)})
    facts = _facts(tmp_path, config)
    assert facts.model_type == model_type
    assert facts.num_params == _hf_params(config)  # counted on our model class built on meta: exact


@pytest.mark.parametrize("config", [transformers.LlamaConfig(**LLAMA2_7B), transformers.MixtralConfig(),
                                    transformers.GPT2Config(), transformers.OPTConfig()],
                         ids=["llama2-7b", "mixtral-8x7b", "gpt2", "opt-125m"])
def test_param_count_equals_hf_at_real_sizes(tmp_path, config):
    assert _facts(tmp_path, config).num_params == _hf_params(config)


def test_unregistered_model_type_is_a_clear_error(tmp_path):
    path = tmp_path / "unknown"
    transformers.LlamaConfig(**COMMON).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gemma3'; fastgen supports: .*llama"):
        model_facts(str(path))


@pytest.mark.parametrize("quantization, group_size", [("none", 128), ("int8", 128), ("int4", 32)])
def test_weight_bytes_equal_the_loaded_model(tiny_checkpoints, quantization, group_size):
    """The planner's bytes are what the loader actually holds: parameters plus packed int8/int4
    weights and their scales (the rotary cache is not weights)."""
    from fastgen.models.loader import load_model
    from fastgen.models.rope import RotaryEmbedding

    for model_type in ("llama", "qwen2", "qwen2_moe"):  # untied, tied, MoE with a shared expert
        path = tiny_checkpoints[model_type]
        model = load_model(path, dtype=torch.bfloat16, progress=False, quantization=quantization,
                           quantization_group_size=group_size).model
        rotary = {id(b) for m in model.modules() if isinstance(m, RotaryEmbedding) for b in m.buffers()}
        held = [t for t in [*model.parameters(), *model.buffers()] if id(t) not in rotary]
        assert model_facts(path).weight_bytes(torch.bfloat16, quantization, group_size) == \
            sum(t.numel() * t.element_size() for t in held), model_type


def test_moe_active_params_count_top_k_experts(tmp_path):
    facts = _facts(tmp_path, transformers.MixtralConfig())  # 8 experts, top-2: ~46.7B total, ~12.9B active
    assert facts.num_experts == 8
    assert 12e9 < facts.active_params < 13.5e9 < 46e9 < facts.num_params
    assert facts.intermediate_size == 2 * 14336


def test_model_facts_reads_config_only(models, tmp_path):
    facts = models["7b"]
    assert (facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_dim) == (32, 32, 8, 128)
    assert facts.dtype == torch.bfloat16 and facts.max_position_embeddings == 32768
    assert facts.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert facts.kv_bytes(torch.float32, tensor_parallel=4) == 2 * 32 * 2 * 128 * 4
    assert facts.kv_bytes(torch.bfloat16, tensor_parallel=16) == 2 * 32 * 1 * 128 * 2  # KV heads copied past 8 ranks
    with pytest.raises(FileNotFoundError):
        model_facts(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_facts(str(tmp_path / "empty"))


# Hardware -------------------------------------------------------------------------------------


def test_detect_hardware_here():
    hw = detect_hardware("cpu")
    assert hw.device_type == "cpu" and hw.gpu_count == 0
    assert hw.cpu_cores >= 1 and hw.ram_available > 0
    assert hw.cpu_flags <= set(ISA_FLAGS)
    assert hw.cpu_capability == torch.backends.cpu.get_cpu_capability()


def test_plan_requires_a_reason_for_every_field(models):
    plan = make_plan(models["1b"], _cpu())
    reasons = dict(plan.reasons, buckets=" ")
    with pytest.raises(ValueError, match="missing: buckets"):
        Plan(**plan.engine_kwargs(), reasons=reasons)


def test_hardware_rejects_inconsistent_descriptions():
    with pytest.raises(ValueError, match="at least one GPUInfo"):
        Hardware("cuda", 2, BF16_CPU, "AVX512", GIB)
    with pytest.raises(ValueError, match="device_type"):
        Hardware("tpu", 2, BF16_CPU, "AVX512", GIB)
    with pytest.raises(ValueError, match="unknown cpu_flags"):
        Hardware("cpu", 2, frozenset({"sse9"}), "AVX512", GIB)
    with pytest.raises(ValueError, match="free_memory"):
        GPUInfo("x", (8, 0), GIB, 2 * GIB, 10)


# Plans ----------------------------------------------------------------------------------------


def _check_consistent(plan: Plan) -> None:
    """Invariants every plan keeps, whoever chose the values."""
    assert set(plan.reasons) == set(PLAN_FIELDS) and all(r.strip() for r in plan.reasons.values())
    assert list(plan.buckets) == sorted(set(plan.buckets)) and max(plan.buckets, default=0) <= plan.token_budget
    assert plan.max_seqs <= plan.token_budget and plan.kv_cache_memory > 0
    table = plan.table()
    assert all(name in table for name in PLAN_FIELDS)
    assert set(plan.engine_kwargs()) == set(PLAN_FIELDS)


def test_plan_for_this_machine(models):
    hardware = detect_hardware("cpu")
    plan = make_plan(models["1b"], hardware)
    _check_consistent(plan)
    kernel = hardware.cpp_compiler and pick_isa(isas_from_flags(hardware.cpu_flags), requested_isa())
    assert plan.dtype != torch.float16 and plan.attention_backend == ("cpu" if kernel else "torch")
    assert not plan.cuda_graphs


def test_two_core_bf16_cpu_plan_for_1b(models):
    plan = make_plan(models["1b"], _cpu())
    _check_consistent(plan)
    assert plan.dtype == torch.bfloat16 and plan.weight_prepack and plan.compile == "off"
    # 768 x 2 x 1.03B / 410 GFLOP/s is ~3.9 s a step; 0.5 s fits 99 tokens, but a step that small would spend
    # > 10% of its time re-streaming 2 GB of weights at ~23 GB/s: floored at 256.
    reason = plan.reasons["token_budget"]
    assert plan.token_budget == 256 and "3.9 s" in reason and "fits 99 tokens" in reason and "floored at 256" in reason
    assert plan.buckets == () and "exact size" in plan.reasons["buckets"] and plan.max_seqs == 256
    assert plan.block_size == 128  # head_dim 64
    assert (plan.tensor_parallel, plan.replica_num) == (1, 1)


def test_cpu_budget_scales_with_model_size(tmp_path, models):
    gpt2 = _facts(tmp_path, transformers.GPT2Config())  # 124M: 768 tokens take ~0.3 s at 410 GFLOP/s
    assert make_plan(gpt2, _cpu()).token_budget == 768
    assert make_plan(models["1b"], _cpu(cores=12)).token_budget == 512  # 0.5 s at 2460 GFLOP/s fits 594 tokens
    assert make_plan(models["7b"], _cpu()).token_budget == 256


def test_offline_batch_takes_larger_cpu_steps(models):
    # A server sizes steps for inter-token latency; a pipeline batch for total throughput.
    serving, offline = make_plan(models["1b"], _cpu()), make_plan(models["1b"], _cpu(), offline=True)
    assert serving.token_budget == 256 and offline.token_budget == 512 and offline.max_seqs == 512
    reason = offline.reasons["token_budget"]
    assert "offline batch" in reason and "3.9 s" in reason and "227-264 with 512" in reason
    # Where a 0.5 s step fits more than FastGen's 768 tokens, an offline batch takes up to 2048 of them.
    assert make_plan(models["tiny"], _cpu(), offline=True).token_budget == 2048
    assert make_plan(models["1b"], _cpu(), offline=True, token_budget=64).token_budget == 64  # the user still wins
    # GPU budgets do not depend on it.
    assert make_plan(models["7b"], _gpus(H100), offline=True).token_budget == make_plan(models["7b"], _gpus(H100)).token_budget


def test_amx_cpu_rates_bf16_at_its_tiles_speed(tmp_path):
    # SmolLM2-135M's shape: 0.5 s at 1800 GFLOP/s (2 cores of AMX) fits ~3400 tokens.
    smol = _facts(tmp_path, transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True))
    amx = _cpu(flags=BF16_CPU | {"amx_tile", "amx_bf16"})
    serving, offline = make_plan(smol, amx), make_plan(smol, amx, offline=True)
    assert serving.dtype == torch.bfloat16 and "1800 GFLOP/s" in serving.reasons["token_budget"]
    assert serving.token_budget == 768 and offline.token_budget == 2048
    assert "1379-1383 with 2048" in offline.reasons["token_budget"]
    # Without AMX the same shape fits fewer than 768 tokens and an offline batch keeps 512-token steps.
    assert make_plan(smol, _cpu(), offline=True).token_budget == 512


def test_tiny_fp32_checkpoint_stays_fp32_on_cpu_with_fastgen_budget(models):
    plan = make_plan(models["tiny"], _cpu())
    assert plan.dtype == torch.float32 and "tiny" in plan.reasons["dtype"]
    assert plan.token_budget == 768 and plan.buckets == ()
    assert plan.kv_cache_memory == 512 * 512 * models["tiny"].kv_bytes(torch.float32)  # max_seqs full-length seqs


def test_cpu_dtype_follows_its_isa(models):
    assert make_plan(models["7b-fp16"], _cpu()).dtype == torch.bfloat16  # fp16 checkpoint: never fp16 here
    no_bf16 = make_plan(models["1b"], _cpu(flags=frozenset({"avx2", "avx512f"})))
    assert no_bf16.dtype == torch.float32 and "no AVX512-BF16" in no_bf16.reasons["dtype"]
    avx512_fp16 = _cpu(flags=BF16_CPU | {"avx512_fp16"})  # fp16 runs at about fp32's rate there: allowed, not chosen
    assert make_plan(models["7b-fp16"], avx512_fp16).dtype == torch.bfloat16
    assert make_plan(models["1b"], avx512_fp16, dtype="float16").dtype == torch.float16
    amx_fp16 = _cpu(flags=BF16_CPU | {"amx_tile", "amx_bf16", "amx_fp16"})
    assert make_plan(models["7b-fp16"], amx_fp16).dtype == torch.float16
    assert make_plan(models["1b"], amx_fp16, dtype="float16").dtype == torch.float16


def test_24gb_ampere_plan(models):
    plan = make_plan(models["7b"], _gpus(A10))
    _check_consistent(plan)
    assert plan.dtype == torch.bfloat16 and plan.attention_backend == "triton" and plan.cuda_graphs
    assert plan.token_budget == 768 and plan.max_seqs == 512 and plan.block_size == 64
    assert plan.buckets[:6] == (1, 2, 4, 8, 16, 24) and plan.buckets[-3:] == (496, 512, 768)
    weights = models["7b"].weight_bytes(torch.bfloat16)
    assert 0 < plan.kv_cache_memory < 0.9 * A10.free_memory - weights
    assert plan.tensor_parallel == 1 and "fit one GPU" in plan.reasons["tensor_parallel"]


@pytest.mark.parametrize("gpu", [H100, H200], ids=["h100", "h200"])
def test_hopper_plans_take_a_larger_budget(models, gpu):
    plan = make_plan(models["7b"], _gpus(gpu))
    _check_consistent(plan)
    assert plan.token_budget == 2048 and "790" in plan.reasons["token_budget"]
    assert plan.buckets[-3:] == (512, 1024, 2048) and plan.dtype == torch.bfloat16


def test_h200_kv_gain_is_its_extra_free_memory(models):
    gain = make_plan(models["7b"], _gpus(H200)).kv_cache_memory - make_plan(models["7b"], _gpus(H100)).kv_cache_memory
    assert gain == pytest.approx(0.9 * (H200.free_memory - H100.free_memory), rel=0.001)


def test_v100_gets_fp16_and_torch_attention(models):
    plan = make_plan(models["7b"], _gpus(V100))
    _check_consistent(plan)
    assert plan.dtype == torch.float16 and "65504" in plan.reasons["dtype"]
    assert plan.attention_backend == "torch" and "8.0" in plan.reasons["attention_backend"]
    with pytest.raises(ValueError, match="bfloat16 needs compute capability"):
        make_plan(models["7b"], _gpus(V100), dtype="bfloat16")


def test_70b_on_8_h100_picks_smallest_fitting_tensor_parallel(models):
    plan = make_plan(models["70b"], _gpus(*[H100] * 8))
    _check_consistent(plan)
    # 131 GiB x 1.2 / 2 = 79 GiB > 71 GiB usable on each: TP=2 does not fit, TP=4 does.
    assert plan.tensor_parallel == 4 and "TP=2" in plan.reasons["tensor_parallel"]
    # The other four GPUs hold a second replica.
    assert plan.replica_num == 2 and "8 GPUs / TP 4 = 2 replicas" in plan.reasons["replica_num"]
    assert make_plan(models["70b"], _gpus(*[H100] * 8), replica_num=1).replica_num == 1
    with pytest.raises(ValueError, match="needs 12 GPUs"):
        make_plan(models["70b"], _gpus(*[H100] * 8), replica_num=3)


def test_small_model_on_many_gpus_gets_replicas_not_tensor_parallel(models):
    plan = make_plan(models["1b"], _gpus(*[H100] * 8))
    assert (plan.tensor_parallel, plan.replica_num) == (1, 8)
    assert "8 replicas" in plan.reasons["replica_num"] and "fit one GPU" in plan.reasons["tensor_parallel"]
    assert make_plan(models["1b"], _gpus(*[H100] * 8), replica_num=1).replica_num == 1
    # A TP override leaves the rest of the GPUs to replicas.
    assert make_plan(models["1b"], _gpus(*[H100] * 8), tensor_parallel=2).replica_num == 4


def test_tensor_parallel_may_span_the_machines_of_a_torchrun_launch(models):
    two_nodes = _gpus(*[H100] * 8)
    two_nodes.nodes = 2
    assert make_plan(models["70b"], two_nodes, tensor_parallel=16).tensor_parallel == 16
    with pytest.raises(ValueError, match="larger than the 8 GPU"):
        make_plan(models["70b"], _gpus(*[H100] * 8), tensor_parallel=16)


def test_model_too_large_for_every_gpu_is_a_clear_error(models):
    # 8 H100s hold 405B only in int8 (the policy's choice, tests/test_quantization.py); refusing it is an error.
    # Each of these would stream its weights (tests/test_offload.py) unless offload is refused too.
    with pytest.raises(ValueError, match="model too large.*TP=8"):
        make_plan(models["405b"], _gpus(*[H100] * 8), quantization="none", offload="none")
    with pytest.raises(ValueError, match="model too large.*even int4.*TP=2"):
        make_plan(models["405b"], _gpus(H100, H100), offload="none")
    with pytest.raises(ValueError, match="model too large"):
        make_plan(models["70b"], _gpus(A10), offload="none")
    with pytest.raises(ValueError, match="model too large"):
        make_plan(models["70b"], _cpu(), offload="none")


# Overrides ------------------------------------------------------------------------------------


def test_overrides_win_and_say_so(models):
    overrides = dict(dtype=torch.float16, attention_backend="torch", compile="max-autotune", cuda_graphs=False,
                     buckets=(1, 8, 64), token_budget=128, max_seqs=32, block_size=16, kv_cache_memory=GIB,
                     tensor_parallel=2, replica_num=2, quantization="int4", quantization_group_size=64,
                     offload="none", weight_memory=64 * GIB, weight_prepack=False, gemv_weights=False,
                     context_per_budget_token=0, structured_outputs_backend="llguidance", state_slots=0,
                     kv_prefault=True, lm_head_quantization="none", decode_layer_kernel=False,
                     adaptive_threads=False)
    plan = make_plan(models["7b"], _gpus(*[H100] * 4), **overrides)
    assert plan.engine_kwargs() == {**overrides, "speculative_config": None,  # off unless asked for
                                    "enable_lora": False, "max_loras": 0, "max_lora_rank": 0, "max_cpu_loras": 0}
    assert all(plan.reasons[name] == "set by the user" for name in overrides)


def test_attention_charge_is_a_layers_linear_flops_over_its_attention_flops_per_position(models):
    # Mistral-7B's layer: q and o 4096^2 each, k and v 4096 x 1024 (GQA), the MLP 3 x 4096 x 14336 and two
    # norms of 4096 = 218.1M params, 2 x 218.1M FLOPs a token against 4 x 32 heads x 128 a position:
    # 26,625 positions cost one token. An offline batch has no charge.
    facts = models["7b"]
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert facts.num_heads * facts.head_dim == 4096
    for hardware in (_cpu(), _gpus(H100)):
        plan = make_plan(facts, hardware)
        assert plan.context_per_budget_token == per_layer // (2 * 4096) == 26625
        assert "26625 positions cost one token" in plan.reasons["context_per_budget_token"]
        assert make_plan(facts, hardware, offline=True).context_per_budget_token == 0
    assert make_plan(facts, _cpu(), context_per_budget_token=5).context_per_budget_token == 5
    with pytest.raises(ValueError, match="context_per_budget_token must be >= 0"):
        make_plan(facts, _cpu(), context_per_budget_token=-1)
    with pytest.raises(TypeError, match="context_per_budget_token must be an int"):
        make_plan(facts, _cpu(), context_per_budget_token=1.5)


def test_derived_fields_follow_overrides(models):
    plan = make_plan(models["1b"], _cpu(), token_budget=64)
    assert plan.max_seqs == 64
    assert make_plan(models["7b"], _gpus(H100), token_budget=64).buckets[-1] == 64
    raised = make_plan(models["1b"], _cpu(), buckets=(1, 8, 1024))
    assert raised.token_budget == 1024 and "raised" in raised.reasons["token_budget"]
    half = make_plan(models["7b"], _gpus(H100), kv_cache_memory=0.5)
    assert half.kv_cache_memory == pytest.approx(make_plan(models["7b"], _gpus(H100)).kv_cache_memory / 2, rel=0.01)
    assert make_plan(models["1b"], _cpu(), dtype=None, attention_backend="auto").attention_backend == "torch"


@pytest.mark.parametrize("hardware, overrides, message", [
    ("cpu", dict(cuda_graphs=True), "cuda_graphs=True needs a CUDA device"),
    ("cpu", dict(attention_backend="triton"), "TRITON_INTERPRET=1"),
    ("cpu", dict(dtype="float16"), "100x slower"),
    ("cpu", dict(token_budget=64, buckets=(1, 128)), "smaller than the largest bucket"),
    ("cpu", dict(max_seqs=600, token_budget=512), "max_seqs 600 exceeds token_budget 512"),
    ("gpu", dict(tensor_parallel=3), "must divide the 32 attention heads"),
    ("gpu", dict(tensor_parallel=8), "larger than the 4 GPU"),
    ("gpu", dict(compile="fast"), "compile must be one of"),
    ("gpu", dict(attention_backend="flash"), "attention_backend must be one of"),
    ("gpu", dict(attention_backend="cpu"), "C\\+\\+ CPU kernel"),
    ("gpu", dict(buckets=(4, 2)), "strictly ascending"),
    ("gpu", dict(buckets=(0, 2)), "strictly ascending"),
    ("gpu", dict(buckets=()), "strictly ascending"),
    ("gpu", dict(token_budget=0), "token_budget must be positive"),
    ("gpu", dict(kv_cache_memory=1.5), "fraction in"),
    ("gpu", dict(kv_cache_memory=10**15), "exceeds the"),
    ("gpu", dict(dtype="float64"), "unsupported dtype"),
])
def test_impossible_overrides_raise_value_error(models, hardware, overrides, message, monkeypatch):
    # The Triton tests switch the interpreter on for the whole pytest process.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hw = _cpu() if hardware == "cpu" else _gpus(*[H100] * 4)
    with pytest.raises(ValueError, match=message):
        make_plan(models["7b"], hw, **overrides)


@pytest.mark.parametrize("overrides, message", [
    (dict(max_batch=4), "unknown plan option.*'max_batch'"),
    (dict(token_budget="512"), "token_budget must be an int"),
    (dict(cuda_graphs="yes"), "cuda_graphs must be a bool"),
    (dict(buckets="1,2"), "buckets must be a sequence"),
    (dict(kv_cache_memory=True), "kv_cache_memory must be bytes"),
])
def test_bad_override_types_raise_type_error(models, overrides, message):
    with pytest.raises(TypeError, match=message):
        make_plan(models["7b"], _gpus(H100), **overrides)


def test_triton_on_cpu_allowed_under_the_interpreter(models, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert make_plan(models["tiny"], _cpu(), attention_backend="triton").attention_backend == "triton"


# explain --------------------------------------------------------------------------------------


def test_explain_prints_table_and_returns_plan(models, tmp_path, capsys):
    path = tmp_path / "70b"
    transformers.LlamaConfig(**LLAMA3_70B).save_pretrained(path)
    plan = fastgen.explain(str(path), hardware=_gpus(*[H100] * 8), token_budget=1024)
    out = capsys.readouterr().out
    assert plan.tensor_parallel == 4 and plan.token_budget == 1024
    assert "8x NVIDIA H100" in out and "field" in out and "reason" in out
    assert all(f"{name} " in out for name in PLAN_FIELDS)


def test_explain_command_line(tmp_path):
    path = build_checkpoint(str(tmp_path / "llama"), "llama")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    ok = subprocess.run([sys.executable, "-m", "fastgen.planning", path, "--token-budget", "512", "--buckets", "1,8,64"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "field" in ok.stdout and all(name in ok.stdout for name in PLAN_FIELDS)
    assert "1,8,64" in ok.stdout and "set by the user" in ok.stdout


def test_explain_command_line_reports_impossible_override(tmp_path, monkeypatch, capsys):
    transformers.LlamaConfig(**COMMON).save_pretrained(tmp_path)
    monkeypatch.setattr(sys, "argv", ["explain", str(tmp_path), "--cuda_graphs", "true"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("fastgen.planning", run_name="__main__")
    assert exit_info.value.code == 2
    assert "cuda_graphs=True needs a CUDA device" in capsys.readouterr().err


def test_offline_must_be_a_bool():
    from fastgen.config import EngineConfig

    with pytest.raises(TypeError, match="offline must be a bool, got 'yes'"):
        EngineConfig.from_kwargs(None, offline="yes")


def test_explain_command_line_plans_offline_on_request(tmp_path, monkeypatch):
    import fastgen.planning.cli as cli

    transformers.LlamaConfig(**COMMON).save_pretrained(tmp_path)
    seen = []
    monkeypatch.setattr(cli, "explain", lambda model, **kwargs: seen.append(kwargs["offline"]))
    assert cli.main([str(tmp_path)]) == 0 and cli.main([str(tmp_path), "--offline"]) == 0
    assert seen == [False, True]


def test_measured_cpu_rates_drive_the_cpu_budget(models):
    rates = measure_cpu_matmul(seconds=0.02)
    assert set(rates) == {"bfloat16", "float32", "float16"} and all(r > 0 for r in rates.values())
    slow = Hardware("cpu", 2, BF16_CPU, "AVX512", 24 * GIB, matmul_gflops={"bfloat16": 100.0, "float32": 50.0,
                                                                           "float16": 1.0})
    plan = make_plan(models["1b"], slow)
    assert "100 GFLOP/s (bfloat16, measured)" in plan.reasons["token_budget"]
    assert "measured here" in plan.reasons["dtype"]


def test_cpu_compiles_only_models_big_enough_to_pay_for_it(models):
    small = make_plan(models["tiny"], _cpu())
    assert small.compile == "off" and "bench_graphs" in small.reasons["compile"]
    # Prepacked linears leave Inductor only elementwise glue: measured no gain for twice the start-up.
    prepacked = make_plan(models["1b"], _cpu())
    assert prepacked.weight_prepack and prepacked.compile == "off" and "weight_prepack" in prepacked.reasons["compile"]
    assert make_plan(models["1b"], _cpu(), weight_prepack=False).compile == "default"
    assert make_plan(models["1b"], _cpu(), quantization="int8").compile == "default"  # no compiler: torch's int8
    # Quantized linears on fastgen's C++ kernels leave Inductor only the glue too.
    builds = Hardware("cpu", 2, BF16_CPU, "AVX512", 24 * GIB, cpp_compiler="/usr/bin/c++")
    for quantization in ("int8", "int4"):
        plan = make_plan(models["1b"], builds, quantization=quantization)
        assert plan.compile == "off" and "fastgen's C++ kernels" in plan.reasons["compile"], quantization
    assert make_plan(models["1b"], builds, quantization="int4", quantization_group_size=32).compile == "default"
    assert make_plan(models["tiny"], _cpu(), compile="default").compile == "default"  # the user wins
    assert make_plan(models["tiny"], _gpus(H100)).compile == "default"


def test_each_plan_field_is_declared_once_and_reaches_every_surface():
    """A plan field declared in `Plan` is an EngineConfig keyword, a `python -m fastgen.planning`
    flag and a `scripts/serve.py` flag, with its own parser and check, without being written again."""
    import dataclasses

    from fastgen.config import EngineConfig
    from fastgen.planning.cli import build_parser
    from fastgen.planning.plan import PLAN_SPECS, normalise_overrides
    from fastgen.serving.cli import build_parser as serve_parser

    config_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    planning_flags = {a.dest for a in build_parser()._actions}
    serve_flags = {a.dest for a in serve_parser()._actions}
    for name, spec in PLAN_SPECS.items():
        assert config_fields[name].default is None and config_fields[name].metadata["doc"] == spec.metadata["doc"]
        assert name in planning_flags and name in serve_flags
    args = build_parser().parse_args(["m", "--buckets", "1,8", "--cuda-graphs", "no", "--kv-cache-memory", "0.5"])
    assert (args.buckets, args.cuda_graphs, args.kv_cache_memory) == ((1, 8), False, 0.5)
    with pytest.raises(ValueError, match="strictly ascending"):
        normalise_overrides({"buckets": (8, 1)})
    with pytest.raises(TypeError, match="token_budget must be an int"):
        normalise_overrides(EngineConfig.from_kwargs(None, token_budget="x").plan_overrides())


def test_kv_bytes_shown_are_what_the_runner_allocates_sliding_layers_in_full(tmp_path, capsys):
    """A model with sliding-window layers (Gemma 3: one local, one global here) is planned and run with
    every layer's K/V for every token: the B/token the plan prints is the runner's allocation per token,
    and the reason says the sliding layers are cached in full and why."""
    from fastgen.config import EngineConfig
    from fastgen.engine.builder import build_runner

    path = build_checkpoint(str(tmp_path / "gemma3"), "gemma3_text")
    plan = fastgen.explain(path, hardware=_cpu())
    reason = plan.reasons["kv_cache_memory"]
    assert reason in capsys.readouterr().out
    assert "sliding-window layers (1 of 2, window 12) are cached in full" in reason and "follow-up" in reason
    shown = int(re.search(r"at ([\d,]+) B/token", reason).group(1).replace(",", ""))
    cfg = TINY_CONFIGS["gemma3_text"][1]
    itemsize = torch.empty((), dtype=plan.dtype).element_size()
    assert shown == COMMON["num_hidden_layers"] * 2 * COMMON["num_key_value_heads"] * cfg["head_dim"] * itemsize
    built = build_runner(EngineConfig(model=path, device="cpu", num_kv_blocks=3, progress=False), plan)
    allocated = sum(t.numel() * t.element_size() for layer in built.runner.kv_caches for t in layer)
    assert allocated == shown * 3 * plan.block_size
    llama = build_checkpoint(str(tmp_path / "llama"), "llama")
    assert "sliding" not in fastgen.explain(llama, hardware=_cpu()).reasons["kv_cache_memory"]

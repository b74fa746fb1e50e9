"""The compile-first runner: bucket padding, torch.compile per bucket, no recompiles, eager overflow.

Outputs with padding and with compilation must equal the eager runner's token for token on the
parity batch (the eager runner itself is checked against HF in test_engine_parity.py).
"""

import pytest
import torch
from torch._dynamo.utils import counters

import fastgen
from fastgen.executor.step_inputs import HostStepInputs, StaticBuffers, pick_bucket
from fastgen.models.layers import decoder_layers

SMALL = dict(num_kv_blocks=48, block_size=4, token_budget=32, max_seqs=8, progress=False)


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([1, 2, 5, 9, 17, 33, 40, 3, 12, 70])]


def _generate(path: str, **options) -> tuple[list[list[int]], fastgen.Pipeline]:
    pipe = fastgen.pipeline(path, **{**SMALL, **options})
    pipe.engine.eos_token_ids = set()
    out = pipe(_prompts(), max_new_tokens=12, do_sample=False)
    return [r.token_ids for r in out], pipe


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3_5_text"])
def test_padded_buckets_equal_exact_shapes(model_type, tiny_checkpoints):
    path = tiny_checkpoints[model_type]
    exact, _ = _generate(path)
    padded, pipe = _generate(path, buckets=[1, 2, 4, 8, 16])  # steps > 16 tokens run unpadded
    assert padded == exact
    assert pipe.engine.block_manager.num_free_blocks == SMALL["num_kv_blocks"]


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "gemma2", "gpt_oss", "deepseek_v3"])
def test_compiled_equals_eager_without_recompiling(model_type, tiny_checkpoints):
    path = tiny_checkpoints[model_type]
    eager, _ = _generate(path)
    pipe = fastgen.pipeline(path, **SMALL, compile="default", buckets=[2, 8, 16])
    assert sorted(pipe.engine.runner.warmup_seconds) == [2, 8, 16]
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    pipe.engine.eos_token_ids = set()
    # Mixed steps of 1..32 tokens: buckets 2/8/16 padded and compiled, bigger steps eager.
    compiled = [r.token_ids for r in pipe(_prompts(), max_new_tokens=12, do_sample=False)]
    assert compiled == eager
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup, "serving recompiled after warm-up"


# The families whose layers differ from each other (local/global rotaries, NoPE layers, a dense
# layer before MoE ones) or whose norms span heads: one bucket keeps the compile cost down.
@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma4_text", "olmo2", "olmo3", "smollm3", "granite", "glm4_moe",
                                        "llama4_text", "qwen3_next"])
def test_new_families_compiled_equal_eager(model_type, tiny_checkpoints):
    path = tiny_checkpoints[model_type]
    eager, _ = _generate(path)
    pipe = fastgen.pipeline(path, **SMALL, compile="default", buckets=[16])
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    pipe.engine.eos_token_ids = set()
    compiled = [r.token_ids for r in pipe(_prompts(), max_new_tokens=12, do_sample=False)]
    assert compiled == eager
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup, "serving recompiled after warm-up"


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_5_text"])
def test_symbolic_compile_serves_every_step_size(model_type, tiny_checkpoints):
    """The CPU plan's choice: no buckets, the decoder layer compiled once with symbolic sizes."""
    path = tiny_checkpoints[model_type]
    eager, _ = _generate(path)
    pipe = fastgen.pipeline(path, **SMALL, compile="default")
    assert pipe.engine.runner.buckets == [] and sorted(pipe.engine.runner.warmup_seconds) == [1, 5]
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    pipe.engine.eos_token_ids = set()
    # Steps of 1..32 tokens over 1..8 sequences, all at their exact sizes.
    compiled = [r.token_ids for r in pipe(_prompts(), max_new_tokens=12, do_sample=False)]
    assert compiled == eager
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup, "serving recompiled after warm-up"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (scripts/device_check.sh runs this)")
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_cuda_graphs_replay_every_bucket(model_type, tiny_checkpoints):
    """On a GPU: the plan's buckets are each compiled and captured, and replaying them gives the eager
    tokens (fp32, so the two paths' rounding agrees)."""
    path = tiny_checkpoints[model_type]
    options = {**SMALL, "dtype": "float32", "device": "cuda"}
    eager, _ = _generate(path, **options, compile="off", cuda_graphs=False)
    graphed, pipe = _generate(path, **options, compile="default", cuda_graphs=True)
    runner = pipe.engine.runner
    assert sorted(runner._graphs) == sorted(runner.buckets) == sorted(pipe.engine.plan.buckets)
    assert graphed == eager


def _adapted_mix(family, **options) -> tuple[list[list[int]], list[list[int]], fastgen.Pipeline]:
    """Every prompt of the LoRA `family` under the base model and each adapter, interleaved in one call:
    (tokens, peft's tokens, the pipeline)."""
    from kit_lora import ENGINE, NUM_NEW

    pipe = fastgen.pipeline(family.path, **{**ENGINE, **options})
    pipe.engine.eos_token_ids = set()
    for name, adapter in family.adapters.items():
        pipe.load_lora(name, adapter)
    kinds = [None, *family.adapters]
    loras = [kind for _ in family.prompts for kind in kinds]
    prompts = [prompt for prompt in family.prompts for _ in kinds]
    want = [family.want[kind][i] for i in range(len(family.prompts)) for kind in kinds]
    out = pipe(prompts, lora=loras, max_new_tokens=NUM_NEW, do_sample=False)
    return [r.token_ids for r in out], want, pipe


def test_padded_buckets_serve_adapters(lora_families):
    """LoRA through the path CUDA graphs take: every step padded to a compiled bucket, padding rows at slot -1,
    the delta from the kernel that reads the slots alone (`slots_only`: no host grid) where it runs here."""
    from fastgen.ops.lora import lora_kernel_serves

    family = lora_families("llama")
    tokens, want, pipe = _adapted_mix(family, compile="default", buckets=[16])
    assert tokens == want
    rows = next(iter(pipe.engine.runner.lora.layers.values())).rows
    assert rows.kernel == lora_kernel_serves(torch.device("cpu"), torch.float32)
    pipe.destroy()


def test_gpu_plan_keeps_graphs_with_lora(lora_families):
    """LoRA no longer turns CUDA graphs off: the plan keeps them and says why adapted steps replay."""
    from fastgen.planning.hardware import GPUInfo, Hardware
    from fastgen.planning.model_facts import model_facts
    from fastgen.planning.policy import make_plan

    h100 = Hardware("cuda", 32, frozenset({"avx512f"}), "AVX512", 500 << 30,
                    (GPUInfo("NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 79 << 30, 132),))
    facts = model_facts(lora_families("llama").path)
    for user in ({}, {"cuda_graphs": True}):
        plan = make_plan(facts, h100, enable_lora=True, **user)
        assert plan.cuda_graphs and plan.enable_lora and "adapter slot is a step input" in plan.reasons["cuda_graphs"]


def _write_adapter(base: str, out: str, seed: int, rank: int = 4) -> str:
    """A PEFT LoRA adapter of q_proj, v_proj and down_proj with random A and B, written by hand (the GPU
    machine has no peft; the CPU tests check the same loader against peft's own files)."""
    import json
    import os

    from safetensors.torch import save_file

    config = json.load(open(os.path.join(base, "config.json")))
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.v_proj": (hidden, kv), "mlp.down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (d_in, d_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=generator) / d_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=generator)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj",
                                                                                        "down_proj"]},
              open(os.path.join(out, "adapter_config.json"), "w"))
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (scripts/device_check.sh runs this)")
def test_cuda_graphs_replay_adapted_steps(tiny_checkpoints, tmp_path):
    """On a GPU: LoRA with CUDA graphs, each bucket captured with its adapter slots as a step input, gives the
    eager runner's tokens (fp32) for base rows and two adapters mixed in every step."""
    path = tiny_checkpoints["llama"]
    adapters = {name: _write_adapter(path, str(tmp_path / name), seed) for name, seed in (("a", 1), ("b", 2))}
    loras = [None, "a", "b"] * 4
    prompts = [prompt for prompt in _prompts()[:4] for _ in range(3)]
    options = {**SMALL, "dtype": "float32", "device": "cuda", "enable_lora": True, "max_loras": 2}
    results = []
    for extra in (dict(compile="off", cuda_graphs=False), dict(compile="default", cuda_graphs=True)):
        pipe = fastgen.pipeline(path, **options, **extra)
        pipe.engine.eos_token_ids = set()
        for name, adapter in adapters.items():
            pipe.load_lora(name, adapter)
        results.append([r.token_ids for r in pipe(prompts, lora=loras, max_new_tokens=12, do_sample=False)])
    eager, graphed = results
    assert sorted(pipe.engine.runner._graphs) == sorted(pipe.engine.runner.buckets)
    assert graphed == eager
    assert eager[0] != eager[1] != eager[2], "the adapters change nothing"


def test_compiled_layers_share_the_steps_attention_plan(tiny_checkpoints, monkeypatch):
    """A compiled layer calls the attention op without the step's metadata object; the step's first layer
    still works the plan out for all of them (once a step, not once a layer), and a call whose other
    metadata tensors differ never reads a plan made for another."""
    import importlib

    module = importlib.import_module("fastgen.ops.paged_attention")
    calls = []
    real = module.plan_kernel_step
    monkeypatch.setattr(module, "plan_kernel_step", lambda *args: calls.append(1) or real(*args))
    # the decode-layer op plans its steps itself: off, so every step's layers are the compiled ones
    pipe = fastgen.pipeline(tiny_checkpoints["llama"], **SMALL, compile="default", attention_backend="cpu",
                            decode_layer_kernel=False)
    engine = pipe.engine
    assert len(decoder_layers(engine.runner.model)) > 1
    engine.add_request([5, 9, 13, 2], fastgen.SamplingParams(do_sample=False, max_new_tokens=6))
    steps = 0
    calls.clear()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert len(calls) == steps
    slot_mapping, tables, starts, lens = torch.tensor([3]), torch.tensor([[0]]), torch.tensor([0, 1]), torch.tensor([4])
    plans = module._tensor_step_plans(slot_mapping, tables, starts, lens)
    assert module._tensor_step_plans(slot_mapping, tables, starts, lens) is plans
    assert module._tensor_step_plans(slot_mapping, tables, starts.clone(), lens) is not plans
    assert module._tensor_step_plans(slot_mapping, tables.clone(), starts, lens) is not plans
    pipe.destroy()


def test_eager_cpu_runner_warms_up_one_full_step(tiny_checkpoints):
    """An eager CPU runner runs one all-padding step of its token budget at start (capped for large
    budgets), touching no KV block (the parity tests check what eager runners serve after it)."""
    from fastgen.executor.runner import EAGER_WARMUP_TOKENS

    tokens, pipe = _generate(tiny_checkpoints["llama"])
    assert list(pipe.engine.runner.warmup_seconds) == [SMALL["token_budget"]]
    assert pipe.engine.block_manager.num_free_blocks == SMALL["num_kv_blocks"]
    big = fastgen.pipeline(tiny_checkpoints["llama"], **{**SMALL, "token_budget": 2 * EAGER_WARMUP_TOKENS})
    assert list(big.engine.runner.warmup_seconds) == [EAGER_WARMUP_TOKENS]


def test_cpu_plan_picks_no_buckets(tiny_checkpoints):
    plan = fastgen.pipeline(tiny_checkpoints["llama"], **SMALL, compile="default").engine.plan
    assert plan.buckets == () and "exact size" in plan.reasons["buckets"]


def test_pick_bucket():
    assert pick_bucket([1, 2, 4, 8], 1) == 1
    assert pick_bucket([1, 2, 4, 8], 3) == 4
    assert pick_bucket([1, 2, 4, 8], 8) == 8
    assert pick_bucket([1, 2, 4, 8], 9) is None


def test_static_buffers_pad_and_clear_stale_columns():
    buf = StaticBuffers(max_tokens=8, max_seqs=4, max_blocks_per_seq=5, device=torch.device("cpu"))
    long_step = HostStepInputs(list(range(8)), list(range(8)), list(range(8)), [[1, 2, 3, 4, 5]], [8], [0, 8],
                               [True] * 8, [3], [1] * 8, [7])
    buf.fill(long_step, 8)
    short = HostStepInputs([9, 10, 11], [4, 0, 1], [17, 20, 21], [[4, 5], [6]], [5, 2], [0, 1, 3],
                           [False, True, True], [1, 0], [0, -1, 0], [0, 2])
    buf.fill(short, 4)
    ids, pos, slots, tables, seq_lens, qsl, long_rope, state_slots, lora_slots = buf.views(4)
    assert ids.tolist() == [9, 10, 11, 0] and pos.tolist() == [4, 0, 1, 0]
    assert slots.tolist() == [17, 20, 21, -1]
    assert seq_lens.tolist() == [5, 2, 0, 0]
    assert qsl.tolist() == [0, 1, 3, 3, 3]
    assert long_rope.tolist() == [False, True, True, False]  # the long step's stale flag is padded away
    assert tables.tolist() == [[4, 5, 0, 0, 0], [6, 0, 0, 0, 0], [0] * 5, [0] * 5]
    assert state_slots.tolist() == [1, 0, -1, -1]  # the long step's slot 3 padded away
    assert lora_slots.tolist() == [0, -1, 0, -1]  # the long step's adapter 1 padded away
    buf.fill(None, 2)
    assert buf.views(2).slot_mapping.tolist() == [-1, -1] and buf.views(2).seq_lens.tolist() == [0, 0]


@pytest.mark.parametrize("options, message", [
    (dict(compile="fast"), "compile must be"),
    (dict(buckets=[4, 64]), "largest bucket"),
    (dict(buckets=[0, 4]), "buckets must be"),
    (dict(cuda_graphs="yes"), "cuda_graphs must be a bool"),
    (dict(token_budget=0), "token_budget must be positive"),
    (dict(tensor_parallel=0), "tensor_parallel must be a positive int"),
    (dict(tensor_parallel=3), "tensor_parallel 3 (is larger than|must divide)"),
])
def test_bad_compile_options(options, message, tiny_checkpoints):
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        fastgen.pipeline(tiny_checkpoints["llama"], **{**SMALL, **options})


def test_cuda_graphs_on_cpu_is_a_clear_error(tiny_checkpoints):
    with pytest.raises(ValueError, match="cuda_graphs"):
        fastgen.pipeline(tiny_checkpoints["llama"], **SMALL, device="cpu", cuda_graphs=True)

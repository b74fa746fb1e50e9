"""LoRA's Python API and its refusals: `pipe.load_lora` / `unload_lora` / `pipe(prompts, lora=...)` at run
time against peft's tokens, bad adapters refused with nothing loaded while the engine keeps serving,
unknown names, the plan fields' checks and memory table, and how the families whose checkpoint layout
is rewritten at load read pairs under other names or of modules they skip."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastgen
from fastgen.engine import UnknownLoRAError
from fastgen.models.config import ModelConfig
from fastgen.models.loader import build_empty_model
from fastgen.models.lora import WEIGHTS_FILE, load_lora_adapter
from fastgen.planning.cli import main as planning_main
from fastgen.planning.hardware import detect_hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.policy import make_plan
from kit import build_checkpoint
from kit_lora import ENGINE, LAYOUT_TARGETS, NUM_NEW, TARGETS, save_adapter


@pytest.fixture(scope="module")
def pipe(lora_families):
    """A llama pipeline with LoRA on and no adapter loaded."""
    family = lora_families("llama")
    pipe = fastgen.pipeline(family.path, **ENGINE)
    pipe.engine.eos_token_ids = set()
    yield pipe
    pipe.destroy()


def _tokens(pipe, prompts, lora):
    return [r.token_ids for r in pipe(prompts, lora=lora, max_new_tokens=NUM_NEW, do_sample=False)]


def test_load_call_unload_at_run_time(pipe, lora_families):
    family = lora_families("llama")
    prompts, want = family.prompts, family.want
    pipe.load_lora("a", family.adapters["a"])
    assert _tokens(pipe, prompts, "a") == want["a"]
    pipe.load_lora("b", family.adapters["b"])
    loras = [None, "a", "b", "a", None]
    assert _tokens(pipe, prompts, loras) == [want[lora][i] for i, lora in enumerate(loras)]

    stream = pipe.stream(prompts[:2], lora="a", max_new_tokens=NUM_NEW, do_sample=False)
    next(stream)  # its requests are running now
    with pytest.raises(ValueError, match="'a' is in use by 2 unfinished request"):
        pipe.unload_lora("a")
    assert _tokens(pipe, prompts[2:3], "b") == want["b"][2:3]  # the engine went on serving
    stream.close()  # aborts them
    pipe.unload_lora("a")
    with pytest.raises(UnknownLoRAError, match="unknown LoRA adapter 'a' \\(loaded: 'b'\\)"):
        pipe(prompts, lora="a")
    # The name again, other weights: neither a stale slot nor the old adapter's cached KV serves it.
    pipe.load_lora("a", family.adapters["b"])
    assert _tokens(pipe, prompts, "a") == want["b"]
    pipe.unload_lora("a")
    pipe.unload_lora("b")
    assert pipe.engine.lora_adapters() == {}


def _bad(root, family, kind: str) -> tuple[str, str]:
    """An adapter directory that is bad in one way, and the error it must raise."""
    path = root / kind
    if kind == "missing":
        return str(path), "has no adapter_config.json"
    shutil.copytree(family.adapters["a"], path)
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    if kind == "corrupt":
        (path / "adapter_model.safetensors").write_bytes(b"not safetensors")
        return str(path), "is corrupt"
    if kind == "not json":
        config_path.write_text("{")
        return str(path), "not valid JSON"
    if kind == "dora":
        config_path.write_text(json.dumps({**config, "use_dora": True}))
        return str(path), "DoRA"
    if kind == "fan_in_fan_out":  # GPT-2's Conv1D flag on an adapter of Linears
        config_path.write_text(json.dumps({**config, "fan_in_fan_out": True}))
        return str(path), "fan_in_fan_out is set, but LlamaForCausalLM's model.layers.0.mlp.down_proj is not a Conv1D"
    if kind == "target_parameters":  # what peft writes for a fused-experts MoE's gate/up/down_proj targets
        config_path.write_text(json.dumps({**config, "target_parameters": ["gate_up_proj", "down_proj"]}))
        return str(path), "target_parameters \\(LoRA on parameters, e.g. MoE expert stacks\\) is not supported"
    if kind == "unknown target":
        config_path.write_text(json.dumps({**config, "target_modules": ["q_proj", "nope_proj"]}))
        # Known: HF's names and ours, never the LoRA wrappers' inner `base`.
        return str(path), "target module 'nope_proj' is not a linear of LlamaForCausalLM \\(known: (?!.*'base').*'qkv_proj'"
    if kind == "rank":
        save_adapter(family.path, str(path), ["q_proj"], seed=3, r=16, lora_alpha=16)
        return str(path), "rank 16 exceeds max_lora_rank 8"
    assert kind == "shape"
    other = build_checkpoint(str(root / "other_base"), "llama", intermediate_size=96)
    save_adapter(other, str(path), TARGETS["llama"], seed=3, r=4, lora_alpha=8)
    return str(path), "down_proj has A \\(4, 96\\) .* but the base linear takes 128 inputs"


@pytest.mark.parametrize("kind", ["missing", "corrupt", "not json", "dora", "fan_in_fan_out", "target_parameters",
                                  "unknown target", "rank", "shape"])
def test_bad_adapter_loads_nothing_and_serving_goes_on(kind, pipe, lora_families, tmp_path):
    family = lora_families("llama")
    pipe.load_lora("good", family.adapters["b"])
    path, message = _bad(tmp_path, family, kind)
    with pytest.raises(ValueError, match=message):
        pipe.load_lora("bad", path)
    assert set(pipe.engine.lora_adapters()) == {"good"}
    assert _tokens(pipe, family.prompts[:3], "good") == family.want["b"][:3]
    pipe.unload_lora("good")


def test_requests_naming_adapters_wrongly(pipe, lora_families):
    family = lora_families("llama")
    with pytest.raises(ValueError, match="lora has 2 entries for 3 prompts"):
        pipe(family.prompts[:3], lora=["x", None])
    with pytest.raises(UnknownLoRAError, match="unknown LoRA adapter 'x'"):
        pipe(family.prompts[:2], lora=[None, "x"])
    assert pipe.engine.requests == {}, "a refused call queued requests"
    with pytest.raises(TypeError, match="lora must be"):
        pipe(family.prompts[:1], lora=3)
    pipe.load_lora("a", family.adapters["a"])
    with pytest.raises(ValueError, match="'a' is already loaded"):
        pipe.load_lora("a", family.adapters["b"])
    pipe.unload_lora("a")


def test_engine_without_lora_refuses_adapters(lora_families):
    family = lora_families("llama")
    pipe = fastgen.pipeline(family.path, **{**ENGINE, "enable_lora": None, "max_loras": None, "max_lora_rank": None})
    with pytest.raises(ValueError, match="enable_lora=True"):
        pipe.load_lora("a", family.adapters["a"])
    with pytest.raises(ValueError, match="serves none"):
        pipe(family.prompts[:1], lora="a")
    assert pipe.engine.runner.lora is None and pipe.engine.plan.max_loras == 0
    pipe.destroy()


@pytest.mark.parametrize("overrides,message", [
    (dict(enable_lora=True, max_loras=0), "max_loras must be at least 1"),
    (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank must be at least 1"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras \\(2\\) must be at least max_loras"),
    (dict(max_loras=2), "max_loras is set but enable_lora is not"),
    (dict(enable_lora=True, max_loras=-1), "max_loras must be >= 0"),
])
def test_plan_refuses_what_lora_cannot_run_with(overrides, message, lora_families):
    facts = model_facts(lora_families("llama").path)
    with pytest.raises(ValueError, match=message):
        make_plan(facts, detect_hardware("cpu"), **overrides)


def test_plan_table_shows_the_stacks(lora_families, capsys):
    path = lora_families("llama").path
    assert planning_main([path, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]) == 0
    out = capsys.readouterr().out
    plan = make_plan(model_facts(path), detect_hardware("cpu"), enable_lora=True, max_loras=3, max_lora_rank=8)
    assert (plan.max_loras, plan.max_lora_rank, plan.max_cpu_loras) == (3, 8, 3)
    assert "stacks take" in plan.reasons["max_loras"] and plan.reasons["max_loras"].split(";")[1] in out
    off = make_plan(model_facts(path), detect_hardware("cpu"))
    assert (off.enable_lora, off.max_loras, off.max_lora_rank, off.max_cpu_loras) == (False, 0, 0, 0)
    assert off.kv_cache_memory >= plan.kv_cache_memory


def _adapter_of(root: Path, model_type: str, targets: list[str]) -> tuple[torch.nn.Module, str]:
    """A tiny `model_type` checkpoint's empty model and a random PEFT adapter of it (`targets`)."""
    path = build_checkpoint(str(root / "base"), model_type)
    model = build_empty_model(ModelConfig.from_file(os.path.join(path, "config.json")))
    return model, save_adapter(path, str(root / "a"), targets, seed=1, r=4, lora_alpha=8)


def _extra_pairs(weights: dict, source: str, target: str) -> dict:
    """Copies of the pairs of modules under `source` (a dotted key part) as pairs of `target`."""
    return {key.replace(source, target): tensor.clone() for key, tensor in weights.items() if source in key}


_REWRITES = {
    # A KV-sharing layer's k_proj (its layers compute no K/V): HF skips such a module, and so does the loader.
    "gemma4_text": lambda w: w | _extra_pairs(w, ".layers.0.self_attn.k_proj.", ".layers.3.self_attn.k_proj."),
    # A multi-token-prediction layer past the decoder's last (layer 2 of 2).
    "glm4_moe": lambda w: w | _extra_pairs(w, ".layers.0.self_attn.", ".layers.2.self_attn."),
    # The multimodal checkpoint's names (text model under `model.language_model`), and its vision tower.
    "qwen3_5_text": lambda w: {k.replace(".model.layers.", ".model.language_model.layers."): t for k, t in w.items()}
                              | _extra_pairs(w, ".layers.0.linear_attn.out_proj.", ".visual.blocks.0.attn.qkv."),
    # Old OPT files' bare `decoder.` names.
    "opt": lambda w: {k.replace("model.model.decoder.", "model.decoder."): t for k, t in w.items()},
}


@pytest.mark.parametrize("model_type", sorted(_REWRITES))
def test_pairs_follow_the_families_checkpoint_names(model_type, tmp_path):
    """An adapter with pairs under the other names a family's checkpoints use, or of modules its loader skips
    (dropped: HF ignores those modules too), reads as the adapter without them (whose tokens equal peft's:
    test_lora_engine.py)."""
    model, path = _adapter_of(tmp_path, model_type, LAYOUT_TARGETS[model_type])
    rewritten = tmp_path / "rewritten"
    shutil.copytree(path, rewritten)
    weights = load_file(os.path.join(path, WEIGHTS_FILE))
    save_file(_REWRITES[model_type](weights), str(rewritten / WEIGHTS_FILE))
    want = load_lora_adapter("a", path, model, max_lora_rank=8).modules
    got = load_lora_adapter("a", str(rewritten), model, max_lora_rank=8).modules
    assert sorted(got) == sorted(want)
    for name, module in want.items():
        assert torch.equal(got[name].a, module.a) and torch.equal(got[name].b, module.b), name


def test_rows_that_do_not_fit_the_familys_reordering_are_refused(tmp_path):
    """Qwen3-Next's grouped in_proj_qkvz rows (reordered per key head) from a B a row short: a ValueError
    naming the pair, not the reshape's error."""
    model, path = _adapter_of(tmp_path, "qwen3_next", ["in_proj_qkvz"])
    weights = load_file(os.path.join(path, WEIGHTS_FILE))
    key = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz.lora_B.weight"
    save_file(weights | {key: weights[key][1:].clone()}, os.path.join(path, WEIGHTS_FILE))
    with pytest.raises(ValueError, match="in_proj_qkvz has B \\(127, 4\\), whose rows do not fit Qwen3_5ForCausalLM"):
        load_lora_adapter("a", path, model, max_lora_rank=8)


def test_absorbed_kv_b_proj_is_refused(tmp_path):
    """DeepSeek-V3's kv_b_proj never runs as a linear (its weight is absorbed per head), so an adapter of it
    is refused, naming why."""
    model, path = _adapter_of(tmp_path, "deepseek_v3", ["q_b_proj", "kv_b_proj"])
    with pytest.raises(ValueError, match="model.layers.0.self_attn.kv_b_proj cannot carry LoRA: fastgen absorbs"):
        load_lora_adapter("a", path, model, max_lora_rank=8)

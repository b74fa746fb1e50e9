"""Hybrid models (Qwen3.5, Qwen3-Next) in the engine: the recurrent-state cache beside the paged KV cache.

Every output is compared with Hugging Face's greedy tokens on the same tiny fp32 checkpoint; the
rest checks the state cache's bookkeeping: its size is the plan's, every slot comes back, a prompt's
state survives being split over SplitFuse chunks, and preemption (mid-prompt or mid-decode)
recomputes it from scratch.
"""

import pydoc_data.topics
import pytest
import torch
import transformers

import fastgen
from fastgen import EngineConfig, SamplingParams
from fastgen.engine import Engine
from fastgen.engine.block_manager import BlockManager
from fastgen.planning.hardware import detect_hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.policy import explain, make_plan
from kit import COMMON, TINY_CONFIGS, _rope_kwargs, run_to_end
from kit_tokenizer import build_tokenizer

NUM_NEW = 12


def _prompts(tokenizer, lengths=(1, 2, 5, 9, 17, 30, 47, 64)) -> list[list[int]]:
    ids = tokenizer.encode(pydoc_data.topics.topics["while"] + pydoc_data.topics.topics["for"])
    return [ids[i * 13: i * 13 + n] for i, n in enumerate(lengths)]


def _engine(path: str, **options) -> Engine:
    engine = Engine.from_config(EngineConfig(model=path, progress=False, **options))
    engine.eos_token_ids = set()
    return engine


def _greedy(engine: Engine, prompts: list[list[int]]) -> list:
    return run_to_end(engine, prompts, SamplingParams(do_sample=False, max_new_tokens=NUM_NEW), max_steps=3000)


# A budget of 3 splits every longer prompt over many chunks, each continuing the last one's state; 64
# takes most prompts whole beside decodes.
@pytest.mark.parametrize("token_budget", [3, 7, 64])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_prompts_chunked_at_any_budget_equal_hf(model_type, token_budget, tiny_checkpoints, hf_reference):
    path = tiny_checkpoints[model_type]
    engine = _engine(path, token_budget=token_budget, max_seqs=min(token_budget, 8))
    prompts = _prompts(engine.tokenizer)
    seqs = _greedy(engine, prompts)
    assert [s.output_token_ids for s in seqs] == [t for t, _ in hf_reference(path, prompts, NUM_NEW)]
    assert engine.block_manager.num_free_state_slots == engine.plan.state_slots


def test_preemption_mid_prompt_and_mid_decode_recomputes_the_state(tiny_checkpoints, hf_reference):
    """Few blocks and fewer state slots than seats: sequences are preempted both while their prompt is
    still being chunked and while they decode, and each resumes from a recomputed state."""
    path = tiny_checkpoints["qwen3_5_text"]
    engine = _engine(path, token_budget=8, max_seqs=6, state_slots=4, num_kv_blocks=24, block_size=4)
    assert engine.plan.state_slots == 4 and engine.plan.max_seqs == 6
    kinds = []
    preempt = engine.scheduler._preempt

    def recording(seq, batch):
        kinds.append("prompt" if seq.num_computed_tokens < seq.num_prompt_tokens else "decode")
        preempt(seq, batch)

    engine.scheduler._preempt = recording
    prompts = _prompts(engine.tokenizer, (3, 40, 6, 33, 1, 25, 12, 47))
    seqs = _greedy(engine, prompts)
    assert {"prompt", "decode"} <= set(kinds), f"preempted only {set(kinds)}"
    assert [s.output_token_ids for s in seqs] == [t for t, _ in hf_reference(path, prompts, NUM_NEW)]
    assert engine.block_manager.num_free_state_slots == 4 and engine.block_manager.num_free_blocks == 24


def test_state_cache_is_the_planned_size_and_comes_back_after_cancelled_requests(tiny_checkpoints):
    path = tiny_checkpoints["qwen3_next"]
    engine = _engine(path, token_budget=16, max_seqs=8)
    plan, config = engine.plan, engine.runner.model.config  # the family's reading: per-layer caches
    assert plan.state_slots == 8 and "Prefix caching" in plan.reasons["state_slots"]
    # A layer's cache: its K/V blocks, then its state pools.
    pools = [t for cache, kv in zip(engine.runner.kv_caches, config.layer_kv_cache_shapes()) for t in cache[len(kv):]]
    assert all(t.shape[0] == plan.state_slots for t in pools)
    state_bytes = sum(t.numel() * t.element_size() for t in pools)
    assert state_bytes == plan.state_slots * config.state_bytes_per_seq(plan.dtype) > 0
    linear_layers = sum(1 for layer in config.layer_states if layer)
    assert len(pools) == 2 * linear_layers
    # Soak: requests cancelled mid-prompt, mid-decode and before they start, among ones that finish.
    prompts = _prompts(engine.tokenizer) * 4
    params = SamplingParams(do_sample=False, max_new_tokens=NUM_NEW)
    ids = [engine.add_request(p, params) for p in prompts]
    for step in range(40):
        engine.step()
        if step % 3 == 0:
            for request_id in ids[step // 3 * 2: step // 3 * 2 + 2]:
                engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_state_slots == 8
    assert engine.block_manager.num_free_blocks == engine.runner.spec.num_blocks


def test_n_choices_each_compute_their_own_state(tiny_checkpoints, hf_reference):
    """`n` > 1 shares no prompt KV on a hybrid model (nothing to resume a state from): every greedy
    choice equals HF's single continuation."""
    path = tiny_checkpoints["qwen3_5_text"]
    with fastgen.pipeline(path, progress=False, token_budget=16) as pipe:
        pipe.engine.eos_token_ids = set()
        prompts = _prompts(pipe.tokenizer, (9, 30))
        out = pipe(prompts, n=3, do_sample=False, max_new_tokens=NUM_NEW)
        assert pipe.engine.block_manager.num_free_state_slots == pipe.engine.plan.state_slots
    expected = [t for t, _ in hf_reference(path, prompts, NUM_NEW)]
    assert [(r.prompt_index, r.token_ids, r.num_cached_tokens) for r in out] == [
        (i, tokens, 0) for i, tokens in enumerate(expected) for _ in range(3)]


def test_planning_table_shows_the_state_cache(tiny_checkpoints, capsys):
    explain(tiny_checkpoints["qwen3_5_text"], hardware=detect_hardware("cpu"))
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("state_slots"))
    assert "linear-attention layers" in row and "Prefix caching" in row


def test_refusals_name_the_problem(tiny_checkpoints):
    facts, cpu = model_facts(tiny_checkpoints["qwen3_5_text"]), detect_hardware("cpu")
    with pytest.raises(ValueError, match="speculative decoding is not implemented for qwen3_5_text"):
        make_plan(facts, cpu, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="state_slots must be at least 1"):
        make_plan(facts, cpu, state_slots=0)
    with pytest.raises(ValueError, match="state_slots must be 0 for llama"):
        make_plan(model_facts(tiny_checkpoints["llama"]), cpu, state_slots=4)
    with pytest.raises(ValueError, match="prefix caching cannot serve"):
        BlockManager(8, 4, enable_prefix_caching=True, num_state_slots=2)


def test_block_manager_hands_out_one_slot_per_sequence():
    bm = BlockManager(16, 4, enable_prefix_caching=False, num_state_slots=2)
    assert bm.allocate(0, list(range(9)), 9) and bm.allocate(1, list(range(3)), 3)
    assert {bm.state_slot(0), bm.state_slot(1)} == {0, 1}
    assert bm.allocate(0, list(range(12)), 12) and bm.state_slot(0) in (0, 1)  # growing keeps its slot
    assert not bm.can_allocate(2, 1) and not bm.allocate(2, [5], 1)  # blocks left, but no slot
    assert bm.fork(0, 3, 9) == 0 and bm.block_table(3) == []  # a forked choice shares nothing
    bm.free(1)
    assert bm.allocate(2, [5], 1) and bm.num_free_state_slots == 0
    bm.free(0), bm.free(2), bm.free(3)
    assert bm.num_free_state_slots == 2 and bm.num_free_blocks == 16


def test_multimodal_checkpoint_serves_its_text_model(tmp_path, caplog):
    """A `qwen3_5` checkpoint (vision tower beside the text model, as the hub ships Qwen3.5) loads its
    text model, says images are not supported, and generates HF's tokens for text."""
    cls, extra = TINY_CONFIGS["qwen3_5_text"]
    text = {**COMMON, **_rope_kwargs(cls, extra), "tie_word_embeddings": False}
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=COMMON["hidden_size"],
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    path = str(tmp_path / "qwen3_5")
    hf.save_pretrained(path)
    build_tokenizer(COMMON["vocab_size"]).save_pretrained(path)
    prompts = [[5, 9, 17, 33, 65, 129, 200][:n] for n in (1, 4, 7)]
    expected = []
    for prompt in prompts:
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected.append(gen[0, len(prompt):].tolist())
    with caplog.at_level("WARNING", logger="fastgen"), fastgen.pipeline(path, progress=False) as pipe:
        out = pipe(prompts, do_sample=False, max_new_tokens=8, ignore_eos=True)
    assert "Image and video input is not supported yet" in caplog.text
    assert [r.token_ids for r in out] == expected


def test_qwen3_5_moe_text_equals_hf(tmp_path, hf_reference):
    """Qwen3.5-MoE: Qwen3.5's layers with the sparse block (top-2 of 8, always renormalised, gated
    shared expert) on every layer, through the engine with chunked prompts."""
    cls, extra = TINY_CONFIGS["qwen3_5_text"]
    config = transformers.Qwen3_5MoeTextConfig(**{**COMMON, **_rope_kwargs(cls, extra), "num_experts": 8,
                                                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                  "shared_expert_intermediate_size": 48})
    torch.manual_seed(0)
    path = str(tmp_path / "qwen3_5_moe_text")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    build_tokenizer(COMMON["vocab_size"]).save_pretrained(path)
    engine = _engine(path, token_budget=8, max_seqs=4)
    prompts = _prompts(engine.tokenizer, (1, 6, 20, 41))
    seqs = _greedy(engine, prompts)
    assert [s.output_token_ids for s in seqs] == [t for t, _ in hf_reference(path, prompts, NUM_NEW)]


def test_gpu_plan_leaves_cuda_graphs_off_for_hybrid_models(tiny_checkpoints):
    from fastgen.planning.hardware import GPUInfo, Hardware

    h100 = Hardware("cuda", 32, frozenset({"avx512f"}), "AVX512", 500 << 30,
                    (GPUInfo("NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 79 << 30, 132),))
    facts = model_facts(tiny_checkpoints["qwen3_next"])
    plan = make_plan(facts, h100)
    assert not plan.cuda_graphs and "cannot replay" in plan.reasons["cuda_graphs"]
    assert plan.state_slots == plan.max_seqs
    with pytest.raises(ValueError, match="cuda_graphs=True cannot serve qwen3_next"):
        make_plan(facts, h100, cuda_graphs=True)
    assert make_plan(model_facts(tiny_checkpoints["llama"]), h100).cuda_graphs

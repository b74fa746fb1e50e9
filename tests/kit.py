"""Test kit: tiny offline Hugging Face checkpoints for every supported model_type, and a
minimal paged-KV driver to run our models the way the engine does.

Weights use a large `initializer_range` so logits are far from flat (at transformers' default
0.02 a tiny random model's top logits tie to within rounding): a greedy parity test on flat logits
would prove nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import transformers

from fastgen.ops import AttentionMetadata
from fastgen.planning.hardware import detect_hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.plan import Plan
from fastgen.planning.policy import make_plan
from kit_tokenizer import build_tokenizer

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Each entry switches on what is distinctive about the family.
TINY_CONFIGS: dict[str, tuple[type, dict]] = {
    "llama": (
        transformers.LlamaConfig,
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
             rope_theta=500000.0),
    ),
    "mistral": (transformers.MistralConfig, dict(sliding_window=12, num_key_value_heads=1)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "qwen3": (
        transformers.Qwen3Config,
        dict(head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ),
    # Sparse MoE: 8 experts, top-2, renormalised top-k weights, sliding window on every layer.
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=12)),
    # Shared expert with its sigmoid gate, q/k/v biases, un-normalised top-k, layer 1 dense (mlp_only_layers).
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96,
             mlp_only_layers=[1], norm_topk_prob=False),
    ),
    # q/k norm, top-3 of 8 with norm_topk_prob.
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    # Falcon-40B layout: grouped q/k/v interleaved per KV group, ln_attn/ln_mlp, biases on.
    "falcon": (
        transformers.FalconConfig,
        dict(new_decoder_architecture=True, num_kv_heads=2, bias=True, ffn_hidden_size=128, rope_theta=20000.0),
    ),
    # Pre-LN OPT with project_in/out; OPT initialises from init_std, not initializer_range. OPT and
    # GPT-2 have no GQA: null the kit's shared num_key_value_heads so config.json does not claim it.
    "opt": (
        transformers.OPTConfig,
        dict(ffn_dim=128, word_embed_proj_dim=32, init_std=0.5, num_key_value_heads=None),
    ),
    "gpt2": (
        transformers.GPT2Config,
        dict(n_inner=96, scale_attn_by_inverse_layer_idx=True, num_key_value_heads=None),
    ),
    "phi": (
        transformers.PhiConfig,
        dict(partial_rotary_factor=0.5, qk_layernorm=True, intermediate_size=256),
    ),
    # LongRoPE with original_max_position_embeddings 128 > the longest parity sequence (64 + 24
    # tokens): short_factor and the attention factor (from 512 / 128) are what the parity tests
    # check; tests/test_longrope.py crosses the boundary.
    "phi3": (
        transformers.Phi3Config,
        dict(partial_rotary_factor=0.5, sliding_window=20, original_max_position_embeddings=128,
             rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.5, 4.0],
                           "long_factor": [1.0, 3.0, 7.0, 16.0]}),
    ),
    "gemma": (transformers.GemmaConfig, dict(head_dim=32, num_key_value_heads=1)),
    # Untied: with a tied head the sqrt(hidden)-scaled embedding dominates the normalised residual
    # branches and a random model only ever predicts its input token again.
    "gemma2": (
        transformers.Gemma2Config,
        dict(head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
             sliding_window=12, tie_word_embeddings=False),
    ),
    # Local and global layers (window 12 < the longer prompts) with their own rope bases, linear
    # scaling on the global one, query_pre_attn_scalar, per-head q/k norms, four norms per layer.
    # Untied for the reason gemma2 is.
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=12, tie_word_embeddings=False,
             layer_types=["sliding_attention", "full_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
    ),
    # Four layers, local/global alternating (window 12), the last two sharing the first two's KV
    # (num_kv_shared_layers, with double-wide MLPs); global layers with their own head_dim (32 vs 24)
    # and one KV head whose V is K's projection (attention_k_eq_v), proportional rope on a quarter of
    # their pairs; per-layer input embeddings (P = 8); the MoE block (top-2 of 8) beside every MLP;
    # final-logit soft-capping. Untied for the reason gemma2 is.
    "gemma4_text": (
        transformers.Gemma4TextConfig,
        dict(num_hidden_layers=4, head_dim=24, global_head_dim=32, num_global_key_value_heads=1,
             attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True, sliding_window=12,
             layer_types=["sliding_attention", "full_attention"] * 2, vocab_size_per_layer_input=VOCAB,
             hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=8, top_k_experts=2,
             moe_intermediate_size=32, final_logit_softcapping=8.0, tie_word_embeddings=False,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1000000.0}}),
    ),
    # Post-norms only, q/k RMSNorm over the whole projection (all heads), GQA.
    "olmo2": (transformers.Olmo2Config, dict()),
    # OLMo 2 plus sliding (window 12) and full layers, each with its own rope base.
    "olmo3": (
        transformers.Olmo3Config,
        dict(sliding_window=12, layer_types=["sliding_attention", "full_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}),
    ),
    # NoPE on every other layer (no_rope_layers), tied embeddings.
    "smollm3": (transformers.SmolLM3Config, dict(no_rope_layers=[1, 0], tie_word_embeddings=True)),
    # All four multipliers away from 1 (the attention one replacing head_dim ** -0.5).
    "granite": (
        transformers.GraniteConfig,
        dict(embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0),
    ),
    # Layer 0 dense (first_k_dense_replace), layer 1 MoE: sigmoid router with group-limited top-k
    # (2 of 4 groups), renormalised and scaled weights, one shared expert; partial rotary, q/k norm.
    "glm4_moe": (
        transformers.Glm4MoeConfig,
        dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
             n_group=4, topk_group=2, routed_scaling_factor=1.5, first_k_dense_replace=1, use_qk_norm=True,
             attention_bias=True),
    ),
    # Attention sinks, a sliding layer (window 12, below the longer prompts) then a full one, q/k/v/o
    # biases, top-2 of 8 biased experts with a clamp (swiglu_limit 3) that bites at this init, YaRN
    # without truncation (gpt-oss's own rope), head_dim 32 != hidden / heads.
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, head_dim=32, sliding_window=12,
             layer_types=["sliding_attention", "full_attention"], swiglu_limit=3.0, rope_theta=150000.0,
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 128}),
    ),
    # Layer 0: rotary (interleaved pairs, llama3 scaling) with chunked local attention (chunks of 12,
    # below the longer prompts) and the weightless q/k norm, dense MLP (intermediate_size_mlp 96);
    # layer 1: NoPE, full attention, temperature tuning that bites (floor_scale 8), the MoE
    # (interleave_moe_layer_step 2): top-2 of 8 sigmoid-scored experts scaling their inputs, plus the
    # shared expert. q/k/v/o biases, head_dim 32 != hidden / heads.
    "llama4_text": (
        transformers.Llama4TextConfig,
        dict(head_dim=32, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=8,
             num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=12,
             use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8, attn_scale=0.5, attention_bias=True,
             rope_theta=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}),
    ),
    # MLA (latent cache of 32 + 16 values, q LoRA, v_head_dim 24 != qk 48, interleaved rope with YaRN
    # whose mscale_all_dim scales the softmax), layer 0 dense (first_k_dense_replace), layer 1 8 routed
    # experts in 4 groups of which 2 stay eligible, top-2, plus a shared expert. The router's
    # score-correction bias (zero at HF's init) and q_lora_rank=None are tests/test_deepseek_v3.py's.
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32,
             v_head_dim=24, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, num_experts_per_tok=2,
             n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
             rope_interleave=True, num_mtp_layers=0,
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ),
    # Hybrid: Gated DeltaNet layers (a recurrent state per sequence: conv window of 3, 4 value heads
    # grouped 2 per key head) then gated full attention with zero-centred q/k norms and a quarter of
    # head_dim rotated.
    "qwen3_5_text": (
        transformers.Qwen3_5TextConfig,
        dict(head_dim=32, layer_types=["linear_attention", "linear_attention", "full_attention"], num_hidden_layers=3,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, partial_rotary_factor=0.25),
    ),
    # Qwen3.5's layers with Qwen3-Next's fused, per-key-head grouped projections, and the MoE block
    # (top-2 of 8, renormalised, gated shared expert) on layer 0 only (mlp_only_layers).
    "qwen3_next": (
        transformers.Qwen3NextConfig,
        dict(head_dim=32, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
             mlp_only_layers=[1], norm_topk_prob=True, partial_rotary_factor=0.25),
    ),
}


def _rope_kwargs(cls: type, extra: dict) -> dict:
    """transformers 5 takes rope settings as `rope_parameters`; 4.x as rope_theta/rope_scaling."""
    extra = dict(extra)
    if "rope_parameters" in extra:  # given per layer type (Gemma 3): as it is
        return extra
    scaling = extra.pop("rope_scaling", None)
    theta = extra.pop("rope_theta", 10000.0)
    if "rope_parameters" in cls.__init__.__code__.co_varnames or transformers.__version__ >= "5":
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            params.update(scaling)
        extra["rope_parameters"] = params
    else:
        extra.update(rope_theta=theta, rope_scaling=scaling)
    return extra


_ZERO_INITIALISED = ("e_score_correction_bias",)
"""Checkpoint tensors HF initialises to zero that a random parity model should still exercise
(the router bias that steers GLM-4.5's expert choice)."""

_ONE_INITIALISED = ("layer_scalar", "router.scale", "router.per_expert_scale")
"""Checkpoint tensors HF initialises to one (Gemma 4's layer output scale and router scales): drawn
around one instead, so a model that ignored them would differ."""


def build_checkpoint(path: str, model_type: str, seed: int = 0, **overrides) -> str:
    """Save a tiny fp32 checkpoint of `model_type` (weights, config, tokenizer) at `path`."""
    cls, extra = TINY_CONFIGS[model_type]
    kwargs = {**COMMON, **_rope_kwargs(cls, extra), **overrides}
    config = cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            # HF initialises these to zero, which would leave what they do untested.
            if name.endswith(_ZERO_INITIALISED):
                tensor.normal_(0.0, 0.5)
            elif name.endswith(_ONE_INITIALISED):
                tensor.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(VOCAB).save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Hugging Face's greedy continuation of each prompt with EOS off: (token ids, fp32 log-probs
    `[max_new_tokens, vocab]` of the model at each step)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = []
    for prompt in prompts:
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        logprobs = torch.log_softmax(torch.stack(gen.logits, dim=1)[0].float(), dim=-1)
        out.append((gen.sequences[0, len(prompt):].tolist(), logprobs))
    return out


def rewrite_config(path: str, **changes) -> None:
    """Edit a saved config.json in place (None deletes a key)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


MAX_STATE_SLOTS = 64
"""Recurrent-state slots `PagedRunner` allocates (NaN-filled: a first chunk must never read its slot)."""


@dataclass
class PagedSeq:
    """One sequence driven through the paged KV cache by `PagedRunner`."""

    token_ids: list[int]
    blocks: list[int]
    num_computed_tokens: int = 0
    state_slot: int = 0


class PagedRunner:
    """Drives a model step by step over a paged KV cache, like the engine but without a scheduler.

    Blocks are handed out in a shuffled order so sequences' blocks are not contiguous. `backend`
    is the `AttentionMetadata.backend` of every step.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int = 256, block_size: int = 8, seed: int = 0,
                 backend: str = "auto") -> None:
        cfg = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        # A layer's cache: its K/V blocks, then the pools of its per-sequence state (hybrid models), a
        # slot per sequence in the order `add` creates them.
        self.kv_caches = [tuple(torch.zeros(num_blocks, block_size, heads, width, dtype=dtype)
                                for heads, width in shapes)
                          + tuple(torch.full((MAX_STATE_SLOTS, *shape), float("nan"), dtype=state_dtype or dtype)
                                  for shape, state_dtype in states)
                          for shapes, states in zip(cfg.layer_kv_cache_shapes(), cfg.layer_state_shapes())]
        self.num_seqs = 0
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def add(self, token_ids: list[int]) -> PagedSeq:
        """A new sequence holding `token_ids`, nothing computed yet (and a state slot of its own)."""
        self.num_seqs += 1
        return PagedSeq(list(token_ids), [], state_slot=(self.num_seqs - 1) % MAX_STATE_SLOTS)

    @torch.inference_mode()
    def step(self, chunks: list[tuple[PagedSeq, int]]) -> torch.Tensor:
        """Compute `n` new tokens for each `(seq, n)`; returns fp32 logits of every new token `[T, V]`."""
        input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq, n in chunks:
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free_blocks.pop())
            for pos in range(begin, end):
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
                slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            seq_lens.append(end)
            starts.append(starts[-1] + n)
        max_blocks = max(len(seq.blocks) for seq, _ in chunks)
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for i, (seq, _) in enumerate(chunks):
            tables[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            backend=self.backend,
            state_slots=torch.tensor([seq.state_slot for seq, _ in chunks], dtype=torch.int32),
        )
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), md, self.kv_caches)
        for seq, n in chunks:
            seq.num_computed_tokens += n
        return self.model.compute_logits(hidden)


def run_to_end(engine, prompts: list[list[int]], params, max_steps: int) -> list:
    """Queue every prompt on `engine` and step it until all are done (asserting it takes fewer than
    `max_steps` steps); returns each prompt's first `Sequence`, in prompt order."""
    seqs = [engine.sequences(engine.add_request(p, params))[0] for p in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < max_steps
    return seqs


def cpu_plan(path: str, **overrides) -> Plan:
    """The policy's plan for the checkpoint at `path` on this CPU, with `overrides` (engine keywords):
    what a test builds a `RunnerSpec` from when it drives a runner without an engine."""
    return make_plan(model_facts(path), detect_hardware("cpu"), **overrides)

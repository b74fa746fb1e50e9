"""Every model family at one size: prefill and decode tok/s of a ~0.5B random shape next to llama's.

    .venv/bin/python scripts/bench_families.py [--families llama,gemma3_text,...] [--prompt-len 512]
        [--prefill-prompts 8] [--decode-tokens 64] [--decode-batch 16]

Each family gets the bench Llama's shape (bench_common: hidden 1536, 20 layers, head_dim 64, 24
query and 6 KV heads, the demo tokenizer's vocabulary) with its own distinctive parts switched on at
realistic proportions: local/global or sliding layers with a 512-token window (so the 512-token
prompts reach it), NoPE layers, MLA's latent cache, MoE layers of 8 experts (2 active, 512 wide; total
parameters near the dense shape's), attention sinks, per-layer inputs and KV shared across layers. Random bf16 weights,
built once into a cache directory; each family runs in the plan's defaults (dtype, compile, token
budget) in a fresh pipeline after an untimed warm-up:
- prefill: `--prefill-prompts` prompts of `--prompt-len` random tokens, one output token each,
  submitted together; tok/s = prompt tokens / wall time;
- decode: one 16-token prompt and `--decode-tokens` new tokens (batch 1), then `--decode-batch` such
  requests together; tok/s = generated tokens / wall time.
A family far below llama's ratio has a slow path. Prints a table and writes JSON
(bench_results/families.json). A measurement, not a test; name the machine (`lscpu`) with it.

    .venv/bin/python scripts/bench_families.py --contexts 1024,8192,32768 --families llama,qwen3_5_text

measures instead batch-1 decode after a long prompt: for each context, one prompt of that many random
tokens is prefilled (timed apart) and then `--decode-tokens` tokens are decoded, after an untimed pass
at the same length (so no compile of the new shapes is timed); tok/s = decoded
tokens / decode time. Full attention reads every earlier token's K/V per new token, a linear layer
only its fixed state, so a hybrid should slow far less with context. The checkpoints' config says
`max_position_embeddings` 4096; this mode raises it to hold the longest context (weights do not
depend on it; rotary without scaling).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import transformers

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)

import fastgen  # noqa: E402
from bench_common import time_one_sequence, write_json  # noqa: E402
from fastgen.engine import DEMO_MODEL_DIR  # noqa: E402
from fastgen.models.gguf import gguf_cache_dir  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 20, 1536, 24, 6, 64, 4096
WINDOW = 512


def _pattern(unit: list, layers: int = LAYERS) -> list:
    """`unit` repeated over the layers (cut to fit)."""
    return (unit * (layers // len(unit) + 1))[:layers]


def _types(num_local: int) -> list[str]:
    """`num_local` sliding layers, then a full one, repeated."""
    return _pattern(["sliding_attention"] * num_local + ["full_attention"])


def _rope(local_theta: float, global_theta: float) -> dict:
    return {"sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            "full_attention": {"rope_type": "default", "rope_theta": global_theta}}


MOE = dict(moe_intermediate_size=512, num_experts_per_tok=2)
"""Routed experts: 2 of 8, 512 wide, active per token, plus what each family adds (a shared expert)."""

LINEAR = dict(linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_conv_kernel_dim=4)
"""Gated DeltaNet sizes of the hybrid shapes."""

FAMILIES: dict[str, tuple[type, dict]] = {
    "llama": (transformers.LlamaConfig, {}),
    "smollm3": (transformers.SmolLM3Config, dict(no_rope_layers=_pattern([1, 1, 1, 0]))),
    "olmo2": (transformers.Olmo2Config, {}),
    "olmo3": (transformers.Olmo3Config, dict(sliding_window=WINDOW, layer_types=_types(3),
                                             rope_parameters=_rope(10000.0, 500000.0))),
    "granite": (transformers.GraniteConfig, dict(embedding_multiplier=12.0, attention_multiplier=0.015625,
                                                 residual_multiplier=0.22, logits_scaling=8.0)),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(
        head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW, layer_types=_types(5),
        rope_parameters=_rope(10000.0, 1000000.0))),
    "gemma4_text": (transformers.Gemma4TextConfig, dict(
        head_dim=HEAD_DIM, global_head_dim=2 * HEAD_DIM, sliding_window=WINDOW, layer_types=_types(4),
        num_kv_shared_layers=8, hidden_size_per_layer_input=64,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}})),
    "gpt_oss": (transformers.GptOssConfig, dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=512, head_dim=HEAD_DIM,
        sliding_window=128, layer_types=_types(1))),
    "glm4_moe": (transformers.Glm4MoeConfig, dict(
        n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        use_qk_norm=True, **MOE)),
    "deepseek_v3": (transformers.DeepseekV3Config, dict(
        num_key_value_heads=HEADS, kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=32, qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        num_mtp_layers=0, **MOE)),
    "llama4_text": (transformers.Llama4TextConfig, dict(
        head_dim=HEAD_DIM, intermediate_size=512, intermediate_size_mlp=INTERMEDIATE, num_local_experts=8,
        num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=_pattern([1, 1, 1, 0]),
        attention_chunk_size=WINDOW, use_qk_norm=True)),
    # Hybrids: three Gated DeltaNet layers to one gated full-attention layer (the default interval of 4),
    # linear heads sized like the attention's projections (8 key and 16 value heads of 64).
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, dict(head_dim=HEAD_DIM, **LINEAR)),
    "qwen3_next": (transformers.Qwen3NextConfig, dict(
        head_dim=HEAD_DIM, num_experts=8, shared_expert_intermediate_size=512, norm_topk_prob=True, **LINEAR, **MOE)),
}


def checkpoint(model_type: str) -> str:
    """The family's ~0.5B random bf16 checkpoint with the demo tokenizer (built once)."""
    target = os.path.join(os.path.dirname(gguf_cache_dir()), "bench-families", model_type)
    if os.path.isfile(os.path.join(target, "model.safetensors.index.json")) or \
            os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    cls, extra = FAMILIES[model_type]
    tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    kwargs = dict(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
                  tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                  pad_token_id=tok.pad_token_id)
    if model_type == "gemma4_text":
        kwargs["vocab_size_per_layer_input"] = len(tok)
    config = cls(**{**kwargs, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    print(f"building {model_type}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters "
          f"in {target}", flush=True)
    model.save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)
    return target


def _timed(pipe: fastgen.Pipeline, prompts: list[list[int]], new_tokens: int) -> float:
    started = time.perf_counter()
    pipe(prompts, do_sample=False, max_new_tokens=new_tokens, ignore_eos=True)
    return time.perf_counter() - started


def measure(model_type: str, args: argparse.Namespace) -> dict:
    path = checkpoint(model_type)
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    pipe = fastgen.pipeline(path, progress=False)
    ready = time.perf_counter() - started
    vocab = pipe.engine.vocab_size
    prefill = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prefill_prompts)]
    short = [torch.randint(3, vocab, (16,), generator=gen).tolist() for _ in range(args.decode_batch)]
    _timed(pipe, prefill[:2], 2)  # warm-up: first touches and compiles
    _timed(pipe, short[:2], 4)
    prefill_s = _timed(pipe, prefill, 1)
    decode_1 = _timed(pipe, short[:1], args.decode_tokens)
    decode_b = _timed(pipe, short, args.decode_tokens)
    plan = pipe.engine.plan
    row = {"model_type": model_type, "ready_s": ready, "dtype": str(plan.dtype).removeprefix("torch."),
           "compile": plan.compile, "prefill_tok_s": args.prefill_prompts * args.prompt_len / prefill_s,
           "decode_b1_tok_s": args.decode_tokens / decode_1,
           f"decode_b{args.decode_batch}_tok_s": args.decode_batch * args.decode_tokens / decode_b}
    pipe.destroy()
    return row


def _allow_context(path: str, context: int) -> None:
    """Raise the checkpoint's `max_position_embeddings` to `context` if it is below."""
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("max_position_embeddings", 0) < context:
        config["max_position_embeddings"] = context
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)


def measure_contexts(model_type: str, args: argparse.Namespace) -> dict:
    """Batch-1 decode tok/s after a prompt of each of `args.contexts` tokens (prefill timed apart)."""
    contexts = [int(c) for c in args.contexts.split(",")]
    path = checkpoint(model_type)
    _allow_context(path, max(contexts) + args.decode_tokens + 16)
    pipe = fastgen.pipeline(path, progress=False)
    engine, gen = pipe.engine, torch.Generator().manual_seed(0)
    _timed(pipe, [[5] * 16], 4)  # warm-up
    row = {"model_type": model_type, "dtype": str(engine.plan.dtype).removeprefix("torch.")}
    for context in contexts:
        # An untimed pass first: the step shapes of a longer context (block-table width) compile once.
        for timed in (False, True):
            prompt = torch.randint(3, engine.vocab_size, (context,), generator=gen).tolist()
            prefill_s, decode_s, _ = time_one_sequence(engine, prompt, args.decode_tokens + 1)
        row[f"prefill_{context}_tok_s"] = context / prefill_s
        row[f"decode_{context}_tok_s"] = args.decode_tokens / decode_s
        print(f"{model_type:12s} context {context:6d}: prefill {row[f'prefill_{context}_tok_s']:7.1f} tok/s, "
              f"decode B=1 {row[f'decode_{context}_tok_s']:6.2f} tok/s", flush=True)
    pipe.destroy()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--contexts", default="",
                        help="comma-separated prompt lengths: measure batch-1 decode after each instead")
    parser.add_argument("--json", default="bench_results/families.json")
    args = parser.parse_args()
    families = args.families.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        sys.exit(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if args.contexts:
        rows = [measure_contexts(model_type, args) for model_type in families]
        write_json(args.json.replace("families.json", "families_context.json"), {"args": vars(args), "rows": rows})
        return
    rows = []
    batch_key = f"decode_b{args.decode_batch}_tok_s"
    for model_type in families:
        row = measure(model_type, args)
        rows.append(row)
        base = rows[0] if rows[0]["model_type"] == "llama" else None
        ratios = "" if base is None else (f"  vs llama: prefill {row['prefill_tok_s'] / base['prefill_tok_s']:.2f}x, "
                                          f"decode {row['decode_b1_tok_s'] / base['decode_b1_tok_s']:.2f}x / "
                                          f"{row[batch_key] / base[batch_key]:.2f}x")
        print(f"{model_type:12s} ready {row['ready_s']:5.1f} s  prefill {row['prefill_tok_s']:7.1f} tok/s  decode "
              f"B=1 {row['decode_b1_tok_s']:6.1f}  B={args.decode_batch} {row[batch_key]:7.1f} tok/s{ratios}",
              flush=True)
    write_json(args.json, {"args": vars(args), "rows": rows})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

"""Random PEFT LoRA adapters for the tiny checkpoints, and Hugging Face peft's greedy tokens as the oracle."""

from dataclasses import dataclass
from pathlib import Path

import peft
import torch
import transformers

from kit import build_checkpoint, hf_greedy

NUM_NEW = 10
"""Tokens generated per prompt."""
LENGTHS = [1, 3, 9, 21, 40]
"""Prompt lengths: 40 is over `ENGINE`'s token budget, so it is chunked."""
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=24, block_size=4, token_budget=16,
              max_seqs=8, progress=False)
"""Engine options of the LoRA tests: a KV cache small enough for the mixed batch to preempt."""
ADAPTERS = {"a": dict(seed=1, r=4, lora_alpha=8), "b": dict(seed=2, r=8, lora_alpha=16, use_rslora=True)}
"""Two adapters of different ranks (both under max_lora_rank), one with rsLoRA's scale."""

TARGETS: dict[str, list[str]] = {
    # Merged q/k/v and gate/up in ours, separate in the checkpoint (stacked along the rank).
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # Renamed (dense -> o_proj), a plain fc1/fc2 MLP with biases.
    "phi": ["q_proj", "v_proj", "dense", "fc1", "fc2"],
    # Already merged in the checkpoint: whole-module pairs.
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
"""Per family, the modules the test adapters adapt (HF's names, as a PEFT user writes them)."""

LAYOUT_TARGETS: dict[str, list[str]] = {
    # Conv1D modules (PEFT writes fan_in_fan_out), renamed onto the shared attention and MLP.
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    # `model.decoder.` names, out_proj renamed.
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    # Fused q/k/v interleaved per KV group: B's rows regrouped as the weight's.
    "falcon": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    # Interleaved rotary pairs: q/k B rows permuted per head; the MoE layer's shared expert.
    "llama4_text": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # KV-sharing layers (no k/v of their own) and a global layer whose V is K's; per-layer input linears.
    "gemma4_text": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "per_layer_input_gate", "per_layer_projection"],
    # Attention only: the experts are parameters, not linears.
    "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj"],
    # Attention: peft turns gate/up/down_proj targets of these MoE families into `target_parameters` on
    # the fused experts (which fastgen refuses), dense and shared MLPs included.
    "glm4_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    # MLA's low-rank query and latent projections (not kv_b_proj: absorbed, see test_lora_api.py).
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
    # Gated DeltaNet's projections (b and a merged in ours) beside gated full attention.
    "qwen3_5_text": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                     "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
    # Qwen3-Next's per-key-head grouped projections: B's rows reordered as the weight's (no MLP: glm4_moe's reason).
    "qwen3_next": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"],
}
"""`TARGETS` of the families whose checkpoint layout is rewritten at load (`DecoderLM.adapt_lora_pair`),
checked on `LAYOUT_LENGTHS` only (one rank)."""
LAYOUT_LENGTHS = [9, 40]
"""Their prompt lengths: still a chunked prompt and a KV cache that preempts, in fewer steps."""


def save_adapter(base_path: str, out_path: str, target_modules: list[str], seed: int, r: int, lora_alpha: float,
                 use_rslora: bool = False) -> str:
    """Save a PEFT LoRA adapter of the checkpoint at `base_path` with random A and B (peft's
    `init_lora_weights=False`: nn.Linear's init for both, so the adapter changes the outputs)."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, use_rslora=use_rslora, target_modules=target_modules,
                             init_lora_weights=False)
    peft.get_peft_model(hf, config).save_pretrained(out_path)
    return out_path


def greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """A Hugging Face (or peft) model's greedy continuation of each prompt, EOS off."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            out.append(ids[0, len(prompt):].tolist())
    return out


def peft_greedy(base_path: str, adapter_path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """peft's greedy continuation of each prompt under the adapter at `adapter_path`, EOS off."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return greedy(peft.PeftModel.from_pretrained(hf, adapter_path).eval(), prompts, max_new_tokens)


@dataclass
class Family:
    """A tiny checkpoint, its two adapters, the prompts and the oracle's tokens for each."""

    path: str
    adapters: dict[str, str]
    prompts: list[list[int]]
    want: dict[str | None, list[list[int]]]
    """Greedy tokens per prompt: None = the base model (HF), else the adapter's (peft)."""


def build_family(root: Path, model_type: str) -> Family:
    """A tiny `model_type` checkpoint under `root`, its adapters `ADAPTERS` and the oracle's tokens."""
    path = build_checkpoint(str(root / "base"), model_type)
    targets = {**TARGETS, **LAYOUT_TARGETS}[model_type]
    adapters = {name: save_adapter(path, str(root / name), targets, **cfg) for name, cfg in ADAPTERS.items()}
    lengths = LAYOUT_LENGTHS if model_type in LAYOUT_TARGETS else LENGTHS
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    want = {None: [tokens for tokens, _ in hf_greedy(path, prompts, NUM_NEW)]}
    want |= {name: peft_greedy(path, adapter, prompts, NUM_NEW) for name, adapter in adapters.items()}
    return Family(path, adapters, prompts, want)

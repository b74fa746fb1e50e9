"""deepseek_v3 beyond the shared parity tests: the paths the kit's entry leaves off (no q LoRA, a
non-zero score-correction bias, one expert group as Kimi-K2 has, multi-token-prediction layers in the
checkpoint, the `kimi_k2` model_type), fields it refuses by name, and the KV bytes the planner counts
for real shapes."""

import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fastgen.models.config import ModelConfig
from fastgen.models.loader import load_model
from fastgen.planning.model_facts import facts_from_config
from kit import PagedRunner, build_checkpoint, rewrite_config

NUM_DECODE = 8


def _compare_with_hf(ours_path: str, hf_path: str) -> None:
    """Prompt logits of three prompts in one flat batch, then greedy decodes, against HF's."""
    ours = load_model(ours_path, progress=False).model
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = [list(range(3, 40)), list(range(100, 109)), [77]]
    runner = PagedRunner(ours, block_size=4)
    seqs = [runner.add(p) for p in prompts]
    logits = runner.step([(s, len(s.token_ids)) for s in seqs])
    offset = 0
    with torch.inference_mode():
        for prompt in prompts:
            expected = hf(torch.tensor([prompt])).logits[0]
            assert expected.std() > 1.0
            torch.testing.assert_close(logits[offset:offset + len(prompt)], expected, rtol=1e-4, atol=1e-4)
            offset += len(prompt)
    next_tokens = logits[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1].argmax(-1).tolist()
    for _ in range(NUM_DECODE):
        for seq, tok in zip(seqs, next_tokens):
            seq.token_ids.append(tok)
        next_tokens = runner.step([(s, 1) for s in seqs]).argmax(-1).tolist()
    for seq, prompt in zip(seqs, prompts):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_DECODE, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        assert seq.token_ids[len(prompt):] == expected.tolist()


def _set_correction_bias(path: str, seed: int) -> None:
    """Give every router a score-correction bias large enough to change which groups and experts win."""
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    gen = torch.Generator().manual_seed(seed)
    for name in [n for n in weights if n.endswith("e_score_correction_bias")]:
        weights[name] = 0.5 * torch.randn(weights[name].shape, generator=gen)
    save_file(weights, file, metadata={"format": "pt"})


def test_no_q_lora_and_a_correction_bias_match_hf(tmp_path):
    path = build_checkpoint(str(tmp_path / "ds"), "deepseek_v3", q_lora_rank=None, rope_interleave=False)
    _set_correction_bias(path, seed=3)
    _compare_with_hf(path, path)


def test_kimi_k2_style_checkpoint_loads_the_same_way(tmp_path):
    """One expert group (n_group = topk_group = 1), a multi-token-prediction layer in the checkpoint
    (skipped), and the same files declared as `kimi_k2`."""
    hf_path = build_checkpoint(str(tmp_path / "hf"), "deepseek_v3", n_group=1, topk_group=1, num_mtp_layers=1,
                               n_shared_experts=2)
    _set_correction_bias(hf_path, seed=4)
    ours = str(tmp_path / "kimi")
    shutil.copytree(hf_path, ours)
    rewrite_config(ours, model_type="kimi_k2")
    _compare_with_hf(ours, hf_path)


@pytest.mark.parametrize("change, message", [
    (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
    (dict(topk_method="group_limited_greedy"), "topk_method"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), "fp8"),
    (dict(n_group=3), "n_group"),
    (dict(rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0}), "mrope"),
])
def test_unimplemented_config_fields_are_refused_by_name(change, message, tiny_checkpoints, tmp_path):
    path = str(tmp_path / "bad")
    shutil.copytree(tiny_checkpoints["deepseek_v3"], path)
    rewrite_config(path, **change)
    with pytest.raises(ValueError, match=message):
        load_model(path, progress=False)


def test_planner_counts_the_latent_cache_of_real_shapes():
    """DeepSeek-V3 (61 layers, 512 + 64 latent values) and gpt-oss-120b (36 layers of 8 KV heads of 64) at
    their HF defaults, built on the meta device: KV bytes per token in bf16, and MLA's per-rank copy."""
    deepseek = facts_from_config(ModelConfig.from_dict(transformers.DeepseekV3Config().to_dict()))
    assert deepseek.kv_bytes(torch.bfloat16) == 61 * (512 + 64) * 2
    assert deepseek.kv_bytes(torch.bfloat16, 8) == 61 * (512 + 64) * 2
    assert deepseek.num_experts == 256 and deepseek.active_params < deepseek.num_params / 10
    oss = facts_from_config(ModelConfig.from_dict(transformers.GptOssConfig().to_dict()))
    assert oss.kv_bytes(torch.bfloat16) == 36 * 2 * 8 * 64 * 2
    assert oss.num_experts == 128

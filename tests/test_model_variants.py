"""Family variants that TINY_CONFIGS (one entry per model_type) cannot hold, the config aliases of
GPT-2 / OPT / Falcon, old checkpoint layouts, and the variants we refuse with a clear error.

Each variant runs the same HF parity check as tests/test_model_parity.py (prompt logits close,
32 greedy tokens equal, outputs varied).
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import test_model_parity as parity
from fastgen.models.config import ModelConfig
from fastgen.models.falcon import FalconForCausalLM
from fastgen.models.gpt2 import GPT2LMHeadModel
from fastgen.models.loader import load_model
from fastgen.models.opt import OPTForCausalLM
from kit import PagedRunner, build_checkpoint, rewrite_config

PROMPT = [5, 17, 300, 42, 99, 7, 256, 3, 11, 480, 64, 23, 150, 8, 77, 401, 12, 9, 333, 2]

VARIANTS = {
    # falcon-7b: one K/V head, the fused projection is [num_heads + 2, head_dim], no biases.
    "falcon-multi-query": ("falcon", dict(new_decoder_architecture=False, multi_query=True, bias=False)),
    # falcon-rw without alibi: plain multi-head ([num_heads, 3, head_dim] rows), sequential block.
    "falcon-sequential-mha": (
        "falcon", dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, num_kv_heads=None),
    ),
    # Falcon-180B style: grouped K/V with one LayerNorm shared by attention and MLP.
    "falcon-new-arch-one-norm": ("falcon", dict(num_ln_in_parallel_attn=1)),
    # opt-350m: LayerNorm after each block, no final norm; here also without biases.
    "opt-post-layernorm": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=None, enable_bias=False)),
    # OPT without LayerNorm weights (layer_norm_elementwise_affine=False).
    "opt-no-affine-norm": ("opt", dict(layer_norm_elementwise_affine=False)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_hf(variant, tmp_path):
    model_type, overrides = VARIANTS[variant]
    path = build_checkpoint(str(tmp_path / variant), model_type, **overrides)
    parity.test_prefill_logits_and_greedy_match_hf(model_type, {model_type: path})


def _logits(path: str) -> torch.Tensor:
    """Logits of PROMPT as a prefill chunk then two decode steps."""
    runner = PagedRunner(load_model(path, progress=False).model, num_blocks=16, block_size=4)
    seq = runner.add(PROMPT)
    return torch.cat([runner.step([(seq, len(PROMPT) - 2)]), runner.step([(seq, 1)]), runner.step([(seq, 1)])])


def _resave(src: str, dst: str, tensors: dict[str, torch.Tensor]) -> str:
    """`src`'s config in `dst` with `tensors` as its weights."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_old_gpt2_layout_without_prefix_and_with_mask_buffers(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["gpt2"]
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    old = _resave(src, str(tmp_path / "old"), tensors)
    torch.testing.assert_close(_logits(old), _logits(src), rtol=0, atol=0)


def test_old_opt_layout_without_model_prefix(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["opt"]
    tensors = {k.removeprefix("model."): v for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    assert all(k.startswith("decoder.") for k in tensors)
    old = _resave(src, str(tmp_path / "old"), tensors)
    torch.testing.assert_close(_logits(old), _logits(src), rtol=0, atol=0)


def test_gpt2_conv1d_weight_with_wrong_shape_is_named(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["gpt2"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(64, 100)
    bad = _resave(src, str(tmp_path / "bad"), tensors)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight.*shape"):
        load_model(bad, progress=False)


def test_falcon_alibi_is_refused_at_load(tiny_checkpoints, tmp_path):
    path = str(tmp_path / "alibi")
    shutil.copytree(tiny_checkpoints["falcon"], path)
    rewrite_config(path, alibi=True)
    with pytest.raises(ValueError, match="alibi=True.*not supported.*ALiBi"):
        load_model(path, progress=False)


def _raw(tiny_checkpoints, model_type: str, **changes) -> dict:
    with open(os.path.join(tiny_checkpoints[model_type], "config.json"), encoding="utf-8") as f:
        return {**json.load(f), **changes}


@pytest.mark.parametrize(
    ("model_cls", "model_type", "changes", "message"),
    [
        (FalconForCausalLM, "falcon", dict(parallel_attn=False), "new_decoder_architecture with parallel_attn=False"),
        (FalconForCausalLM, "falcon", dict(num_kv_heads=3), "not a multiple of num_kv_heads"),
        (FalconForCausalLM, "falcon", dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=2),
         "2 K/V heads but its attention layout has 4"),
        (GPT2LMHeadModel, "gpt2", dict(add_cross_attention=True), "cross-attention needs encoder states"),
        (GPT2LMHeadModel, "gpt2", dict(num_key_value_heads=2), "no grouped-query variant"),
        (OPTForCausalLM, "opt", dict(num_key_value_heads=1), "no grouped-query variant"),
    ],
)
def test_unsupported_variants_are_refused(tiny_checkpoints, model_cls, model_type, changes, message):
    with pytest.raises(ValueError, match=message):
        model_cls(ModelConfig.from_dict(_raw(tiny_checkpoints, model_type, **changes)))


def test_config_aliases_of_gpt2_opt_falcon():
    gpt2 = ModelConfig.from_dict({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12,
                                  "n_head": 12, "n_positions": 1024, "n_inner": None, "layer_norm_epsilon": 1e-5})
    shape = (gpt2.hidden_size, gpt2.num_layers, gpt2.num_heads, gpt2.num_kv_heads, gpt2.head_dim)
    assert shape == (768, 12, 12, 12, 64)
    assert (gpt2.max_position_embeddings, gpt2.intermediate_size, gpt2.rms_norm_eps) == (1024, 3072, 1e-5)
    assert gpt2.tie_word_embeddings  # HF's GPT-2 default when config.json is silent

    opt = ModelConfig.from_dict({"model_type": "opt", "vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12,
                                 "num_attention_heads": 12, "ffn_dim": 3072, "max_position_embeddings": 2048})
    assert (opt.intermediate_size, opt.num_kv_heads, opt.tie_word_embeddings) == (3072, 12, True)

    falcon_7b = {"model_type": "falcon", "vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32,
                 "num_attention_heads": 71, "multi_query": True, "new_decoder_architecture": False}
    assert ModelConfig.from_dict(falcon_7b).num_kv_heads == 1
    falcon_40b = {**falcon_7b, "hidden_size": 8192, "num_attention_heads": 128, "num_kv_heads": 8,
                  "new_decoder_architecture": True, "ffn_hidden_size": 32768}
    cfg = ModelConfig.from_dict(falcon_40b)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (8, 64, 32768)

    llama = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
                                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8})
    assert (llama.num_kv_heads, llama.intermediate_size, llama.tie_word_embeddings, llama.rms_norm_eps) == (
        8, 16384, False, 1e-6)

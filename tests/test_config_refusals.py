"""Config fields a family does not implement fail at load naming the field, never a silent wrong
answer; and the transformers 4.x spelling of the new families' configs reads like the 5.x one."""

import shutil

import pytest
import torch
import transformers

from fastgen.models.loader import load_model
from kit import rewrite_config

PROMPT = [5, 17, 42, 99, 3, 250, 7, 31, 8, 64, 120, 11, 2, 77, 301, 45, 9, 18]


def _copy(tiny_checkpoints, model_type: str, tmp_path, **changes) -> str:
    path = str(tmp_path / model_type)
    shutil.copytree(tiny_checkpoints[model_type], path)
    rewrite_config(path, **changes)
    return path


@pytest.mark.parametrize(("model_type", "changes", "message"), [
    ("llama", dict(layer_types=["full_attention", "chunked_attention"]),
     r"llama config.json: layer_types entries \['chunked_attention'\] are not implemented"),
    ("olmo3", dict(layer_types=["sliding_attention", "linear_attention"]), r"\['linear_attention'\] are not implemented"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "full_attention": {"rope_type": "bogus", "rope_theta": 1e6}}),
     "unsupported rope type 'bogus'"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "chunked_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     r"rope_parameters has entries for unknown layer types \['chunked_attention'\]"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("llama", dict(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}), "unsupported rope type 'mrope'"),
    ("glm4_moe", dict(n_group=3), "the groups must divide the experts"),
    ("smollm3", dict(no_rope_layers=[1, 0, 1]), "no_rope_layers has 3 entries for 2 layers"),
    ("llama4_text", dict(layer_types=["chunked_attention", "sliding_attention"]),
     r"llama4_text layer_types entries \['sliding_attention'\] are not implemented"),
    ("llama4_text", dict(attention_chunk_size=0), "attention_chunk_size must be a positive integer, got 0"),
    ("llama4_text", dict(moe_layers=[2]), r"moe_layers \[2\] must be layer indices in \[0, 2\)"),
    ("llama4_text", dict(no_rope_layers=[1, 0, 1]), "no_rope_layers has 3 entries for 2 layers"),
    ("llama4_text", dict(quantization_config={"quant_method": "fbgemm_fp8"}),
     "quantization_config quant_method 'fbgemm_fp8' is not implemented"),
    ("llama4_text", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor 0.5 is not implemented"),
])
def test_unimplemented_config_fails_at_load_naming_it(model_type, changes, message, tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=message):
        load_model(_copy(tiny_checkpoints, model_type, tmp_path, **changes), progress=False)


def test_gemma3_transformers4_config_reads_like_5(tiny_checkpoints, tmp_path):
    """4.x keys: `rope_theta` (global), `rope_local_base_freq`, `rope_scaling` (global layers only),
    `sliding_window_pattern` instead of `layer_types`. HF 5 converts them; we must read the same."""
    path = _copy(tiny_checkpoints, "gemma3_text", tmp_path, rope_parameters=None, layer_types=None,
                 rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=2,
                 rope_scaling={"rope_type": "linear", "factor": 4.0})
    ours = load_model(path, progress=False).model
    assert ours.config.layer_sliding_windows == [12, 0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    from kit import PagedRunner

    runner = PagedRunner(ours, block_size=4)
    got = runner.step([(runner.add(PROMPT), len(PROMPT))])
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_llama4_text_config_without_resolved_lists_reads_like_hf(tiny_checkpoints, tmp_path):
    """A config.json without `layer_types` / `moe_layers`, with 4.x rope keys: the defaults resolve as
    HF's config class resolves them (chunked attention on the rotary layers, MoE every
    `interleave_moe_layer_step`-th layer)."""
    path = _copy(tiny_checkpoints, "llama4_text", tmp_path, layer_types=None, moe_layers=None, rope_parameters=None,
                 rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    ours = load_model(path, progress=False).model
    assert ours.config.raw["layer_types"] == ["chunked_attention", "full_attention"]
    assert ours.config.raw["moe_layers"] == [1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.layer_types == ours.config.raw["layer_types"]
    from kit import PagedRunner

    runner = PagedRunner(ours, block_size=4)
    got = runner.step([(runner.add(PROMPT), len(PROMPT))])
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

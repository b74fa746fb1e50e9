"""Gemma 4 beyond the generic parity tests: KV-sharing layers own no cache (runner and planner), the
released checkpoints' config spelling (`global_head_dim`, no `per_layer_config`) and their extra
K/V tensors for sharing layers, and the config fields the family refuses."""

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fastgen import EngineConfig
from fastgen.engine import Engine
from fastgen.models.loader import load_model
from fastgen.planning.model_facts import model_facts
from kit import PagedRunner, rewrite_config

PROMPT = [5, 17, 42, 99, 3, 250, 7, 31, 8, 64, 120, 11, 2, 77, 301, 45, 9, 18]


def _copy(tiny_checkpoints, tmp_path, **changes) -> str:
    path = str(tmp_path / "gemma4_text")
    shutil.copytree(tiny_checkpoints["gemma4_text"], path)
    rewrite_config(path, **changes)
    return path


def _assert_logits_match_hf(path: str) -> None:
    ours = load_model(path, progress=False).model
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = PagedRunner(ours, block_size=4)
    got = runner.step([(runner.add(PROMPT), len(PROMPT))])
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_kv_sharing_layers_own_no_cache(tiny_checkpoints):
    """Layers 2 and 3 attend layers 0 and 1's caches: the runner allocates none for them and the plan's
    KV bytes per token count the two owners only (sliding: 2 KV heads x 24, global: 1 x 32, K and V)."""
    path = tiny_checkpoints["gemma4_text"]
    facts = model_facts(path)
    assert facts.config.layer_kv_heads == [(2, 24), (1, 32), None, None]
    assert facts.kv_bytes_per_token == (2 * 24 + 1 * 32) * 2 * 4
    # Under TP=2 the two sliding KV heads split, the one global head is copied.
    assert facts.kv_bytes(torch.float32, 2) == (1 * 24 + 1 * 32) * 2 * 4
    engine = Engine.from_config(EngineConfig(model=path, num_kv_blocks=8, block_size=4, progress=False))
    caches = engine.runner.kv_caches
    assert [len(c) for c in caches] == [2, 2, 0, 0]
    assert [tuple(t.shape) for t in caches[0] + caches[1]] == [(8, 4, 2, 24)] * 2 + [(8, 4, 1, 32)] * 2


def test_released_config_spelling_reads_like_hf(tiny_checkpoints, tmp_path):
    """The released checkpoints' config.json names the global layers' sizes at the top level and has no
    `per_layer_config`; HF derives the same per-layer sizes from them, and so must we."""
    path = _copy(tiny_checkpoints, tmp_path, per_layer_config=None, global_head_dim=32, num_global_key_value_heads=1)
    assert load_model(path, progress=False).model.config.layer_kv_heads == [(2, 24), (1, 32), None, None]
    _assert_logits_match_hf(path)


def test_kv_projections_of_sharing_layers_in_a_checkpoint_are_ignored(tiny_checkpoints, tmp_path):
    """Released checkpoints carry k/v projections and norms for the KV-sharing layers, which HF skips."""
    path = _copy(tiny_checkpoints, tmp_path)
    weights = load_file(f"{path}/model.safetensors")
    for layer in (2, 3):
        prefix = f"model.layers.{layer}.self_attn"
        weights[f"{prefix}.k_proj.weight"] = torch.randn(32, 64)
        weights[f"{prefix}.k_norm.weight"] = torch.randn(32)
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    _assert_logits_match_hf(path)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]),
     r"layer_types entries \['chunked_attention'\] are not implemented"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}),
     r"rope_parameters\['full_attention'\] rope_type 'yarn' is not implemented"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.5},
                           "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}),
     r"keys \['partial_rotary_factor'\] are not implemented for rope_type 'default'"),
    (dict(per_layer_config={"1": {"head_dim": 32, "intermediate_size": 64}}),
     r"per_layer_config\[1\] overrides \['intermediate_size'\]"),
    (dict(num_kv_shared_layers=3), r"layer 1 \(full_attention\) has no earlier layer of its kind"),
    (dict(num_kv_shared_layers=4), "must leave at least one of the 4 layers computing K/V"),
    (dict(enable_moe_block=True, top_k_experts=None), r"needs \['top_k_experts'\]"),
])
def test_unimplemented_config_fails_at_load_naming_it(changes, message, tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=message):
        load_model(_copy(tiny_checkpoints, tmp_path, **changes), progress=False)

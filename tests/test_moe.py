"""The sparse MoE layer against transformers' MoE blocks, the stacked-expert loading of both
checkpoint layouts, the Qwen dense/sparse layer choice, and the errors for bad MoE configs."""

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from fastgen.models.config import ModelConfig
from fastgen.models.loader import load_model
from fastgen.models.moe import MoeConfig, SparseMoeBlock, route
from fastgen.models.qwen_moe import QwenMoeForCausalLM
from kit import PagedRunner, build_checkpoint

HIDDEN = 32
PROMPT = [5, 17, 300, 42, 99, 7, 256, 3, 11, 480, 64, 23, 150, 8, 77, 401, 12, 9, 333, 2]

# (HF block, HF config, our MoeConfig): Qwen3 with 16 experts so one token takes the gathered path at top-3.
BLOCKS = {
    "mixtral": (
        MixtralSparseMoeBlock,
        transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=48, num_local_experts=8,
                                   num_experts_per_tok=2),
        MoeConfig(num_experts=8, top_k=2, intermediate_size=48, renormalize=True),
    ),
    "qwen2_moe": (
        Qwen2MoeSparseMoeBlock,
        transformers.Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=40, norm_topk_prob=False),
        MoeConfig(num_experts=8, top_k=2, intermediate_size=24, renormalize=False, shared_expert_intermediate_size=40),
    ),
    "qwen3_moe": (
        Qwen3MoeSparseMoeBlock,
        transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=3, moe_intermediate_size=24,
                                    norm_topk_prob=True),
        MoeConfig(num_experts=16, top_k=3, intermediate_size=24, renormalize=True),
    ),
}


def _blocks(family: str, seed: int = 0) -> tuple[torch.nn.Module, SparseMoeBlock]:
    """HF's MoE block with random weights and ours holding the same weights."""
    hf_cls, hf_config, moe = BLOCKS[family]
    torch.manual_seed(seed)
    hf = hf_cls(hf_config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.5)
    state = dict(hf.state_dict())
    if moe.shared_expert_intermediate_size:
        gate, up = state.pop("shared_expert.gate_proj.weight"), state.pop("shared_expert.up_proj.weight")
        state["shared_expert.gate_up_proj.weight"] = torch.cat([gate, up])
    ours = SparseMoeBlock(HIDDEN, moe).eval()
    ours.load_state_dict(state, strict=True)
    return hf, ours


@pytest.mark.parametrize("num_tokens", [1, 2, 40])
@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_moe_block_matches_hf(family, num_tokens):
    hf, ours = _blocks(family)
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        expected = hf(hidden[None])[0]
        got = ours(hidden)
    assert expected.abs().mean() > 1.0, "the block's output is too small for the comparison to mean anything"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_dense_gathered_and_per_expert_formulations_agree(family):
    _, ours = _blocks(family, seed=1)
    moe = BLOCKS[family][2]
    # 24 tokens reach every expert; one token only a few (the per-expert loop skips the others).
    for num_tokens in (24, 1):
        hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            weights, ids = route(ours.gate(hidden), moe.top_k, moe.renormalize)
            dense = ours.experts._dense(hidden, weights, ids)
            gathered = ours.experts._gathered(hidden, weights, ids)
            per_expert = ours.experts._per_expert(hidden, weights, ids)
        assert ids.unique().numel() == (moe.num_experts if num_tokens > 1 else moe.top_k)
        torch.testing.assert_close(dense, gathered, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(per_expert, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("router_cls", "norm_topk_prob"), [(MixtralTopKRouter, None), (Qwen2MoeTopKRouter, False),
                                                             (Qwen2MoeTopKRouter, True)])
def test_routing_equals_hf_router(router_cls, norm_topk_prob):
    if norm_topk_prob is None:
        config = transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=3)
    else:
        config = transformers.Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3,
                                             norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    router = router_cls(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(50, HIDDEN)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
        weights, ids = route(logits, 3, renormalize=norm_topk_prob is not False)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), rtol=0, atol=1e-7)
    sums = weights.sum(-1)
    if norm_topk_prob is False:
        assert (sums < 1).all()
    else:
        torch.testing.assert_close(sums, torch.ones_like(sums))


# --- checkpoints ---------------------------------------------------------------------------------


def _logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits of PROMPT as a prefill chunk then one decode step through the paged cache."""
    runner = PagedRunner(model, num_blocks=16, block_size=4)
    seq = runner.add(PROMPT)
    return torch.cat([runner.step([(seq, len(PROMPT) - 1)]), runner.step([(seq, 1)])])


def _hf_logits(path: str) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize(("model_type", "per_expert_name", "fused_name"), [
    ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.layers.0.mlp.experts.gate_up_proj"),
    ("qwen2_moe", "model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.experts.down_proj"),
])
def test_fused_transformers5_layout_loads_like_per_expert(model_type, per_expert_name, fused_name, tmp_path):
    per_expert = build_checkpoint(str(tmp_path / "per_expert"), model_type)
    assert per_expert_name in load_file(os.path.join(per_expert, "model.safetensors"))
    fused = str(tmp_path / "fused")
    hf = transformers.AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    hf.save_pretrained(fused, save_original_format=False)
    assert fused_name in load_file(os.path.join(fused, "model.safetensors"))

    from_fused = load_model(fused, progress=False).model
    a = load_model(per_expert, progress=False).model.state_dict()
    b = from_fused.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    torch.testing.assert_close(_logits(from_fused), _hf_logits(per_expert), rtol=1e-4, atol=1e-4)


def test_per_expert_loader_errors(tmp_path):
    path = build_checkpoint(str(tmp_path / "mixtral"), "mixtral")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    w3 = "model.layers.1.block_sparse_moe.experts.5.w3.weight"

    def broken(name: str, change: dict) -> str:
        out = tmp_path / name
        out.mkdir()
        for f in ("config.json", "generation_config.json"):
            (out / f).write_bytes((tmp_path / "mixtral" / f).read_bytes())
        save_file({k: v for k, v in {**tensors, **change}.items() if v is not None}, str(out / "model.safetensors"))
        return str(out)

    with pytest.raises(ValueError, match=f"lacks tensor\\(s\\): {w3.replace('.', '[.]')}$"):
        load_model(broken("missing", {w3: None}), progress=False)
    with pytest.raises(ValueError, match="names expert 8, but the model has 8"):
        load_model(broken("extra", {w3.replace(".5.", ".8."): tensors[w3].clone()}), progress=False)
    with pytest.raises(ValueError, match=f"{w3.replace('.', '[.]')}' has shape \\(128, 32\\), expected \\(128, 64\\)"):
        load_model(broken("shape", {w3: tensors[w3][:, :32].contiguous()}), progress=False)


def test_qwen_sparse_step_and_no_qkv_bias_match_hf(tmp_path):
    # decoder_sparse_step=2 makes layers 1 and 3 sparse; mlp_only_layers then turns 3 dense again.
    path = build_checkpoint(str(tmp_path / "q"), "qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2,
                            mlp_only_layers=[3], qkv_bias=False)
    ours = load_model(path, progress=False).model
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == ["GatedMLP", "SparseMoeBlock", "GatedMLP", "GatedMLP"]
    assert ours.model.layers[0].self_attn.qkv_proj.bias is None
    expected = _hf_logits(path)
    assert expected.std() > 1.0
    torch.testing.assert_close(_logits(ours), expected, rtol=1e-4, atol=1e-4)


# --- bad configs ---------------------------------------------------------------------------------

RAW = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=8)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": None}, "qwen3_moe config.json lacks 'num_experts_per_tok'"),
    ({"moe_intermediate_size": None}, "lacks 'moe_intermediate_size'"),
    ({"num_experts_per_tok": 5}, r"top_k \(5\) exceeds num_experts \(4\)"),
    ({"num_experts_per_tok": 0}, "top_k must be a positive integer, got 0"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer, got 0"),
    ({"hidden_act": "swiglu"}, "unsupported activation 'swiglu'"),
])
def test_bad_moe_config_is_refused(change, message):
    raw = {k: v for k, v in {**RAW, **change}.items() if v is not None}
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        QwenMoeForCausalLM(ModelConfig.from_dict(raw))


def test_qwen2_moe_without_shared_expert_size_is_refused():
    raw = {**RAW, "model_type": "qwen2_moe"}
    with torch.device("meta"), pytest.raises(ValueError, match="lacks 'shared_expert_intermediate_size'"):
        QwenMoeForCausalLM(ModelConfig.from_dict(raw))

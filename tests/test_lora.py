"""LoRA adapters in PEFT's format: our loader and batched delta against peft's own LoRA layers (fp32)."""

import json
import os

import peft
import pytest
import torch
import transformers
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.loader import build_empty_model
from fastgen.models.lora import load_lora_adapter
from fastgen.models.lora_layers import LoRALinear, LoRARows
from fastgen.ops.lora import add_lora_, group_by_slot
from kit import build_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    ckpt = build_checkpoint(str(root / "llama"), "llama")
    adapters = {}
    for name, seed, rslora in (("a", 1, False), ("b", 2, True)):
        torch.manual_seed(seed)
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        cfg = peft.LoraConfig(r=4 if name == "a" else 2, lora_alpha=8, use_rslora=rslora,
                              target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
        pm = peft.get_peft_model(hf, cfg)
        pm.save_pretrained(str(root / name))
        adapters[name] = (str(root / name), pm)
    model = build_empty_model(ModelConfig.from_file(os.path.join(ckpt, "config.json")))
    return root, model, adapters


def _adapted_qkv(model, adapters, weight, max_rank=8) -> LoRALinear:
    """A LoRA-wrapped merged q/k/v linear over `weight`, adapter a in slot 0 and b in slot 1."""
    module = "model.layers.0.self_attn.qkv_proj"
    shape = model.get_submodule(module)
    base = nn.Linear(shape.in_features, shape.out_features, bias=False)
    base.output_sizes = list(shape.output_sizes)
    base.weight.data.copy_(weight)
    linear = LoRALinear(base, 2, max_rank, LoRARows(2, torch.float32), torch.float32, torch.device("cpu"))
    assert linear.rank == 3 * max_rank  # q, k and v's pairs stacked along the rank
    for slot, name in enumerate(("a", "b")):
        loaded = load_lora_adapter(name, adapters[name][0], model, max_lora_rank=max_rank)
        linear.set_slot(slot, loaded.modules[module].a, loaded.modules[module].b, loaded.scale)
    return linear


def _run(linear: LoRALinear, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    linear.rows.bind(slots)
    return linear(x)


def test_mixed_batch_matches_peft(setup):
    _, model, adapters = setup
    torch.manual_seed(0)
    x = torch.randn(6, 64)
    slots = torch.tensor([-1, 0, 1, 0, -1, 1])
    layers = {n: pm.base_model.model.model.layers[0].self_attn for n, (_, pm) in adapters.items()}
    attn = layers["a"]
    base_w = torch.cat([attn.q_proj.base_layer.weight, attn.k_proj.weight, attn.v_proj.base_layer.weight])
    linear = _adapted_qkv(model, adapters, base_w)
    with torch.no_grad():
        out = _run(linear, x, slots)
        for row, slot in enumerate(slots.tolist()):
            xr = x[row:row + 1]
            if slot < 0:
                want = xr @ base_w.t()
            else:
                a = layers["ab"[slot]]
                want = torch.cat([a.q_proj(xr), a.k_proj(xr), a.v_proj(xr)], dim=1)
            torch.testing.assert_close(out[row:row + 1], want, rtol=1e-5, atol=1e-5)
            alone = _run(linear, xr, slots[row:row + 1])
            torch.testing.assert_close(out[row:row + 1], alone, rtol=1e-5, atol=1e-5)
        assert not torch.equal(out[1], out[0])
        linear.set_slot(0, None, None, 0.0)  # an emptied slot adds nothing
        torch.testing.assert_close(_run(linear, x[1:2], slots[1:2]), x[1:2] @ base_w.t())


def test_rslora_scale(setup):
    _, model, adapters = setup
    b = load_lora_adapter("b", adapters["b"][0], model, max_lora_rank=8)
    assert b.scale == pytest.approx(8 / 2 ** 0.5)
    a = load_lora_adapter("a", adapters["a"][0], model, max_lora_rank=8)
    assert a.scale == pytest.approx(8 / 4)


def _copy(root, src, name, **config_changes):
    import shutil
    dst = root / name
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("changes,message", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["nope_proj"]}, "nope_proj"),
    ({"target_modules": ["lm_head"]}, "not supported"),
    ({"r": 16}, "rank"),
])
def test_bad_config(setup, changes, message):
    root, model, adapters = setup
    path = _copy(root, adapters["a"][0], "bad", **changes)
    with pytest.raises(ValueError, match=message):
        load_lora_adapter("bad", path, model, max_lora_rank=8)


def test_rank_over_max(setup):
    _, model, adapters = setup
    with pytest.raises(ValueError, match="exceeds max_lora_rank 2"):
        load_lora_adapter("a", adapters["a"][0], model, max_lora_rank=2)


def test_missing_corrupt_and_shape(setup, tmp_path):
    root, model, adapters = setup
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_lora_adapter("x", str(tmp_path), model, max_lora_rank=8)
    path = _copy(root, adapters["a"][0], "corrupt")
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(ValueError, match="corrupt"):
        load_lora_adapter("x", path, model, max_lora_rank=8)
    other = build_empty_model(ModelConfig.from_dict({**model.config.raw, "hidden_size": 32, "head_dim": 8}))
    with pytest.raises(ValueError, match="base linear takes"):
        load_lora_adapter("a", adapters["a"][0], other, max_lora_rank=8)


@pytest.mark.parametrize("slot_ids", [[3, -1, 0, 3, 3, 5, -1, 0, 3], [1, 1, 1], [0, 1, 2, 3, 4, 5, 5, 4], [-1, -1]],
                         ids=["uneven-some-slots", "one-slot", "every-slot", "base-only"])
def test_grid_delta_equals_a_row_by_row_loop(slot_ids):
    """The padded grid (present slots only, uneven rows per slot, base rows between) against each row's
    own x @ A^T @ B^T."""
    generator = torch.Generator().manual_seed(3)
    num_slots, rank, d_in, d_out = 6, 4, 24, 40
    a = torch.randn(num_slots, rank, d_in, generator=generator)
    b = torch.randn(num_slots, d_out, rank, generator=generator)
    x = torch.randn(len(slot_ids), d_in, generator=generator)
    base = torch.randn(len(slot_ids), d_out, generator=generator)
    grid = group_by_slot(torch.tensor(slot_ids, dtype=torch.int32), num_slots, torch.float32)
    out = base.clone()
    present = sorted({s for s in slot_ids if s >= 0})
    assert grid.meta.tolist()[:2 + len(present)] == [len(present), max(map(slot_ids.count, present), default=0),
                                                       *present]
    assert grid.rows.shape == grid.valid.shape == (num_slots * len(slot_ids),)  # whatever the mix
    add_lora_(out, x, a, b, grid.rows, grid.valid, grid.meta)
    want = torch.stack([base[i] + (x[i] @ a[s].t() @ b[s].t() if s >= 0 else 0) for i, s in enumerate(slot_ids)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)

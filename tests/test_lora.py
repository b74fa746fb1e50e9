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
from fastgen.ops.cpu_kernels import ENV_VAR, ISAS, cpu_kernel_isa, kernel_op, supported_isas
from fastgen.ops.lora import add_lora_, add_lora_slots_, group_by_slot, lora_kernel_serves, slots_only
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


def _adapted_qkv(model, adapters, weight, max_rank=8, kernel=False) -> LoRALinear:
    """A LoRA-wrapped merged q/k/v linear over `weight`, adapter a in slot 0 and b in slot 1; its rows go
    to the C++ kernel (`kernel`) or the torch grid."""
    module = "model.layers.0.self_attn.qkv_proj"
    shape = model.get_submodule(module)
    base = nn.Linear(shape.in_features, shape.out_features, bias=False)
    base.output_sizes = list(shape.output_sizes)
    base.weight.data.copy_(weight)
    linear = LoRALinear(base, 2, max_rank, LoRARows(2, torch.float32, kernel), torch.float32, torch.device("cpu"))
    assert linear.rank == 3 * max_rank  # q, k and v's pairs stacked along the rank
    for slot, name in enumerate(("a", "b")):
        loaded = load_lora_adapter(name, adapters[name][0], model, max_lora_rank=max_rank)
        linear.set_slot(slot, loaded.modules[module].a, loaded.modules[module].b, loaded.scale)
    return linear


def _run(linear: LoRALinear, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    linear.rows.bind(slots)
    return linear(x)


@pytest.mark.parametrize("kernel", [False, True], ids=["grid", "kernel"])
def test_mixed_batch_matches_peft(setup, kernel):
    if kernel and not lora_kernel_serves(torch.device("cpu"), torch.float32):
        pytest.skip("the C++ CPU kernels cannot run here")
    _, model, adapters = setup
    torch.manual_seed(0)
    x = torch.randn(6, 64)
    slots = torch.tensor([-1, 0, 1, 0, -1, 1])
    layers = {n: pm.base_model.model.model.layers[0].self_attn for n, (_, pm) in adapters.items()}
    attn = layers["a"]
    base_w = torch.cat([attn.q_proj.base_layer.weight, attn.k_proj.weight, attn.v_proj.base_layer.weight])
    linear = _adapted_qkv(model, adapters, base_w, kernel=kernel)
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


def _stacks(num_slots: int, rank: int, d_in: int, sections: list[int], dtype: torch.dtype, seed: int,
            zero_ranks: int = 0):
    """Random stacks `a[slots, R, in]`, `b[slots, R, out]` (B transposed) whose B is zero off each section's
    own ranks, like `LoRALinear`'s; the last `zero_ranks` of every section zero in A too (a lower-rank adapter)."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, rank, d_in, generator=generator)
    b = torch.randn(num_slots, rank, sum(sections), generator=generator)
    per = rank // len(sections)
    for j, size in enumerate(sections):
        start = sum(sections[:j])
        b[:, :j * per, start:start + size] = 0
        b[:, (j + 1) * per:, start:start + size] = 0
        a[:, (j + 1) * per - zero_ranks:(j + 1) * per] = 0
    return a.to(dtype), b.to(dtype)


def _path(path: str, monkeypatch) -> None:
    """Send the delta down `path`: the C++ kernel (skipped where it cannot be built), the torch grid, or
    `add_lora_slots_` with the kernel off (its fallback onto the grid)."""
    monkeypatch.setenv(ENV_VAR, "auto" if path == "kernel" else "off")
    if path == "kernel" and (cpu_kernel_isa() is None or kernel_op("lora_delta", cpu_kernel_isa()) is None):
        pytest.skip("the C++ CPU kernels cannot run here")
    if path == "kernel":  # a row left to the torch grid would fail the test
        monkeypatch.setattr(torch, "bmm", None)


@pytest.mark.parametrize("path", ["kernel", "torch", "fallback"])
@pytest.mark.parametrize("sections", [[40], [16, 24], [13, 20, 7]], ids=["one", "two", "three-odd"])
@pytest.mark.parametrize("slot_ids", [[3, -1, 0, 3, 3, 5, -1, 0, 3], [1, 1, 1], [0, 1, 2, 3, 4, 5, 5, 4], [-1, -1]],
                         ids=["uneven-some-slots", "one-slot", "every-slot", "base-only"])
def test_delta_equals_a_row_by_row_loop(slot_ids, sections, path, monkeypatch):
    """The kernel and the padded grid (present slots only, uneven rows per slot, base rows between, merged
    sections, widths off the vector length) against each row's own x @ A^T @ B in float64."""
    _path(path, monkeypatch)
    num_slots, rank, d_in = 6, 6 * len(sections), 27
    a, b = _stacks(num_slots, rank, d_in, sections, torch.float32, seed=3, zero_ranks=1)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(len(slot_ids), d_in, generator=generator)
    base = torch.randn(len(slot_ids), sum(sections), generator=generator)
    out = base.clone()
    present = sorted({s for s in slot_ids if s >= 0})
    if path != "torch":
        grid = slots_only(torch.tensor(slot_ids, dtype=torch.int64))
        assert grid.rows is None and grid.slot_ids.dtype == torch.int32 and grid.adapted == bool(present)
        add_lora_slots_(out, x, a, b, grid.slot_ids, sections)
    else:
        grid = group_by_slot(torch.tensor(slot_ids, dtype=torch.int32), num_slots, torch.float32)
        assert grid.meta.tolist()[:2 + len(present)] == [len(present), max(map(slot_ids.count, present), default=0),
                                                           *present]
        assert grid.rows.shape == grid.valid.shape == (num_slots * len(slot_ids),)  # whatever the mix
        add_lora_(out, x, a, b, grid.slot_ids, grid.rows, grid.valid, grid.meta, sections)
    want = torch.stack([base[i].double() + (x[i].double() @ a[s].double().t() @ b[s].double() if s >= 0 else 0)
                        for i, s in enumerate(slot_ids)])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_kernel_variants_and_dtypes_match_float64(isa, dtype, monkeypatch):
    """Each ISA variant this CPU runs, in each dtype, over SmolLM2-like shapes and an odd one: within one
    rounding of the output's dtype of the float64 delta (the kernel accumulates in fp32, rounds once)."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv(ENV_VAR, isa)
    if kernel_op("lora_delta", isa) is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    monkeypatch.setattr(torch, "bmm", None)
    for d_in, sections, rank in ((576, [576, 192, 192], 48), (1536, [576], 16), (70, [35, 18], 10)):
        a, b = _stacks(4, rank, d_in, sections, dtype, seed=d_in, zero_ranks=2)
        slots = torch.tensor([0, -1, 3, 2, 2, 1, 0, -1, 3, 3, 1], dtype=torch.int32)
        generator = torch.Generator().manual_seed(5)
        x = torch.randn(slots.shape[0], d_in, generator=generator).to(dtype)
        base = torch.randn(slots.shape[0], sum(sections), generator=generator).to(dtype)
        out = base.clone()
        add_lora_slots_(out, x, a, b, slots, sections)
        want = torch.stack([base[i].double() + (x[i].double() @ a[s].double().t() @ b[s].double() if s >= 0 else 0)
                            for i, s in enumerate(slots.tolist())])
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=max(2 * eps, 1e-5), atol=1e-3)

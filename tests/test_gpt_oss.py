"""gpt-oss beyond the shared parity tests: MXFP4 expert weights dequantized at load, and config
fields the family does not implement refused by name."""

import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from fastgen.models.gpt_oss import dequantize_mxfp4
from fastgen.models.loader import load_model
from kit import PagedRunner, build_checkpoint, rewrite_config


def _random_mxfp4(gen: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales of an `[experts, rows, cols]` MXFP4 matrix, values of about unit size."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(124, 128, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_mxfp4_equals_transformers():
    gen = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4(gen, 3, 8, 64)
    scales[0, 0, 0] = 0  # the smallest and largest exponents too
    scales[0, 0, 1] = 255
    ours = dequantize_mxfp4(blocks, scales)
    # transformers returns the [experts, in, out] layout of its own parameters.
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert ours.shape == (3, 8, 64)
    assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="MXFP4"):
        dequantize_mxfp4(blocks.int(), scales)


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    """OpenAI's layout (`*_blocks`/`*_scales` for the expert matrices): our logits equal HF's on the same
    weights dequantized by transformers' own converter."""
    plain = build_checkpoint(str(tmp_path / "plain"), "gpt_oss", intermediate_size=64)
    packed = str(tmp_path / "mxfp4")
    shutil.copytree(plain, packed)
    weights = load_file(os.path.join(plain, "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    packed_weights = dict(weights)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, cols = weights[name].transpose(1, 2).shape  # HF keeps [E, in, out]
        blocks, scales = _random_mxfp4(gen, experts, rows, cols)
        weights[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        del packed_weights[name]
        packed_weights[name + "_blocks"], packed_weights[name + "_scales"] = blocks, scales
    save_file(weights, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    save_file(packed_weights, os.path.join(packed, "model.safetensors"), metadata={"format": "pt"})
    rewrite_config(packed, quantization_config={"quant_method": "mxfp4"})

    ours = load_model(packed, progress=False).model
    hf = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    prompt = list(range(5, 40))
    runner = PagedRunner(ours, block_size=8)
    logits = runner.step([(runner.add(prompt), len(prompt))])
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    assert expected.std() > 1.0
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "chunked_attention"),
    (dict(layer_types=["sliding_attention"]), "1 entries for 2 layers"),
    (dict(quantization_config={"quant_method": "fp8"}), "fp8"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unimplemented_config_fields_are_refused_by_name(change, message, tiny_checkpoints, tmp_path):
    path = str(tmp_path / "bad")
    shutil.copytree(tiny_checkpoints["gpt_oss"], path)
    rewrite_config(path, **change)
    with pytest.raises(ValueError, match=message):
        load_model(path, progress=False)

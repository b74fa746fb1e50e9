"""GGUF tensors -> HF-named fp32 tensors in HF's layout, one at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fastgen.models.gguf.metadata import GGUF_FAMILIES, Family, family_of
from fastgen.models.gguf.reader import Metadata, TensorIndex, check_tensor_types, open_gguf, tensor_values

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Rotary tables llama.cpp stores as tensors; `gguf_config_dict` turns them back into rope settings.
_ROPE_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def _hf_tensor_name(name: str, family: Family, path: str) -> str | None:
    """The HF checkpoint name of GGUF tensor `name` (None for rotary tables folded into the config)."""
    if name in _ROPE_TENSORS:
        return None
    module, _, suffix = name.rpartition(".")
    if module in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[module]}.{suffix}"
    parts = module.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in family.block:
        return f"model.layers.{parts[1]}.{family.block[parts[2]]}.{suffix}"
    raise ValueError(f"{path}: GGUF tensor {name!r} has no place in fastgen's {family.model_type} model")


def _unpermute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, its interleaved (x0, y0, x1, y1, ...) rows
    back to HF's (x0, x1, ..., y0, y1, ...) halves. Biases (1-D) are permuted alike."""
    rest = weight.shape[1:]
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def iter_gguf_tensors(path: str, config: dict, reader=None) -> Iterator[tuple[str, torch.Tensor]]:
    """`(HF name, fp32 tensor)` for each weight of the GGUF file at `path`, one tensor at a time.

    `config` is the file's config dict (`gguf_config_dict`, as saved); it gives the head counts the
    Q/K un-permutation needs. `reader`: an open `gguf.GGUFReader` or the file's `TensorIndex` (None opens a
    reader). Only one dequantized tensor is alive per step.
    """
    reader = reader if reader is not None else open_gguf(path)
    if isinstance(reader, TensorIndex):  # checked by family_of when the index was written
        family = GGUF_FAMILIES[reader.architecture]
    else:
        _, family = family_of(Metadata(reader, path))
    check_tensor_types(reader, path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name, family, path)
        if name is None:
            continue
        values = torch.from_numpy(tensor_values(tensor))
        module = tensor.name.rpartition(".")[0]
        if family.permute_qk and module.endswith((".attn_q", ".attn_k")):
            values = _unpermute_qk(values, heads if module.endswith(".attn_q") else kv_heads)
        if family.norm_offset and module.endswith("norm"):
            values = values - family.norm_offset
        yield name, values


def gguf_weight_count(reader) -> int:
    """How many tensors `iter_gguf_tensors` yields from `reader` (for progress bars)."""
    return sum(1 for t in reader.tensors if t.name not in _ROPE_TENSORS)

"""LoRA adapters in PEFT's format, read and checked against the decoder they will run beside.

A PEFT adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors` with one pair per adapted linear:
`base_model.model.<HF module>.lora_A.weight` `[r, in]` and `.lora_B.weight` `[out, r]`. The HF module
names map onto the decoder's modules the way checkpoint weights do (the family's
`packed_modules_mapping`): `q_proj`'s pair lands on the rows of our merged `qkv_proj` that hold q.

Per decoder module the adapter becomes one `(A, B)` pair over the checkpoint's whole linear (every
tensor-parallel rank's share: `LoRALinear.set_slot` keeps this rank's). For a merged linear, packed projection j
(the j-th of its `output_sizes`) holds A's rows j*r..(j+1)*r and B's block on its own output rows and
those ranks; zeros elsewhere, the whole block where the adapter leaves that projection alone (a pair over
the whole merged linear, from a checkpoint that fuses it too, gives each projection its A and its rows of
B). So one
shrink and one expand serve the merged linear (`fastgen.ops.lora`), and the expand can read each
projection's block alone. The scale is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`.

Families whose checkpoint layout is rewritten at load (GPT-2, OPT, Falcon, Gemma 4, Llama 4, gpt-oss,
GLM-4.5, DeepSeek-V3, Qwen3.5 / Qwen3-Next) map each pair the way their weights go
(`DecoderLM.adapt_lora_pair`): the same renames, B's rows reordered as the weight's are (Llama 4's q/k
heads, Falcon's and Qwen3-Next's grouped projections), and the pairs of modules the loader skips
(Gemma 4's K/V projections of KV-sharing layers, multi-token-prediction layers, Qwen3.5's vision tower)
dropped, as HF ignores those modules too. PEFT writes `fan_in_fan_out` for GPT-2's Conv1D modules: it
changes only how PEFT merges a pair (its A and B are a Linear's), so it is taken there and refused on
a module HF keeps as a Linear.

Every problem is a ValueError naming it, before anything is handed out: missing or corrupt files,
a rank over `max_lora_rank`, a target the model does not have, shapes that do not fit the base, a
module the family cannot adapt (DeepSeek-V3's absorbed `kv_b_proj`), and the PEFT features not
implemented (DoRA, LoRA biases, `modules_to_save`, `target_parameters`, per-module rank/alpha patterns,
adapted embeddings or LM head).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_EMBEDDING_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out", "word_embeddings")


@dataclass(frozen=True)
class LoRAModule:
    """One decoder linear's adapter weights: `a[rank, in]`, `b[out, rank]` (scale not folded in)."""

    a: torch.Tensor
    """Shrink weights; a merged linear's packed projections' A stacked along the rank in their order."""
    b: torch.Tensor
    """Expand weights; each packed projection's B on its own output rows and ranks (zeros elsewhere)."""

    @property
    def rank(self) -> int:
        """Rows of `a` (the adapter's r, times the packed projections of a merged linear)."""
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded, checked PEFT LoRA adapter, keyed by the decoder's module names."""

    name: str
    """The adapter's name (what requests select it by)."""
    path: str
    """The directory it was read from."""
    rank: int
    """PEFT's `r`."""
    scale: float
    """`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`."""
    modules: dict[str, LoRAModule]
    """Decoder module name (`model.layers.0.self_attn.qkv_proj`) -> its weights."""


def _refuse_unsupported(config: dict, where: str) -> None:
    """ValueError for a PEFT feature fastgen does not implement, naming it."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    refused = {
        "use_dora": "DoRA (use_dora) is not supported",
        "lora_bias": "LoRA biases (lora_bias) are not supported",
        "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
        "target_parameters": "target_parameters (LoRA on parameters, e.g. MoE expert stacks) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "trainable_token_indices": "trainable_token_indices is not supported",
        "layer_replication": "layer_replication is not supported",
    }
    for key, reason in refused.items():
        if config.get(key):
            raise ValueError(f"{where}: {reason}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")


def _read_config(path: str) -> dict:
    """The adapter's config, ValueError when it is missing or not a JSON object."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {config_path!r} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {config_path!r} is not a JSON object")
    return config


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of `adapter_model.safetensors`, ValueError when it is missing or unreadable."""
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise ValueError(f"LoRA adapter {path!r} holds only adapter_model.bin; fastgen loads safetensors")
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    try:
        with safe_open(weights_path, framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"LoRA adapter {weights_path!r} is corrupt: {exc}") from exc


def _positive_number(config: dict, key: str, where: str) -> float:
    """`config[key]` as a positive number, ValueError otherwise."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}: {key} must be a positive number, got {value!r}")
    return value


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linears by module name (anything with `in_features`/`out_features`, quantized included;
    a LoRA-wrapped linear of `fastgen.models.lora_layers` under its own name, not its base's)."""
    linears = {name: module for name, module in model.named_modules()
               if hasattr(module, "in_features") and hasattr(module, "out_features")}
    return {name: module for name, module in linears.items()
            if not (name.endswith(".base") and hasattr(linears.get(name[:-len(".base")]), "lora_a"))}


def _known_targets(model: nn.Module, linears: dict[str, nn.Module], hf_modules: set[str]) -> set[str]:
    """The `target_modules` names an adapter of this model may use (leaf names): ours, HF's that the
    packing maps onto ours, and those of the modules the adapter's weights name (each is checked on its
    own: it must map onto a linear, or onto a module the loader skips)."""
    leaves = {name.rpartition(".")[2] for name in linears}
    packed = getattr(model, "packed_modules_mapping", {})
    named = {module.rpartition(".")[2] for module in hf_modules}
    return leaves | named | {hf for hf, (ours, _) in packed.items() if ours in leaves}


def _full_sizes(linear: nn.Module) -> list[int] | None:
    """The checkpoint rows of each projection merged into `linear` (all ranks'), None for an unmerged one."""
    return getattr(linear, "full_sizes", getattr(linear, "output_sizes", None))


def _module_target(hf_module: str, packed: dict) -> tuple[str, int | None]:
    """Our module name and shard index (None = the whole module) for an HF module path."""
    parts = hf_module.split(".")
    shard = None
    for i, part in enumerate(parts):
        if part in packed:
            parts[i], index = packed[part]
            shard = index if index is not None else shard
    return ".".join(parts), shard


def _check_targets(config: dict, model: nn.Module, linears: dict[str, nn.Module], hf_modules: set[str],
                   where: str) -> None:
    """ValueError for a `target_modules` entry the model has no linear for, or an embedding/head target."""
    targets = config.get("target_modules")
    if isinstance(targets, str) or targets is None:
        return  # a regex or "all-linear": the weight names say what is adapted, and each is checked
    known = _known_targets(model, linears, hf_modules)
    for target in targets:
        leaf = str(target).rpartition(".")[2]
        if leaf in _EMBEDDING_TARGETS:
            raise ValueError(f"{where}: adapting {target!r} (embedding / LM head) is not supported")
        if leaf not in known:
            raise ValueError(f"{where}: target module {target!r} is not a linear of {type(model).__name__} "
                             f"(known: {sorted(known)})")


def _pairs(weights: dict[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module path -> (A, B), ValueError for a stray tensor or half a pair."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        for half in ("lora_A", "lora_B"):
            suffix = f".{half}.weight"
            if key.startswith(_PREFIX) and key.endswith(suffix):
                halves.setdefault(key[len(_PREFIX):-len(suffix)], {})[half] = tensor
                break
        else:
            if "lora_embedding" in key:
                raise ValueError(f"{where}: adapted embeddings ({key!r}) are not supported")
            raise ValueError(f"{where}: tensor {key!r} is not a PEFT LoRA weight "
                             f"('{_PREFIX}<module>.lora_A.weight' / 'lora_B.weight')")
    pairs = {}
    for module, found in halves.items():
        if set(found) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(found)).pop()
            raise ValueError(f"{where}: {module} has no {missing} weight")
        pairs[module] = (found["lora_A"], found["lora_B"])
    if not pairs:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return pairs


def _is_conv1d(model: nn.Module, hf_module: str) -> bool:
    """Whether HF keeps `hf_module` as a `Conv1D` (the family's `conv1d_modules`)."""
    return any(hf_module == name or hf_module.endswith(f".{name}") for name in getattr(model, "conv1d_modules", ()))


def _adapt_pairs(model: nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int,
                 fan_in_fan_out: bool, where: str) -> list[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """(HF module, our module path, A, B) per pair in our layout (the family's `adapt_lora_pair`), the
    pairs of modules the loader skips left out; ValueError for a pair not of rank `rank`, `fan_in_fan_out`
    on a module HF keeps as a Linear, or a pair the family cannot adapt."""
    adapt = getattr(model, "adapt_lora_pair", None)
    adapted = []
    for hf_module, (a, b) in sorted(pairs.items()):
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{where}: {hf_module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                             f"not rank {rank} (r in {CONFIG_FILE})")
        if fan_in_fan_out and not _is_conv1d(model, hf_module):
            raise ValueError(f"{where}: fan_in_fan_out is set, but {type(model).__name__}'s {hf_module} is not a "
                             f"Conv1D in HF (a weight stored [in, out], as GPT-2's are): fan_in_fan_out belongs to "
                             f"an adapter of a Conv1D model")
        try:
            result = (hf_module, a, b) if adapt is None else adapt(hf_module, a, b)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        except RuntimeError as exc:  # B's rows cannot take the family's reordering (a reshape): another model's
            raise ValueError(f"{where}: {hf_module} has B {tuple(b.shape)}, whose rows do not fit "
                             f"{type(model).__name__}'s layout ({exc})") from exc
        if result is not None:
            adapted.append((hf_module, *result))
    return adapted


def load_lora_adapter(name: str, path: str, model: nn.Module, max_lora_rank: int,
                      dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read the PEFT adapter at `path` for `model` (a `DecoderLM`, meta weights are enough) and check it.

    ValueError, naming the problem, for missing or corrupt files, `r` over `max_lora_rank`, an
    unknown target module, a shape that does not fit the base linear, a module the family cannot adapt,
    or a PEFT feature not implemented.
    """
    where = f"LoRA adapter {name!r} ({path})"
    config = _read_config(path)
    _refuse_unsupported(config, where)
    rank = _positive_number(config, "r", where)
    if not isinstance(rank, int):
        raise ValueError(f"{where}: r must be an integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank {max_lora_rank}")
    alpha = _positive_number(config, "lora_alpha", where)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    linears = _linears(model)
    pairs = _pairs(_read_weights(path), where)
    _check_targets(config, model, linears, set(pairs), where)
    packed = getattr(model, "packed_modules_mapping", {})
    pieces: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
    for hf_module, module_path, a, b in _adapt_pairs(model, pairs, rank, bool(config.get("fan_in_fan_out")), where):
        ours, shard = _module_target(module_path, packed)
        base = linears.get(ours)
        sizes = None if base is None else _full_sizes(base)
        # A projection the merged linear lacks too (Gemma 4's v_proj where V is K's projection).
        if base is None or (shard is not None and shard >= len(sizes or ())):
            raise ValueError(f"{where}: weights name module {hf_module!r}, which {type(model).__name__} has no "
                             f"linear for")
        in_features = getattr(base, "full_in_features", base.in_features)
        rows = (sum(sizes) if sizes else base.out_features) if shard is None else sizes[shard]
        if a.shape[1] != in_features or b.shape[0] != rows:
            raise ValueError(f"{where}: {hf_module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but the base "
                             f"linear takes {in_features} inputs to {rows} outputs")
        pieces.setdefault(ours, []).append((shard, a, b))
    modules = {}
    for ours, parts in pieces.items():
        base = linears[ours]
        sizes = _full_sizes(base)
        if sizes is None:  # a linear of its own
            (_, a, b), = parts
            modules[ours] = LoRAModule(a=a.to(dtype), b=b.to(dtype))
            continue
        a_full = torch.zeros(rank * len(sizes), getattr(base, "full_in_features", base.in_features), dtype=dtype)
        b_full = torch.zeros(sum(sizes), rank * len(sizes), dtype=dtype)
        for shard, a, b in parts:
            # A pair over the whole merged linear (a checkpoint that fuses it too) serves each
            # projection with the same A and that projection's rows of B: the same delta.
            for j in range(len(sizes)) if shard is None else (shard,):
                start = sum(sizes[:j])
                a_full[j * rank:(j + 1) * rank] = a
                rows = b if shard is not None else b[start:start + sizes[j]]
                b_full[start:start + sizes[j], j * rank:(j + 1) * rank] = rows
        modules[ours] = LoRAModule(a=a_full, b=b_full)
    return LoRAAdapter(name=name, path=path, rank=rank, scale=scale, modules=modules)

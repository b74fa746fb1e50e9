"""One normalised view of a Hugging Face `config.json`, whichever transformers version wrote it.

transformers 4.x writes `torch_dtype`, `rope_theta` and `rope_scaling`; 5.x writes `dtype` and
`rope_parameters` (holding `rope_theta` too). Real checkpoints use both, so we read both here and
the model code sees one shape.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from fastgen.models.parallel import SINGLE, TensorParallel, kv_heads_per_rank

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(value: Any) -> torch.dtype | None:
    """Turn a config or user dtype (`"bfloat16"`, `"torch.float16"`, `torch.float32`, None) into a torch dtype."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        raise TypeError(f"dtype must be a string or torch.dtype, got {type(value).__name__}")
    name = value.removeprefix("torch.")
    if name == "auto":
        return None
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r} (supported: float32, float16, bfloat16)")
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One tensor of fixed-size state a layer keeps per sequence (a recurrent layer's conv window or
    state matrix): the engine gives each running sequence one slot of a `[num_slots, *shape]` pool."""

    shape: tuple[int, ...]
    """Per-sequence shape over all tensor-parallel ranks."""
    dtype: torch.dtype | None = None
    """Storage dtype; None = the model's (a recurrence's state matrix asks for float32)."""
    split_dim: int = 0
    """The dimension tensor-parallel ranks split evenly (their heads' channels)."""

    def shape_per_rank(self, tensor_parallel: int) -> tuple[int, ...]:
        """This tensor's per-sequence shape on one of `tensor_parallel` ranks."""
        size = self.shape[self.split_dim]
        if size % tensor_parallel:
            raise ValueError(f"tensor_parallel {tensor_parallel} must divide the recurrent state's {size} channels")
        return tuple(d // tensor_parallel if i == self.split_dim else d for i, d in enumerate(self.shape))


@dataclass(slots=True)
class ModelConfig:
    """The architecture facts the model code and the engine need, with HF's raw dict kept."""

    model_type: str
    """HF `model_type` (the registry key)."""
    vocab_size: int
    """Rows of the embedding and the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the MLP's hidden layer."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (< num_heads for GQA, 1 for MQA)."""
    head_dim: int
    """Per-head width (explicit in Qwen3 configs, else hidden_size // num_heads)."""
    max_position_embeddings: int
    """Longest context the checkpoint claims."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the norms (RMSNorm, or LayerNorm's `layer_norm_epsilon`)."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    rope_scaling: dict | None = None
    """Rotary scaling dict (`rope_type` plus its parameters), None for plain rotary."""
    partial_rotary_factor: float = 1.0
    """Fraction of head_dim that is rotated."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix (the checkpoint may omit `lm_head.weight`)."""
    attention_bias: bool = False
    """q/k/v projections carry biases."""
    mlp_bias: bool = False
    """MLP projections carry biases."""
    hidden_act: str = "silu"
    """Activation of the gated MLP."""
    layer_sliding_windows: list[int] = field(default_factory=list)
    """Per layer: sliding-window size, 0 = full attention."""
    kv_latent_dim: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; configs with `kv_lora_rank`): the width of
    the one vector cached per token and layer in place of K and V, `kv_lora_rank + qk_rope_head_dim`.
    0: K and V per KV head."""
    layer_kv_heads: list[tuple[int, int] | None] = field(default_factory=list)
    """Per layer, for a family whose layers cache differently (Gemma 4; set by its `model_config`):
    `(KV heads, head_dim)` of the K and V the layer caches, or None for a layer that attends another
    layer's cache and owns none. Empty: every layer caches `(num_kv_heads, head_dim)`."""
    layer_states: list[tuple[StateSpec, ...]] = field(default_factory=list)
    """Per layer, for a hybrid family (set by its `model_config`): the per-sequence state tensors the
    layer keeps instead of K/V (Gated DeltaNet's conv window and delta-rule state), `()` for a layer
    that keeps none. Empty: no layer keeps state (the model needs no state slots)."""
    dtype: torch.dtype | None = None
    """dtype the checkpoint was saved in, None if the config does not say."""
    eos_token_id: list[int] = field(default_factory=list)
    """End-of-sequence ids from config.json (generation_config.json may add more)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id."""
    raw: dict = field(default_factory=dict)
    """The config.json dict as read (plus the generic names of `_KEY_ALIASES`), for family-specific fields."""
    parallel: TensorParallel = SINGLE
    """This process's tensor-parallel rank and group (set by the loader; not from config.json)."""

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Normalise a config.json dict (4.x or 5.x key names)."""
        if "model_type" not in raw:
            raise ValueError("config.json has no 'model_type'")
        text = raw.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in raw:
            # A multimodal checkpoint: its text model, with the top level's word on tying (what its head does).
            tied = {"tie_word_embeddings": raw["tie_word_embeddings"]} if "tie_word_embeddings" in raw else {}
            raw = {**text, **tied, "model_type": raw["model_type"]}
        raw = _with_key_aliases(raw)
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if raw.get("multi_query") and not raw.get("new_decoder_architecture"):
            num_kv_heads = 1  # Falcon-7B style multi-query: one K/V head whatever num_kv_heads says
        rope_theta, rope_scaling = _rope_settings(raw)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=raw["model_type"],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw.get("intermediate_size", 4 * raw["hidden_size"]),
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=(raw.get("rope_parameters") or {}).get(
                "partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)
            ),
            tie_word_embeddings=raw.get("tie_word_embeddings", raw["model_type"] in _TIED_BY_DEFAULT),
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            hidden_act=raw.get("hidden_act", "silu"),
            layer_sliding_windows=_layer_sliding_windows(raw),
            kv_latent_dim=raw["kv_lora_rank"] + raw.get("qk_rope_head_dim", 0) if raw.get("kv_lora_rank") else 0,
            dtype=parse_dtype(raw.get("dtype", raw.get("torch_dtype"))),
            eos_token_id=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            raw=raw,
        )

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        """Read and normalise `path` (a config.json)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def kv_cache_shapes(self, tensor_parallel: int | None = None) -> tuple[tuple[int, int], ...]:
        """`(heads, width)` of each cache tensor one rank allocates per layer (`[num_blocks, block_size,
        heads, width]`, `fastgen.ops.kv_cache`): K and V of its KV heads, or, with `kv_latent_dim`, MLA's
        one latent vector (a single "head" every rank holds whole). The one layout the runner
        allocates and the planner sizes. `tensor_parallel` None is this process's own group
        (`parallel`); ranks beyond the KV heads each hold a copy."""
        if self.kv_latent_dim:
            return ((1, self.kv_latent_dim),)
        size = self.parallel.size if tensor_parallel is None else tensor_parallel
        kv_heads = kv_heads_per_rank(self.num_kv_heads, size)
        return ((kv_heads, self.head_dim), (kv_heads, self.head_dim))

    def layer_kv_cache_shapes(self, tensor_parallel: int | None = None) -> list[tuple[tuple[int, int], ...]]:
        """Per layer, the `(heads, width)` of each cache tensor one rank allocates for it: `kv_cache_shapes`,
        or the layer's own from `layer_kv_heads`, `()` for a layer that owns no cache. What the
        runner allocates and the planner sizes."""
        if not self.layer_kv_heads:
            return [self.kv_cache_shapes(tensor_parallel)] * self.num_layers
        size = self.parallel.size if tensor_parallel is None else tensor_parallel
        shapes = []
        for entry in self.layer_kv_heads:
            if entry is None:
                shapes.append(())
                continue
            heads, width = entry
            kv_heads = kv_heads_per_rank(heads, size)
            shapes.append(((kv_heads, width), (kv_heads, width)))
        return shapes

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps a per-sequence state (a hybrid model: each running sequence needs a slot)."""
        return any(self.layer_states)

    def layer_state_shapes(self, tensor_parallel: int | None = None
                           ) -> list[tuple[tuple[tuple[int, ...], torch.dtype | None], ...]]:
        """Per layer, `(per-sequence shape, dtype or None for the model's)` of each state tensor one rank
        keeps (`()` for a layer without state): what the runner allocates `[num_slots, *shape]` of."""
        size = self.parallel.size if tensor_parallel is None else tensor_parallel
        if not self.layer_states:
            return [()] * self.num_layers
        return [tuple((spec.shape_per_rank(size), spec.dtype) for spec in layer) for layer in self.layer_states]

    def state_bytes_per_seq(self, dtype: torch.dtype, tensor_parallel: int | None = None) -> int:
        """Bytes of one sequence's state over all layers on one rank (`dtype` for tensors of the model's dtype)."""
        return sum(math.prod(shape) * torch.empty((), dtype=state_dtype or dtype).element_size()
                   for layer in self.layer_state_shapes(tensor_parallel) for shape, state_dtype in layer)

    def kv_bytes_per_token(self, dtype: torch.dtype, tensor_parallel: int | None = None) -> int:
        """KV-cache bytes of one token over all layers on one rank, in `dtype` (`layer_kv_cache_shapes`)."""
        values = sum(heads * width for layer in self.layer_kv_cache_shapes(tensor_parallel) for heads, width in layer)
        return values * torch.empty((), dtype=dtype).element_size()


# Family-specific names of generic keys (GPT-2, OPT, Falcon). The family's own key wins: it is the
# one HF's modeling code reads, and such configs may also carry a stale generic key.
_KEY_ALIASES = {
    "hidden_size": ("n_embd", "n_embed"),
    "num_hidden_layers": ("n_layer",),
    "num_attention_heads": ("n_head",),
    "max_position_embeddings": ("n_positions",),
    "intermediate_size": ("n_inner", "ffn_dim", "ffn_hidden_size"),
    "rms_norm_eps": ("layer_norm_epsilon",),
    "num_key_value_heads": ("num_kv_heads",),
}

# Model types whose HF config class ties the LM head to the embedding when config.json is silent.
_TIED_BY_DEFAULT = frozenset({"falcon", "gpt2", "opt"})


def _with_key_aliases(raw: dict) -> dict:
    """A copy of `raw` with each generic key set from its family alias, where one is set (not null)."""
    out = dict(raw)
    for key, aliases in _KEY_ALIASES.items():
        for alias in aliases:
            if raw.get(alias) is not None:
                out[key] = raw[alias]
                break
    return out


def _rope_settings(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from 5.x `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw["rope_scaling"]) if raw.get("rope_scaling") else {}
    # 4.x configs may name the kind `type`; keep only `rope_type` so both formats give one dict.
    legacy_type = scaling.pop("type", "default")
    rope_type = scaling.pop("rope_type", legacy_type)
    if rope_type == "default":
        return float(theta), None
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def _layer_sliding_windows(raw: dict) -> list[int]:
    """Sliding-window size per layer (0 = full), following each family's config rules."""
    num_layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window") or 0
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        window = 0
    layer_types = raw.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else 0 for t in layer_types]
    if "max_window_layers" in raw:
        # Qwen2/Qwen3: the first max_window_layers layers use full attention.
        return [window if i >= raw["max_window_layers"] else 0 for i in range(num_layers)]
    return [window] * num_layers


def load_generation_eos(model_dir: str) -> list[int]:
    """EOS ids from the checkpoint's generation_config.json (empty if absent)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)

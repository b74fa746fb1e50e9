"""Rotary position embeddings (RoPE) with the Hugging Face scaling types.

`build_rotary_embedding` turns a model's rope settings (`rope_theta` plus the HF `rope_scaling` dict)
into a `RotaryEmbedding` that holds a precomputed fp32 cos/sin cache, one row per position, and rotates
query and key heads in the NeoX "rotate_half" layout that HF Llama uses. The frequencies are computed
with the same fp32 operations as `transformers.modeling_rope_utils`, so the cache matches HF's cos/sin.
Forward only gathers rows by position, so its shapes are static and it compiles with fullgraph=True.

LongRoPE (Phi-3) has two factor sets, and Hugging Face picks one per forward pass: the long factors
for every token once the sequence is longer than `original_max_position_embeddings`. Which tokens
those are depends on the sequence, not the position, so the step says it per token (`long_rope`, from
`LongRopeSwitch`); the cache holds the long-factor rows of the positions below `original_max` after
the per-position rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
"""The `rope_type` values this module implements ("su" is accepted as the old name of "longrope")."""

DEFAULT_MAX_CACHE_POSITIONS: int = 1 << 17
"""Cap on precomputed positions when the caller gives no `max_cache_len`: 131072 positions cover
Llama-3.1, Phi-3-128k and Qwen2.5 YaRN x4 and cost 64 MiB at rotary_dim 128 (cos and sin, fp32). A
model that claims more context needs `max_cache_len` (the engine's max model length)."""


def _inv_freq(base: float, dim: int) -> torch.Tensor:
    """Unscaled inverse frequencies `base^(-2i/dim)`, computed exactly as HF does."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (base**exponents)


def _number(params: Mapping[str, Any], key: str, rope_type: str, default: float | None = None) -> float:
    """Read a positive number from the rope dict, with a clear error when missing or invalid."""
    value = params.get(key)
    value = default if value is None else value
    if value is None:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"rope_scaling[{key!r}] must be a positive number, got {value!r}")
    return float(value)


def _llama3_inv_freq(params: Mapping[str, Any], base: float, dim: int, original_max: float) -> torch.Tensor:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, blend smoothly in between."""
    factor = _number(params, "factor", "llama3")
    low_freq_factor = _number(params, "low_freq_factor", "llama3")
    high_freq_factor = _number(params, "high_freq_factor", "llama3")
    # Equal factors (Llama 4 Scout's 1.0 and 1.0) leave no band to blend: every frequency is kept or divided.
    if high_freq_factor < low_freq_factor:
        raise ValueError(
            f"rope_scaling needs high_freq_factor >= low_freq_factor, got {high_freq_factor} < {low_freq_factor}"
        )
    inv_freq = _inv_freq(base, dim)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_max / low_freq_factor, inv_freq / factor, inv_freq)
    # With equal factors the blend divides by zero, but `is_medium` below then selects none of it (as in HF).
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < original_max / high_freq_factor) * ~(wavelen > original_max / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    params: Mapping[str, Any], base: float, dim: int, factor: float, original_max: float
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp in between; returns the mscale too."""

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _number(params, "attention_factor", "yarn")
    else:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_ext_factors(params: Mapping[str, Any], key: str, dim: int) -> torch.Tensor:
    """One LongRoPE per-frequency factor list, checked to have rotary_dim // 2 positive entries."""
    values = params.get(key)
    if not isinstance(values, (list, tuple)) or len(values) != dim // 2:
        raise ValueError(f"rope_scaling[{key!r}] must list rotary_dim // 2 = {dim // 2} numbers, got {values!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"rope_scaling[{key!r}] must hold positive numbers, got {values!r}")
    return torch.tensor(values, dtype=torch.float32, device="cpu")


def _angles(
    rope_type: str,
    params: Mapping[str, Any],
    base: float,
    dim: int,
    max_position: int,
    max_cache_len: int | None,
) -> tuple[torch.Tensor, float, torch.Tensor | None]:
    """Rotation angles `[cache_len, dim // 2]` (fp32), the attention factor, and for LongRoPE the
    long-factor angles of the positions below `original_max` (None for the other types)."""
    factor = 1.0
    original_max = _number(params, "original_max_position_embeddings", rope_type, max_position)
    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = _inv_freq(base, dim)
    elif rope_type == "linear":
        factor = _number(params, "factor", rope_type)
        inv_freq = _inv_freq(base, dim) / factor
    elif rope_type == "dynamic":
        factor = _number(params, "factor", rope_type)
    elif rope_type == "llama3":
        factor = _number(params, "factor", rope_type)
        inv_freq = _llama3_inv_freq(params, base, dim, original_max)
    elif rope_type == "yarn":
        factor = _number(params, "factor", rope_type, max_position / original_max)
        inv_freq, attention_factor = _yarn_inv_freq(params, base, dim, factor, original_max)
    else:  # longrope
        factor = _number(params, "factor", rope_type, max_position / original_max)
        if params.get("attention_factor") is not None:
            attention_factor = _number(params, "attention_factor", rope_type)
        else:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    # Linear and dynamic extend max_position itself; the others extend original_max (for Llama-3.1 and
    # Phi-3 max_position already is the extended length, for YaRN models it often is not).
    if rope_type in ("linear", "dynamic"):
        extended = max_position * factor
    else:
        extended = max(max_position, original_max * factor)
    cache_len = max_cache_len if max_cache_len is not None else min(math.ceil(extended), DEFAULT_MAX_CACHE_POSITIONS)
    positions = torch.arange(cache_len, dtype=torch.int64, device="cpu")
    if rope_type == "dynamic":
        # HF recomputes the base from the current sequence length (max position + 1) once it exceeds
        # max_position; we know only per-token positions, so position p uses the base for
        # seq_len = max(p + 1, max_position). That equals HF for every position below max_position and
        # for HF's cached decode step; HF's prefill of a longer sequence scales all its tokens with the
        # base of its last one instead. Beyond max_position HF computes the base in fp32 tensor math.
        seq_len = positions[max_position:] + 1
        long_base = base * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        rows = 1.0 / (long_base[:, None] ** exponents[None, :])
        inv_freq = torch.cat((_inv_freq(base, dim).expand(min(cache_len, max_position), -1), rows))
    long_prefix = None
    if rope_type == "longrope":
        # By position: short factors below original_max, long ones from it on (a position there is
        # always in a long sequence). The long rows below original_max are kept apart, for the tokens
        # of sequences that are longer than original_max (the step's `long_rope`).
        shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        short = 1.0 / (_longrope_ext_factors(params, "short_factor", dim) * base**shape)
        long = 1.0 / (_longrope_ext_factors(params, "long_factor", dim) * base**shape)
        inv_freq = torch.where((positions < original_max)[:, None], short, long)
        long_prefix = torch.arange(int(original_max), dtype=torch.int64, device="cpu").float()[:, None] * long
    return positions.float()[:, None] * inv_freq, float(attention_factor), long_prefix


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings from a precomputed cos/sin cache (NeoX "rotate_half" layout).

    Build it with `build_rotary_embedding`, once per model, and share it across layers. Only the first
    `rotary_dim` dims of each head are rotated (partial rotary, as in Phi); the rest pass through.
    """

    def __init__(self, head_dim: int, cos_sin_cache: torch.Tensor, long_prefix: torch.Tensor | None = None) -> None:
        """`cos_sin_cache`: `[max_positions, rotary_dim]`, cos in the first half and sin in the second,
        already multiplied by the scaling's attention factor. `long_prefix` (LongRoPE only): the rows
        of positions `0 .. original_max - 1` with the long factors, laid out the same way."""
        super().__init__()
        if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2 or not cos_sin_cache.is_floating_point():
            raise ValueError(f"cos_sin_cache must be a float [positions, even rotary_dim], got {cos_sin_cache.shape}")
        if not 0 < cos_sin_cache.shape[1] <= head_dim:
            raise ValueError(f"rotary_dim {cos_sin_cache.shape[1]} must be in (0, head_dim={head_dim}]")
        self.head_dim = head_dim
        self.rotary_dim = cos_sin_cache.shape[1]
        self._max_positions = cos_sin_cache.shape[0]
        self.original_max: int | None = None
        """LongRoPE's `original_max_position_embeddings` (None: one factor set, `long_rope` is ignored)."""
        if long_prefix is not None:
            if long_prefix.shape[1:] != cos_sin_cache.shape[1:]:
                raise ValueError(f"long_prefix must be [positions, {self.rotary_dim}], got {tuple(long_prefix.shape)}")
            self.original_max = long_prefix.shape[0]
            # One buffer, so a long token's row is an offset into the same gather: [per position; long prefix].
            cos_sin_cache = torch.cat((cos_sin_cache, long_prefix.to(cos_sin_cache)))
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "RotaryEmbedding":
        # `model.to(torch.bfloat16)` would round the cache; let it follow the device but keep its dtype.
        cache = self.cos_sin_cache
        super()._apply(fn, recurse)
        self.cos_sin_cache = cache.to(device=self.cos_sin_cache.device)
        return self

    @property
    def max_positions(self) -> int:
        """Number of cached positions; positions at or beyond it are out of range."""
        return self._max_positions

    def extra_repr(self) -> str:
        """Sizes shown by `print(model)`."""
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_positions={self.max_positions}"

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x` rotated by full-width `cos` (`[cos, cos]`) and `sin` (`[-sin, sin]`) of `x`'s dtype: with
        x = [x1, x2], x * cos + [x2, x1] * sin is [x1 cos - x2 sin, x2 cos + x1 sin], rotate_half's result
        to the bit (negating is exact), in four ops where the halves took eleven.

        The math runs in `x`'s dtype, as Hugging Face's `apply_rotary_pos_emb` runs it (cos and sin cast
        to the activations' dtype, each product and the sum rounded to it), so a bf16 model rotates
        exactly as HF's does, in half the memory traffic of fp32 temporaries."""
        x_rot = x if self.rotary_dim == x.shape[-1] else x[..., : self.rotary_dim]
        rolled = x_rot.roll(self.rotary_dim // 2, dims=-1).mul_(sin)
        out = (x_rot * cos).add_(rolled)
        if self.rotary_dim < self.head_dim:
            out = torch.cat((out, x[..., self.rotary_dim :]), dim=-1)
        return out

    def _cos_sin(self, positions: torch.Tensor, long_rope: torch.Tensor | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-width cos and sin rows `[T, 1, rotary_dim]` of the tokens at `positions`, in `dtype`
        (see `_rotate`)."""
        rows = positions
        if self.original_max is not None and long_rope is not None:
            rows = torch.where(long_rope & (positions < self.original_max), positions + self._max_positions, positions)
        cos, sin = self.cos_sin_cache.index_select(0, rows).to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, long_rope: torch.Tensor | None = None,
        step_cache: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query` `[T, num_q_heads, head_dim]` and `key` `[T, num_kv_heads, head_dim]` by the
        int64 `positions` `[T]`; math and results in the inputs' dtype, as HF's. Positions must be below
        `max_positions` (not checked on the device: that would need a host sync). With LongRoPE,
        `long_rope` (bool `[T]`) gives the tokens below `original_max` the long factors too; None
        keeps the choice by position. `step_cache` (eager only; the step's `AttentionMetadata.step_plans`):
        a dict that lives for one step, where the first layer leaves the gathered cos/sin rows for the
        others (the same positions in every layer; the gather was most of a layer's rotary time at one token)."""
        if positions.dim() != 1 or positions.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"positions must be a 1-D int64 tensor, got {positions.dtype} {tuple(positions.shape)}")
        for name, x in (("query", query), ("key", key)):
            if x.dim() != 3 or x.shape[0] != positions.shape[0] or x.shape[2] != self.head_dim:
                raise ValueError(
                    f"{name} must be [{positions.shape[0]}, heads, {self.head_dim}], got {tuple(x.shape)}"
                )
        if step_cache is None or torch.compiler.is_compiling():
            cos, sin = self._cos_sin(positions, long_rope, query.dtype)
        else:
            # Keyed by this module: a model whose layers use two rotaries (local and global bases) keeps both.
            entry = (self, query.dtype)
            if entry not in step_cache:
                step_cache[entry] = self._cos_sin(positions, long_rope, query.dtype)
            cos, sin = step_cache[entry]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


def build_rotary_embedding(
    head_dim: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    max_cache_len: int | None = None,
) -> RotaryEmbedding:
    """Build the `RotaryEmbedding` for a model's rope settings.

    `max_position` is the config's `max_position_embeddings`, `base` its `rope_theta`, `rope_scaling`
    the HF dict (transformers 4.x `rope_scaling`, or 5.x `rope_parameters` whose `rope_theta` and
    `partial_rotary_factor` keys are ignored: `base` and `rotary_dim` rule) or None. `dtype` is the
    cache's dtype (keep fp32: the rotation runs in fp32 anyway). `max_cache_len` sets how many positions
    to precompute; by default the context the scaling claims, capped at `DEFAULT_MAX_CACHE_POSITIONS`.
    """
    for name, value in (("head_dim", head_dim), ("rotary_dim", rotary_dim), ("max_position", max_position)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and <= head_dim={head_dim}, got {rotary_dim}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise ValueError(f"base (rope_theta) must be a number > 1, got {base!r}")
    if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len <= 0):
        raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    params = rope_scaling or {}
    rope_type = params.get("rope_type", params.get("type")) or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "dynamic" and rotary_dim == 2:
        raise ValueError("dynamic NTK scaling needs rotary_dim > 2 (its base exponent is dim / (dim - 2))")
    angles, attention_factor, long_prefix = _angles(rope_type, params, float(base), rotary_dim, max_position,
                                                    max_cache_len)

    def rows(a: torch.Tensor) -> torch.Tensor:
        return torch.cat((a.cos() * attention_factor, a.sin() * attention_factor), dim=-1).to(device=device, dtype=dtype)

    return RotaryEmbedding(head_dim, rows(angles), None if long_prefix is None else rows(long_prefix))


@dataclass(frozen=True, slots=True)
class LongRopeSwitch:
    """Which tokens take LongRoPE's long factors, as Hugging Face decides it (per forward pass: all the
    tokens of a forward whose sequence is longer than `original_max`)."""

    original_max: int
    """`original_max_position_embeddings`: sequences longer than this use the long factors."""
    whole_sequence: bool
    """Phi-3: HF's generate drops the KV cache when a sequence first outgrows `original_max` and
    recomputes it with the long factors, so every token of a sequence longer than `original_max` has
    them (the engine recomputes such a sequence's KV at the crossing). Otherwise (HF's generic
    LongRoPE) cached tokens keep theirs: long iff the prompt was longer or the position is past it."""

    def sequence_is_long(self, num_prompt_tokens: int, num_tokens: int) -> bool:
        """Whether every token of a sequence (prompt + generated so far) takes the long factors."""
        return (num_tokens if self.whole_sequence else num_prompt_tokens) > self.original_max


def long_rope_switch(model: nn.Module) -> LongRopeSwitch | None:
    """The model's `LongRopeSwitch`, None when its rotary embedding has one factor set. A model class
    says `long_rope_whole_sequence = True` when its HF generation recomputes at the crossing."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding) and module.original_max is not None:
            return LongRopeSwitch(module.original_max, bool(getattr(model, "long_rope_whole_sequence", False)))
    return None

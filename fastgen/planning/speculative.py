"""`speculative_config`, spelled as vLLM spells it, and the plan's choice of when speculation pays.

Two methods propose tokens that the target model then verifies in one step (several tokens of a row
checked at once, accepted by the rejection sampler, so the output is the target's own):

- `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}`:
  prompt lookup over the sequence's own tokens, no model;
- `{"model": PATH, "num_speculative_tokens": k}` (method "draft_model"): a smaller checkpoint fastgen
  loads, with the target's vocabulary, proposing k tokens greedily from its own KV cache
  (`"quantization": "int8"` / `"int4"` quantizes it).

EAGLE-style heads and MTP layers (vLLM's "eagle", "eagle3", "medusa", "mtp", ...) are refused as not
implemented yet. A verification step of B rows computes B x (k + 1) tokens: where that costs more than
the accepted tokens save, the plan turns speculation off for the step (`disable_by_batch_size`); below
that cap the engine's `SpeculationGovernor` keeps it only where it measures faster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

from fastgen.models.quant import QUANTIZATIONS

METHODS = ("ngram", "draft_model")
"""The methods fastgen implements."""

NOT_IMPLEMENTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "qwen3_next_mtp",
                           "ernie_mtp", "glm4_moe_mtp", "suffix")
"""vLLM's other methods: refused with a clear error until fastgen builds them."""

MAX_SPECULATIVE_TOKENS = 32
"""More drafts per step than this are never worth verifying (each rejected one is wasted compute)."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A validated `speculative_config` (vLLM's keys; build it with `parse_speculative_config`)."""

    method: str
    """"ngram" (prompt lookup) or "draft_model" (a second, smaller checkpoint)."""
    num_speculative_tokens: int
    """Tokens proposed per row and step (k); a verification row computes k + 1 tokens."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest suffix n-gram that may match earlier tokens."""
    prompt_lookup_max: int | None = None
    """ngram: the longest suffix n-gram tried first."""
    model: str | None = None
    """draft_model: checkpoint directory or cached hub id of the draft (same vocabulary as the target)."""
    quantization: str | None = None
    """draft_model: weight-only quantization of the draft ("none", "int8", "int4"; None = "none")."""
    disable_by_batch_size: int | None = None
    """Steps with more decoding rows than this verify no drafts (vLLM's key); None = the plan chooses."""

    def to_dict(self) -> dict[str, Any]:
        """The config as vLLM's JSON keys (unset ones left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __str__(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def _positive_int(name: str, value: Any, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"speculative_config.{name} must be an int, got {value!r}")
    if value < 1 or (maximum is not None and value > maximum):
        bound = f"in [1, {maximum}]" if maximum is not None else "positive"
        raise ValueError(f"speculative_config.{name} must be {bound}, got {value}")
    return value


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """A `SpeculativeConfig` from a dict of vLLM's keys, its JSON text, or a config (None: no speculation).

    Raises ValueError/TypeError naming the key at fault; methods fastgen has not built are refused
    as "not implemented yet".
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON ({exc.msg}): {value!r}") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict (or its JSON text), got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))} "
                         f"(supported: {', '.join(sorted(known))})")
    method, model = value.get("method"), value.get("model")
    if method is None:
        method = "draft_model" if model is not None else None
    if not isinstance(method, str):
        raise ValueError('speculative_config needs "method" ("ngram") or "model" (a draft checkpoint), got '
                         f"{value!r}")
    if method in NOT_IMPLEMENTED_METHODS or method.endswith("_mtp"):
        raise ValueError(f"speculative_config method {method!r} is not implemented yet in fastgen "
                         f"(implemented: {', '.join(METHODS)})")
    if method not in METHODS:
        raise ValueError(f"speculative_config method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs num_speculative_tokens (tokens proposed per step)")
    k = _positive_int("num_speculative_tokens", value["num_speculative_tokens"], MAX_SPECULATIVE_TOKENS)
    disable = value.get("disable_by_batch_size")
    if disable is not None and (isinstance(disable, bool) or not isinstance(disable, int) or disable < 0):
        raise ValueError(f"speculative_config.disable_by_batch_size must be an int >= 0, got {disable!r}")
    if method == "ngram":
        for key in ("model", "quantization"):
            if value.get(key) is not None:
                raise ValueError(f'speculative_config.{key} is for a draft model, not method "ngram"')
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        # vLLM's defaults: both 5 when neither is given, else the one given for both.
        low, high = (5, 5) if low is None and high is None else (low if low is not None else high,
                                                                 high if high is not None else low)
        _positive_int("prompt_lookup_min", low)
        _positive_int("prompt_lookup_max", high)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        return SpeculativeConfig("ngram", k, low, high, disable_by_batch_size=disable)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if value.get(key) is not None:
            raise ValueError(f'speculative_config.{key} is for method "ngram", not a draft model')
    if not isinstance(model, str) or not model:
        raise ValueError('speculative_config method "draft_model" needs "model": the draft checkpoint\'s path or id')
    quantization = value.get("quantization")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"speculative_config.quantization must be one of {', '.join(map(repr, QUANTIZATIONS))}, "
                         f"got {quantization!r}")
    return SpeculativeConfig("draft_model", k, model=model, quantization=quantization, disable_by_batch_size=disable)


def check_speculative_config(name: str, value: Any) -> SpeculativeConfig | None:
    """The plan field's check (`plan_field`): `parse_speculative_config`."""
    return parse_speculative_config(value)


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Tokens a row gains per verification step when each draft is accepted with probability
    `acceptance` independently: 1 + a + a^2 + ... + a^k (the bonus or corrected token included)."""
    return sum(acceptance ** i for i in range(k + 1))


ASSUMED_ACCEPTANCE = 0.7
"""Acceptance per drafted token the plan assumes when it sizes `disable_by_batch_size`: n-gram lookup
drafts only where the text repeats itself, and there most drafts are right (scripts/bench_spec.py's
quoting workload; see docs/benchmarks.md). A draft model's acceptance depends on the pair of models."""


def choose_disable_by_batch_size(config: SpeculativeConfig, step_seconds, draft_step_seconds, max_seqs: int,
                                 rates: str) -> tuple[SpeculativeConfig, str]:
    """The largest decode batch B <= max_seqs at which verifying pays, and the reason.

    `step_seconds(T)` is the plan's time of a T-token target step (weights streamed once, matmuls at the
    machine's rate: `rates` words them), `draft_step_seconds(T)` the draft model's (0 for n-gram).
    Speculation pays while E x t(B) > t(B x (k + 1)) + k x t_draft(B), E = `expected_tokens_per_step`
    at `ASSUMED_ACCEPTANCE`: the verification step and the drafts must cost less than the E plain steps
    they replace. A user's `disable_by_batch_size` is kept.
    """
    k = config.num_speculative_tokens
    gain = expected_tokens_per_step(ASSUMED_ACCEPTANCE, k)

    def cost(batch: int) -> tuple[float, float]:
        return gain * step_seconds(batch), step_seconds(batch * (k + 1)) + k * draft_step_seconds(batch)

    if config.disable_by_batch_size is not None:
        return config, f"set by the user: {config}"
    best = 0
    for batch in range(1, max_seqs + 1):
        saved, spent = cost(batch)
        if saved <= spent:
            break
        best = batch
    saved, spent = cost(best + 1)
    head = (f"{config.method}, k={k}: a step of B decoding rows verifies B x {k + 1} tokens; at {ASSUMED_ACCEPTANCE} "
            f"acceptance a row gains {gain:.2f} tokens a step ({rates})")
    if best == 0:
        why = (f"{head}; even at B=1 verification costs {spent * 1e3:.2f} ms against {saved * 1e3:.2f} ms of plain "
               "steps it replaces: speculation stays off (set disable_by_batch_size to force it)")
    elif best >= max_seqs:
        why = f"{head}: it pays up to max_seqs={max_seqs}, so speculation is never turned off"
    else:
        why = (f"{head}: it pays up to B={best}; above, speculation is off for the step (at B={best + 1} verifying "
               f"costs {spent * 1e3:.2f} ms against {saved * 1e3:.2f} ms saved)")
    if best:
        why += ("; at run time each decode batch size up to that keeps verifying drafts only while its steps measure "
                "more tok/s with them than without (the slower choice re-measured now and then)")
    return replace(config, disable_by_batch_size=best), why


GPU_HBM_GBPS = {(9, 0): 4800.0, (8, 0): 2000.0}
"""HBM bandwidth by compute capability (H200: 4.8 TB/s, A100: 2.0 TB/s; the vendors' figures)."""
DEFAULT_GPU_HBM_GBPS = 900.0
"""Older GPUs (V100-class)."""


def step_time_model(weight_bytes: int, active_params: int, flops: float, stream_gbps: float):
    """A T-token step's seconds: the weights streamed once or the matmuls, whichever takes longer
    (decode steps are bound by the first, large steps by the second)."""
    def seconds(tokens: int) -> float:
        return max(weight_bytes / (stream_gbps * 1e9), 2.0 * active_params * tokens / flops)
    return seconds

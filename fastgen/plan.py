"""The `Plan`: how one model is served on one machine, one engine keyword per field, each with a reason.

`fastgen.policy.make_plan` fills it in; this module holds the record, the checks every override must
pass whatever the machine (types, ranges, order), and its table form.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from fastgen.models.config import parse_dtype

ATTENTION_BACKENDS = ("triton", "torch")
COMPILE_MODES = ("off", "default", "max-autotune")


@dataclass(slots=True)
class Plan:
    """How to serve one model on one machine. Each field is the engine keyword of the same name."""

    dtype: torch.dtype
    """Weights and KV-cache dtype."""
    attention_backend: str
    """Paged attention implementation: "triton" or "torch"."""
    compile: str
    """torch.compile mode of the model step: "off", "default" or "max-autotune"."""
    cuda_graphs: bool
    """Capture each bucket once as a CUDA graph and replay it."""
    buckets: tuple[int, ...]
    """Token counts a step is padded to (each compiled and captured once); ascending."""
    token_budget: int
    """Tokens computed per step (Dynamic SplitFuse)."""
    max_seqs: int
    """Sequences per step."""
    block_size: int
    """KV block size in tokens."""
    kv_cache_memory: int
    """KV-cache bytes per device."""
    tensor_parallel: int
    """Ranks each replica's weights are split over."""
    replica_num: int
    """Independent engine replicas behind a load balancer."""
    reasons: dict[str, str]
    """Field name -> one line saying why it has its value (one for every other field)."""

    def __post_init__(self) -> None:
        missing = [name for name in PLAN_FIELDS if not self.reasons.get(name, "").strip()]
        if missing:
            raise ValueError(f"a Plan needs a reason for every field; missing: {', '.join(missing)}")

    def engine_kwargs(self) -> dict[str, Any]:
        """The plan as engine keywords (every field but `reasons`)."""
        return {name: getattr(self, name) for name in PLAN_FIELDS}

    def table(self) -> str:
        """The plan as a text table: field | value | reason."""
        rows = [(name, _format_value(name, getattr(self, name)), self.reasons[name]) for name in PLAN_FIELDS]
        w1 = max(len("field"), *(len(r[0]) for r in rows))
        w2 = max(len("value"), *(len(r[1]) for r in rows))
        lines = [f"{'field':<{w1}} | {'value':<{w2}} | reason", f"{'-' * w1}-+-{'-' * w2}-+-{'-' * 6}"]
        lines += [f"{a:<{w1}} | {b:<{w2}} | {c}" for a, b, c in rows]
        return "\n".join(lines)


PLAN_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Plan) if f.name != "reasons")
"""The plan's keyword fields (all but `reasons`), in declaration order."""


def normalise_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Type-checked overrides with the "let the policy choose" values (None, "auto") dropped."""
    unknown = sorted(set(overrides) - set(PLAN_FIELDS))
    if unknown:
        raise TypeError(f"unknown plan option(s) {', '.join(map(repr, unknown))} (supported: {', '.join(PLAN_FIELDS)})")
    user = {k: v for k, v in overrides.items() if v is not None and not (k == "attention_backend" and v == "auto")}
    if "dtype" in user:
        user["dtype"] = parse_dtype(user["dtype"])
        if user["dtype"] is None:
            del user["dtype"]
    for name, allowed in (("attention_backend", ATTENTION_BACKENDS), ("compile", COMPILE_MODES)):
        if name in user and user[name] not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {user[name]!r}")
    if "cuda_graphs" in user and not isinstance(user["cuda_graphs"], bool):
        raise TypeError(f"cuda_graphs must be a bool, got {user['cuda_graphs']!r}")
    for name in ("token_budget", "max_seqs", "block_size", "tensor_parallel", "replica_num"):
        if name in user:
            value = user[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
    if "buckets" in user:
        buckets = user["buckets"]
        if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
            raise TypeError(f"buckets must be a sequence of ints, got {buckets!r}")
        buckets = tuple(buckets)
        if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets) \
                or any(a >= b for a, b in zip(buckets, buckets[1:])):
            raise ValueError(f"buckets must be positive ints in strictly ascending order, got {buckets!r}")
        user["buckets"] = buckets
    if "kv_cache_memory" in user:
        mem = user["kv_cache_memory"]
        if isinstance(mem, bool) or not isinstance(mem, (int, float)):
            raise TypeError(f"kv_cache_memory must be bytes (int) or a fraction (float), got {mem!r}")
        if (isinstance(mem, float) and not 0 < mem <= 1) or mem <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes or a fraction in (0, 1], got {mem}")
    return user


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def format_count(n: int) -> str:
    """A count with a K/M/B suffix: 6.74B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: 13.5 GiB, 512 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _format_value(name: str, value: Any) -> str:
    """A plan value as the table shows it (long bucket lists shortened)."""
    if name == "dtype":
        return dtype_name(value)
    if name == "kv_cache_memory":
        return format_bytes(value)
    if name == "buckets" and len(value) > 10:
        return f"{','.join(map(str, value[:5]))},...,{','.join(map(str, value[-3:]))} ({len(value)})"
    if name == "buckets":
        return ",".join(map(str, value))
    return str(value)

"""The `Plan`: how one model is served on one machine, one engine keyword per field, each with a reason.

`fastgen.planning.policy.make_plan` fills it in. Each field is declared once here (`plan_field`: its
meaning, the type of a user's override, its command-line parser and the check every override must
pass whatever the machine); the engine keywords (`EngineConfig`), `python -m fastgen.planning` and
`scripts/serve.py`'s flags are derived from these declarations.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from fastgen.models.config import parse_dtype
from fastgen.models.q8_head import LM_HEAD_QUANTIZATIONS
from fastgen.models.quant import INT4_GROUP_SIZES, QUANTIZATIONS
from fastgen.planning.speculative import SpeculativeConfig, check_speculative_config, parse_speculative_config

ATTENTION_BACKENDS = ("triton", "cpu", "torch")
"""Paged-attention implementations: Triton kernels (CUDA, or the interpreter), fastgen's C++ CPU kernel for
decode rows (prompt chunks on torch), torch ops."""
COMPILE_MODES = ("off", "default", "max-autotune")
"""`compile` settings: no torch.compile; Inductor's default; Inductor with autotuned kernels."""
OFFLOAD_MODES = ("none", "cpu", "disk")
"""`offload` settings: every weight resident; stream layers from host memory; from a file on disk."""
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "llguidance")
"""Grammar libraries that constrain structured outputs, the default first."""


def _check_choice(allowed: tuple[str, ...]) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    return check


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _check_int_from(minimum: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < minimum:
            raise ValueError(f"{name} must be {'positive' if minimum == 1 else f'>= {minimum}'}, got {value}")
        return value
    return check


_check_positive_int = _check_int_from(1)
_check_non_negative_int = _check_int_from(0)


def _check_group_size(name: str, value: Any) -> int:
    _check_positive_int(name, value)
    if value not in INT4_GROUP_SIZES:
        raise ValueError(f"{name} must be one of {', '.join(map(str, INT4_GROUP_SIZES))} (what the int4 kernels "
                         f"take), got {value}")
    return value


def _check_dtype(name: str, value: Any) -> torch.dtype | None:
    return parse_dtype(value)


def _check_buckets(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {value!r}")
    buckets = tuple(value)
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets) \
            or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name} must be positive ints in strictly ascending order, got {buckets!r}")
    return buckets


def _check_memory(name: str, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be bytes (int) or a fraction (float), got {value!r}")
    if (isinstance(value, float) and not 0 < value <= 1) or value <= 0:
        raise ValueError(f"{name} must be positive bytes or a fraction in (0, 1], got {value}")
    return value


def parse_bool(text: str) -> bool:
    """true/false, yes/no, on/off, 1/0 (a command-line value)."""
    value = text.strip().lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_ints(text: str) -> tuple[int, ...]:
    """Comma-separated token counts: 1,2,4,8 (a command-line value)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated ints, got {text!r}") from None


def parse_memory(text: str) -> int | float:
    """Bytes (an int) or a fraction of free memory (a float such as 0.5) (a command-line value)."""
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise ValueError(f"expected bytes (int) or a fraction (float), got {text!r}") from None


def plan_field(doc: str, option: str, parse: Callable[[str], Any], check: Callable[[str, Any], Any]) -> Any:
    """Declare a plan field once: `doc` (what it means, for every help text), `option` (the type of the
    override a user may pass: the annotation of its `EngineConfig` field), `parse` (its command-line
    value) and `check` (validates an override, returns it normalised, None = let the policy choose).
    `EngineConfig`, `python -m fastgen.planning`, `scripts/serve.py` and `normalise_overrides` all
    derive from these."""
    return field(metadata={"doc": doc, "option": option, "parse": parse, "check": check})


@dataclass(slots=True)
class Plan:
    """How to serve one model on one machine. Each field is the engine keyword of the same name."""

    dtype: torch.dtype = plan_field(
        "weights and KV-cache dtype", "torch.dtype | str | None", str, _check_dtype)
    quantization: str = plan_field(
        'weight-only quantization of the decoder layers\' linears: "none", "int8" (a scale per output channel) or '
        '"int4" (a scale and zero per quantization_group_size inputs); embeddings, LM head and MoE experts keep dtype. '
        "The policy quantizes only when the weights cannot fit otherwise", "str | None", str,
        _check_choice(QUANTIZATIONS))
    quantization_group_size: int = plan_field(
        "input features sharing one int4 scale and zero: 32, 64, 128 or 256 (unused unless quantization is int4)",
        "int | None", int, _check_group_size)
    attention_backend: str = plan_field(
        'paged attention implementation: "triton", "cpu" (fastgen\'s C++ decode kernel, built at first use; '
        'FASTGEN_CPU_KERNELS=off|avx2|avx512 caps its ISA) or "torch" ("auto" = the policy)', "str | None", str,
        _check_choice(ATTENTION_BACKENDS))
    compile: str = plan_field(
        'torch.compile of each decoder layer (regional: one graph the layers share): "off", "default" or '
        '"max-autotune" (the environment variable FASTGEN_COMPILE, when set, is the default instead of the '
        "policy's choice)", "str | None", str,
        _check_choice(COMPILE_MODES))
    cuda_graphs: bool = plan_field(
        "capture each bucket once as a CUDA graph and replay it (CUDA only)", "bool | None", parse_bool, _check_bool)
    buckets: tuple[int, ...] = plan_field(
        "token counts a step is padded to (each compiled and captured once), ascending; empty (the CPU "
        "plan's choice): exact step sizes under one symbolic-shape compile",
        "tuple[int, ...] | None", parse_ints, _check_buckets)
    token_budget: int = plan_field(
        "tokens computed per step (Dynamic SplitFuse; FastGen's max_ragged_batch_size)", "int | None", int,
        _check_positive_int)
    context_per_budget_token: int = plan_field(
        "attention charge of a prompt chunk against token_budget: a chunk of n tokens at offset c spends "
        "n + ceil((n*c + n(n+1)/2) / this) budget tokens, one more per this many positions its tokens attend, so "
        "chunks deeper into a long prompt are shorter and steps stay level; 0 = a chunk spends its tokens only",
        "int | None", int, _check_non_negative_int)
    max_seqs: int = plan_field(
        "sequences per step (FastGen's max_ragged_sequence_count), at most token_budget", "int | None", int,
        _check_positive_int)
    block_size: int = plan_field("KV block size in tokens", "int | None", int, _check_positive_int)
    state_slots: int = plan_field(
        "recurrent-state slots of a hybrid model (Qwen3.5, Qwen3-Next: linear-attention layers that keep a "
        "fixed-size state per sequence instead of K/V), one per running sequence; 0 for a model without such "
        "layers. The state cache is state_slots x the state of one sequence, beside the KV cache",
        "int | None", int, _check_non_negative_int)
    kv_prefault: bool = plan_field(
        "on a CPU, have the kernel map the KV cache's pages from a background thread after start-up "
        "(madvise MADV_POPULATE_WRITE, contents untouched), so steps do not take a page fault at each page's "
        "first write", "bool | None", parse_bool, _check_bool)
    kv_cache_memory: int = plan_field(
        "KV-cache size per device: bytes (int) or a fraction (float in (0, 1]) of the memory left after weights",
        "int | float | None", parse_memory, _check_memory)
    offload: str = plan_field(
        'where decoder layers that do not fit weight_memory stream from, one layer ahead of the compute: "none" '
        '(every weight resident), "cpu" (host memory; pinned on a GPU) or "disk" (a file written at load). The '
        "policy offloads only when the weights and the minimum KV cache do not fit", "str | None", str,
        _check_choice(OFFLOAD_MODES))
    weight_memory: int = plan_field(
        "device memory for weights with offload: bytes (int) or a fraction (float in (0, 1]) of this rank's "
        "weights; the embeddings, LM head and as many layers as fit stay resident, with two layer buffers to "
        "stream the rest through", "int | float | None", parse_memory, _check_memory)
    weight_prepack: bool = plan_field(
        "store the decoder layers' linear weights in oneDNN's blocked layout and multiply through its kernels "
        "(CPU only; not with quantization or offload)", "bool | None", parse_bool, _check_bool)
    gemv_weights: bool = plan_field(
        "with weight_prepack, keep the decoder layers' plain linear weights too (a second copy of them): steps of "
        "at most 4 rows (batch-1 decode) multiply over them with their output rows split over the cores, which "
        "the packed kernel does on one core (a tied LM head reads the embedding's weight, no copy)",
        "bool | None", parse_bool, _check_bool)
    lm_head_quantization: str = plan_field(
        'the LM head\'s weight: "none" (the plan dtype) or "q8_0" (GGUF\'s Q8_0: int8 in blocks of 32 inputs with '
        "an fp16 scale each, multiplied by fastgen's C++ CPU kernel against each hidden row quantized the same "
        "way, as llama.cpp computes a Q8_0 output layer; CPU only)", "str | None", str,
        _check_choice(LM_HEAD_QUANTIZATIONS))
    decode_layer_kernel: bool = plan_field(
        "on a CPU, run each decoder layer of a step of few rows (decode, verification rows, short prompt chunks) as "
        "one call of fastgen's C++ decode-layer op (norms, int4/int8 or bf16-tile linears, rotary, paged attention, "
        "SiLU MLP) instead of its compiled graph; layers of another shape keep their forward", "bool | None",
        parse_bool, _check_bool)
    adaptive_threads: bool = plan_field(
        "on a CPU, before each step estimate how many cores other processes kept busy over the last 0.1 s or more "
        "(/proc/stat's busy time less this process's) and run the step on the cores they leave free, at least one; "
        "the thread count the process started with is the most a step gets", "bool | None", parse_bool, _check_bool)
    tensor_parallel: int = plan_field(
        "ranks each replica's weights and KV cache are split over (one per GPU; on a CPU they share the cores; "
        "WORLD_SIZE under torchrun)", "int | None", int, _check_positive_int)
    replica_num: int = plan_field(
        "independent engine replicas behind a load balancer (a serving option; 1 for a pipeline)", "int | None", int,
        _check_positive_int)
    speculative_config: SpeculativeConfig | None = plan_field(
        'speculative decoding, vLLM\'s keys as a dict or JSON: {"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_min": a, "prompt_lookup_max": b} (prompt lookup) or {"model": PATH, '
        '"num_speculative_tokens": k} (a draft model); the plan sets disable_by_batch_size, the decode batch '
        "above which a step verifies no drafts; None = off", "SpeculativeConfig | dict | str | None",
        parse_speculative_config, check_speculative_config)
    structured_outputs_backend: str = plan_field(
        'the grammar library behind structured outputs and tool calling: "xgrammar" (grammars precompiled to '
        'per-state token masks, a CUDA bitmask kernel) or "llguidance" (masks computed per step, no '
        "precompile; also takes whitespace_pattern)", "str | None", str, _check_choice(STRUCTURED_OUTPUTS_BACKENDS))
    enable_lora: bool = plan_field(
        "serve LoRA adapters (PEFT format) beside the base model: each adaptable linear of the decoder layers gets "
        "max_loras stacked adapter slots, and each request may name an adapter (load_lora / lora=...)",
        "bool | None", parse_bool, _check_bool)
    max_loras: int = plan_field(
        "distinct LoRA adapters one step may use (device slots; the scheduler holds back a request whose adapter "
        "would make more); 0 with LoRA off", "int | None", int, _check_non_negative_int)
    max_lora_rank: int = plan_field(
        "largest adapter rank (PEFT's r) a slot holds; an adapter with a larger one is refused at load; 0 with "
        "LoRA off", "int | None", int, _check_non_negative_int)
    max_cpu_loras: int = plan_field(
        "adapters kept read and checked in host memory (least recently used evicted, then read again from "
        "their directory when next used), at least max_loras; 0 with LoRA off", "int | None", int,
        _check_non_negative_int)
    reasons: dict[str, str] = field(default_factory=dict)
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


PLAN_SPECS: dict[str, dataclasses.Field] = {f.name: f for f in fields(Plan) if f.name != "reasons"}
"""The plan's keyword fields (all but `reasons`) with their declarations, in order."""

PLAN_FIELDS: tuple[str, ...] = tuple(PLAN_SPECS)
"""The plan's keyword fields, in declaration order."""


def argument_type(name: str) -> Callable[[str], Any]:
    """Plan field `name`'s command-line value parser for argparse: the field's declared `parse`, its
    ValueError turned into argparse's error with the message kept. Both command lines (`python -m
    fastgen.planning` and `scripts/serve.py`) use it, so a value is spelled the same in each."""
    parse = PLAN_SPECS[name].metadata["parse"]

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", name)  # argparse names it in "invalid <type> value"
    return convert


def is_bool_field(name: str) -> bool:
    """Whether plan field `name` is a switch (its command-line flag may stand alone for True)."""
    return PLAN_SPECS[name].metadata["parse"] is parse_bool


def normalise_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Type-checked overrides with the "let the policy choose" values (None, "auto") dropped."""
    unknown = sorted(set(overrides) - set(PLAN_FIELDS))
    if unknown:
        raise TypeError(f"unknown plan option(s) {', '.join(map(repr, unknown))} (supported: {', '.join(PLAN_FIELDS)})")
    user = {}
    for name, value in overrides.items():
        if value is None or (name == "attention_backend" and value == "auto"):
            continue
        checked = PLAN_SPECS[name].metadata["check"](name, value)
        if checked is not None:
            user[name] = checked
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
    if name in ("kv_cache_memory", "weight_memory"):
        return format_bytes(value)
    if name == "buckets" and len(value) > 10:
        return f"{','.join(map(str, value[:5]))},...,{','.join(map(str, value[-3:]))} ({len(value)})"
    if name == "buckets":
        return ",".join(map(str, value)) or "none"
    if name == "speculative_config" and value is None:
        return "off"
    return str(value)

"""Which build of the C++ CPU kernels this machine runs: the ISA variants, their compiler flags, and the choice.

Each variant is the same source compiled for one instruction set, picked at run time from what the CPU
reports (through torch's own CPU detection, which also checks that the OS saves the wide registers). The
environment variable `FASTGEN_CPU_KERNELS` lowers the choice (`avx2`, `avx512`) or turns the kernels off
(`off`); asking for a variant the CPU lacks takes the best one it has. AMX has no variant yet: this code is
only built where it can be tested.
"""

from __future__ import annotations

import functools
import os

import torch

ENV_VAR = "FASTGEN_CPU_KERNELS"
"""Environment variable that caps (or disables) the C++ CPU kernels' ISA."""

ISAS: tuple[str, ...] = ("avx512_bf16", "avx512", "avx2")
"""The variants, best first."""

_COMMON_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c")

ISA_FLAGS: dict[str, tuple[str, ...]] = {
    # Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later) has AVX512-VNNI too.
    "avx512_bf16": _COMMON_FLAGS + _AVX512 + ("-mavx512bf16", "-mavx512vnni"),
    "avx512": _COMMON_FLAGS + _AVX512,
    "avx2": _COMMON_FLAGS + ("-mavx2", "-mfma", "-mf16c"),
}
"""Compiler flags of each variant (beyond torch's own extension flags)."""

ISA_NOTES: dict[str, str] = {
    "avx512_bf16": "AVX512-BF16 dot products score bf16 keys without widening them (fp32/fp16 caches: AVX512F)",
    "avx512": "16-lane AVX512F fp32 math, bf16/fp16 keys and values widened once per token",
    "avx2": "8-lane AVX2/FMA fp32 math, bf16/fp16 keys and values widened once per token",
}
"""One line per variant: what it does, for the plan's reason."""

_CHOICES = ("off", "auto") + ISAS


def requested_isa() -> str:
    """`FASTGEN_CPU_KERNELS` normalised: "off", "auto" (unset or empty) or an ISA cap; ValueError otherwise."""
    value = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={value!r}: must be one of {', '.join(_CHOICES)}")
    return value


@functools.cache
def supported_isas() -> tuple[str, ...]:
    """The variants this CPU runs, best first (empty off x86 or below AVX2)."""
    capability = torch.backends.cpu.get_cpu_capability()
    found = []
    is_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # torch >= 2.7
    if capability.startswith("AVX512") and is_bf16 is not None and is_bf16():
        found.append("avx512_bf16")
    if capability.startswith("AVX512"):
        found.append("avx512")
    if capability.startswith(("AVX512", "AVX2")):
        found.append("avx2")
    return tuple(found)


_CPUINFO_FLAG = {"avx512_bf16": "avx512_bf16", "avx512": "avx512f", "avx2": "avx2"}


def isas_from_flags(flags: frozenset[str]) -> tuple[str, ...]:
    """The variants a CPU reporting these /proc/cpuinfo `flags` runs, best first (for a machine described,
    not this one)."""
    return tuple(isa for isa in ISAS if _CPUINFO_FLAG[isa] in flags)


def pick_isa(supported: tuple[str, ...], requested: str) -> str | None:
    """The variant to run among `supported` (best first) under `requested` (`requested_isa()`); None = off."""
    if requested == "off" or not supported:
        return None
    if requested == "auto":
        return supported[0]
    allowed = ISAS[ISAS.index(requested):]
    return next((isa for isa in supported if isa in allowed), None)


def cpu_kernel_isa() -> str | None:
    """The variant this process runs (the CPU's best under `FASTGEN_CPU_KERNELS`), None when the kernels are off."""
    return pick_isa(supported_isas(), requested_isa())

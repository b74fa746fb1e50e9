"""Which of fastgen's C++ CPU kernels a plan runs, and why: the paged attention backend and the int4 linears."""

from __future__ import annotations

from fastgen.ops.cpu_kernels import (ENV_VAR, ISA_NOTES, MAX_QUERY_LEN, build_dir, isas_from_flags, pick_isa,
                                     requested_isa)
from fastgen.ops.cpu_kernels.q4 import CHUNK
from fastgen.planning.hardware import Hardware, cpu_kernel_blocker


def choose_cpu_attention(hw: Hardware) -> tuple[str, str]:
    """The C++ decode kernel's best variant under `FASTGEN_CPU_KERNELS`, else the torch path, with the reason."""
    blocker = cpu_kernel_blocker(hw)
    if blocker is not None:
        return "torch", f"{blocker}: no C++ CPU kernel; Triton runs on a CPU only through its interpreter"
    requested = requested_isa()
    isa = pick_isa(isas_from_flags(hw.cpu_flags), requested)
    capped = f", capped by {ENV_VAR}={requested}" if requested != "auto" else ""
    return "cpu", (f"C++ paged decode attention, {isa} variant{capped}: {ISA_NOTES[isa]}; decode rows, "
                   f"verification rows and prompt chunks of up to {MAX_QUERY_LEN} tokens in one call, KV blocks "
                   f"read in place (longer prompt chunks: torch's flash kernel); built by "
                   f"{hw.cpp_compiler} at first use into {build_dir(isa)}")


def int4_kernel_reason(hw: Hardware, group_size: int) -> str:
    """Which kernel multiplies a CPU plan's int4 linears (the packing `QuantizedLinear` picks), and why."""
    blocker = cpu_kernel_blocker(hw)
    if blocker is None and group_size % CHUNK == 0:
        isa = pick_isa(isas_from_flags(hw.cpu_flags), requested_isa())
        dot = "VNNI" if isa == "avx512_bf16" else "AVX2 maddubs"
        return (f"int4 linears on fastgen's C++ kernel ({isa} variant): each row of x quantized to int8 per group, "
                f"{dot} integer dot products, as llama.cpp multiplies its Q4 blocks (2-core EPYC, SmolLM2-135M "
                "batch-1 decode: 70-78 -> 97-101 tok/s against torch's int4 kernel)")
    why = blocker or f"the group size {group_size} is not a multiple of its {CHUNK}-input chunks"
    return f"int4 linears on torch's int4 kernel: fastgen's C++ one cannot run ({why})"

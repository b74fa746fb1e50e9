"""How a plan runs on a CPU, and why: which of fastgen's C++ kernels it calls (the paged attention backend, the
int4 linears, the decode-layer op) and whether its steps give up cores that other processes want."""

from __future__ import annotations

from fastgen.ops.cpu_kernels import (ENV_VAR, ISA_NOTES, MAX_QUERY_LEN, isas_from_flags, kernels_dir, pick_isa,
                                     requested_isa)
from fastgen.ops.cpu_kernels.decode_layer import MAX_ROWS
from fastgen.ops.cpu_kernels.q4 import CHUNK
from fastgen.ops.cpu_threads import adaptive_threads_supported
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
                   f"{hw.cpp_compiler} at first use under {kernels_dir()}")


def quantized_kernel_blocker(hw: Hardware, quantization: str, group_size: int) -> str | None:
    """Why a CPU plan's `quantization` linears cannot run on fastgen's C++ kernels (None: they can: int8 on
    the Q8_0 kernel, int4 on the Q4 kernel when its groups fill whole chunks)."""
    if quantization not in ("int8", "int4"):
        return f"fastgen's C++ linear kernels multiply int8 and int4 weights, not {quantization!r}"
    blocker = cpu_kernel_blocker(hw)
    if blocker is None and quantization == "int4" and group_size % CHUNK:
        return f"the group size {group_size} is not a multiple of its {CHUNK}-input chunks"
    return blocker


def int4_kernel_reason(hw: Hardware, group_size: int) -> str:
    """Which kernel multiplies a CPU plan's int4 linears (the packing `QuantizedLinear` picks), and why."""
    why = quantized_kernel_blocker(hw, "int4", group_size)
    if why is None:
        isa = pick_isa(isas_from_flags(hw.cpu_flags), requested_isa())
        dot = "VNNI" if isa == "avx512_bf16" else "AVX2 maddubs"
        return (f"int4 linears on fastgen's C++ kernel ({isa} variant): each row of x quantized to int8 per group, "
                f"{dot} integer dot products, as llama.cpp multiplies its Q4 blocks (2-core EPYC, SmolLM2-135M "
                "batch-1 decode: 70-78 -> 97-101 tok/s against torch's int4 kernel)")
    return f"int4 linears on torch's int4 kernel: fastgen's C++ one cannot run ({why})"


def decode_layer_blocker(attention: str, quantization: str, tiles: bool, tensor_parallel: int, offload: str,
                         enable_lora: bool) -> str | None:
    """Why a plan cannot run its decoder layers on the C++ decode-layer op (None: it can). `tiles`: the plan keeps
    its bf16 or fp32 weights in the layout of fastgen's GEMV kernels (`gemv_weights` where they build)."""
    if attention != "cpu":
        return f"the op attends through fastgen's C++ CPU attention kernel, and the backend is {attention!r}"
    if quantization == "none" and not tiles:
        return ("the op multiplies int4/int8 linears, or bf16/fp32 ones in its GEMV kernels' tiles (gemv_weights), "
                "on fastgen's kernels, and this plan's linears are neither")
    if tensor_parallel > 1:
        return "the op runs a whole layer on one rank, and the plan splits layers over tensor-parallel ranks"
    if offload != "none":
        return "the op reads resident weights, and the plan streams layers from offload"
    if enable_lora:
        return "the op has no LoRA adapters"
    return None


def choose_decode_layer_kernel(blocker: str | None) -> tuple[bool, str]:
    """The policy's `decode_layer_kernel` for a plan whose `decode_layer_blocker` is `blocker`, with the reason."""
    if blocker is not None:
        return False, f"off: {blocker}"
    return True, (f"steps of at most {MAX_ROWS} tokens whose rows the C++ attention kernel serves run each decoder "
                  "layer as one C++ call (the same kernels, no Python between them): at batch 1 the Python around a "
                  "layer's kernels costs as much as the kernels (2-core EPYC, SmolLM2-135M int4 decode: ~300 us a "
                  "layer compiled, ~120 us as one call, 105 -> 142 tok/s); larger steps, and layers of another "
                  "shape, keep the layer's forward (compiled where the plan compiles)")


def adaptive_threads_blocker(hw: Hardware, compile_mode: str, tensor_parallel: int) -> str | None:
    """Why a plan's steps cannot choose their thread count from the other processes' CPU load (None: they can)."""
    if hw.device_type != "cpu":
        return "a GPU step's work does not run on CPU threads"
    if not adaptive_threads_supported():
        return "this OS shows no machine-wide CPU time (Linux's /proc/stat)"
    if hw.cpu_cores < 2:
        return "with one core a step already runs on one thread"
    if hw.machine_cpus != hw.cpu_cores:
        return (f"/proc/stat counts the CPU time of all {hw.machine_cpus or 'the'} CPUs, and this process may use "
                f"{hw.cpu_cores} of them")
    if tensor_parallel > 1:
        return "tensor-parallel ranks share the cores and step at once: each would count the others as competitors"
    if compile_mode != "off":
        return "Inductor writes each compiled kernel's thread count into its code when it compiles it"
    return None


def choose_adaptive_threads(blocker: str | None) -> tuple[bool, str]:
    """Off unless asked for, with the reason (which says why it would not apply, where `blocker` says so)."""
    if blocker is not None:
        return False, f"off: {blocker}"
    return False, ("off unless asked: it pays beside a process that keeps a core busy, since an OpenMP team that "
                   "loses a core waits for it at each of a step's ~1,000 barriers (2-core EPYC, SmolLM2-135M bf16, 16 "
                   "prompts of 286 tokens and 8 tokens out beside one busy process: 5.0 s on against 11.3-11.7 s off; "
                   "2.4-2.8 s alone either way), but beside a load generator that shares the cores it gave up more "
                   "than it won (guidellm, 16 streams, two alternating pairs: request latency 6.47 / 6.08 s, ITL 90.8 "
                   "/ 80.7 ms on / off, TTFT 729 / 756 ms); adaptive_threads=True for a machine shared with steady "
                   "work")

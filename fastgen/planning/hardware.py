"""What the policy needs to know about the machine: CPU cores and ISA, RAM, and each CUDA device.

Tests build `Hardware` directly to stand for machines we do not have (an 8x H100 node, a V100);
`detect_hardware` fills it in for the machine we are on.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

import torch

from fastgen.ops.cpu_kernels.isa import ENV_VAR, isas_from_flags, pick_isa, requested_isa

# /proc/cpuinfo flags that decide which dtypes have fast matmuls on a CPU.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


@dataclass(slots=True, frozen=True)
class GPUInfo:
    """One CUDA device."""

    name: str
    """Marketing name as the driver reports it, e.g. "NVIDIA H200"."""
    compute_capability: tuple[int, int]
    """(major, minor): 7.0 Volta, 8.0 A100, 8.6 A10/3090, 8.9 Ada, 9.0 Hopper."""
    total_memory: int
    """Device memory in bytes."""
    free_memory: int
    """Device memory free at detection, in bytes (what the weights and KV cache can use)."""
    sm_count: int
    """Streaming multiprocessors."""

    def __post_init__(self) -> None:
        if not 0 < self.free_memory <= self.total_memory:
            raise ValueError(f"GPU {self.name!r}: free_memory {self.free_memory} must be in (0, total_memory {self.total_memory}]")


@dataclass(slots=True)
class Hardware:
    """The machine a deployment runs on."""

    device_type: str
    """"cpu" or "cuda": where the model runs."""
    cpu_cores: int
    """CPU cores this process may use (its affinity mask)."""
    cpu_flags: frozenset[str]
    """The `ISA_FLAGS` this CPU reports in /proc/cpuinfo."""
    cpu_capability: str
    """`torch.backends.cpu.get_cpu_capability()`: the widest vector ISA ATen's kernels use ("AVX512", "AVX2", ...)."""
    ram_available: int
    """RAM available to new allocations, in bytes (MemAvailable)."""
    gpus: tuple[GPUInfo, ...] = ()
    """The CUDA devices the deployment may use (empty on a CPU machine)."""
    matmul_gflops: dict[str, float] = field(default_factory=dict)
    """CPU matmul rates measured here, dtype name -> GFLOP/s; empty = use the documented figures."""
    nodes: int = 1
    """Machines of a multi-node torchrun launch (WORLD_SIZE / LOCAL_WORLD_SIZE), each with `gpus`;
    tensor-parallel ranks may span them."""
    machine_cpus: int = 0
    """CPUs of the whole machine (`os.cpu_count()`), whose CPU time `/proc/stat` counts; 0 = unknown."""
    cpp_compiler: str = ""
    """Path of the C++ compiler torch's extension toolchain would run (`$CXX`, else `c++`), which builds
    fastgen's CPU kernels; empty where there is none."""

    def __post_init__(self) -> None:
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}")
        if self.device_type == "cuda" and not self.gpus:
            raise ValueError("device_type 'cuda' needs at least one GPUInfo in gpus")
        if self.cpu_cores < 1 or self.ram_available < 1:
            raise ValueError(f"cpu_cores ({self.cpu_cores}) and ram_available ({self.ram_available}) must be positive")
        unknown = set(self.cpu_flags) - set(ISA_FLAGS)
        if unknown:
            raise ValueError(f"unknown cpu_flags {sorted(unknown)} (known: {', '.join(ISA_FLAGS)})")

    @property
    def gpu_count(self) -> int:
        """Number of CUDA devices available to the deployment."""
        return len(self.gpus)


def detect_hardware(device: str | torch.device | None = None, measure: bool = False) -> Hardware:
    """Describe this machine. `device` None = CUDA when available, else the CPU; "cuda" = every
    visible GPU, "cuda:i" = that one only. `measure` times bf16/fp32/fp16 CPU matmuls (about a second)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:i]', got {str(dev)!r}")
    gpus: tuple[GPUInfo, ...] = ()
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(dev)!r} asked for, but torch sees no CUDA device")
        indices = [dev.index] if dev.index is not None else list(range(torch.cuda.device_count()))
        gpus = tuple(_gpu_info(i) for i in indices)
    return Hardware(
        device_type=dev.type,
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        cpu_flags=_cpu_flags(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        ram_available=_ram_available(),
        gpus=gpus,
        matmul_gflops=measure_cpu_matmul() if measure else {},
        nodes=_torchrun_nodes(),
        cpp_compiler=shutil.which(os.environ.get("CXX") or "c++") or "",
        machine_cpus=os.cpu_count() or 0,
    )


def cpu_kernel_blocker(hw: Hardware) -> str | None:
    """Why fastgen's C++ CPU kernels cannot run on `hw` (None: they can, in the variant `pick_isa` gives
    under `FASTGEN_CPU_KERNELS`): what every plan field that picks one of them quotes."""
    requested = requested_isa()
    if pick_isa(isas_from_flags(hw.cpu_flags), requested) is None:
        return f"{ENV_VAR}=off" if requested == "off" else "this CPU has no AVX2"
    if not hw.cpp_compiler:
        return "no C++ compiler ($CXX, else c++) to build fastgen's CPU kernels at first use"
    return None


def _torchrun_nodes() -> int:
    """Machines in the torchrun launch this process belongs to (1 when not launched by torchrun)."""
    try:
        return max(1, int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError, ZeroDivisionError):
        return 1


def measure_cpu_matmul(seconds: float = 0.25) -> dict[str, float]:
    """GFLOP/s of a [256, 2048] x [2048, 2048] CPU matmul per dtype, best of the runs in `seconds`.

    256 rows is a typical CPU step; on a CPU without AVX512-FP16/AMX-FP16 the fp16 run alone
    takes ~1 s, as fp16 matmul runs ~3 GFLOP/s there.
    """
    rates = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("float16", torch.float16)):
        a = torch.randn(256, 2048).to(dtype)
        b = torch.randn(2048, 2048).to(dtype)
        a @ b  # first call picks and caches the kernel
        best, start = float("inf"), time.perf_counter()
        while best == float("inf") or time.perf_counter() - start < seconds:
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        rates[name] = 2 * 256 * 2048 * 2048 / best / 1e9
    return rates


def _gpu_info(index: int) -> GPUInfo:
    """GPUInfo of CUDA device `index` (creates its CUDA context to read the free memory)."""
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return GPUInfo(name=props.name, compute_capability=(props.major, props.minor), total_memory=total,
                   free_memory=free, sm_count=props.multi_processor_count)


def _cpu_flags() -> frozenset[str]:
    """The `ISA_FLAGS` in the first `flags` line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(set(line.split(":", 1)[1].split()) & set(ISA_FLAGS))
    except OSError:
        pass
    return frozenset()


def _ram_available() -> int:
    """MemAvailable from /proc/meminfo, else free pages from sysconf, in bytes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

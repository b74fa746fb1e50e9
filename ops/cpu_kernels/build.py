"""Building the C++ CPU kernels at first use, and reusing the build in every later process.

The sources ship in the package and are compiled by torch's extension toolchain
(`torch.utils.cpp_extension.load`: the compiler and headers Inductor's CPU backend needs anyway) into
`$FASTGEN_CACHE/cpu_kernels/<isa>-<key>`, one library per variant, where the key hashes the sources, the
variant's flags, torch's version and the compiler. A second process finds the library there and only
loads it. Where the build fails (no compiler, no ninja, a compiler error) the caller gets None and one
log line, and every kernel's caller runs its torch path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from fastgen.ops.cache_dir import fastgen_cache_dir
from fastgen.ops.cpu_kernels.isa import ISA_FLAGS, cpu_kernel_isa

logger = logging.getLogger("fastgen")

SOURCES = tuple(os.path.join(os.path.dirname(__file__), name) for name in ("paged_decode.cpp", "lora_delta.cpp",
                                                                               "q8_matmul.cpp", "q4_matmul.cpp",
                                                                               "bf16_matmul.cpp", "decode_layer.cpp"))
"""The kernels' C++ sources, compiled into one library."""

HEADERS = tuple(os.path.join(os.path.dirname(__file__), name) for name in ("simd.h", "int8_dot.h", "tiles.h"))
"""Headers the sources include (part of the build's key)."""


def build_dir(isa: str) -> str:
    """Where variant `isa` of the current sources is built for this torch and compiler."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(ISA_FLAGS[isa]).encode())
    digest.update(torch.__version__.encode())
    digest.update(os.environ.get("CXX", "c++").encode())
    return os.path.join(fastgen_cache_dir(), "cpu_kernels", f"{isa}-{digest.hexdigest()[:16]}")


# A build takes well under a minute; a lock older than this was left by a process killed mid-build.
_STALE_LOCK_S = 600


def _drop_stale_lock(directory: str) -> None:
    """Remove the build lock of a killed build: torch's FileBaton would wait on it forever."""
    lock = os.path.join(directory, "lock")
    with contextlib.suppress(OSError):
        if time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:
            os.remove(lock)


@functools.cache
def _load_library(isa: str) -> bool:
    """Build variant `isa` (or find it in the cache) and load it into this process, once; False, logged
    once, when it cannot be built."""
    directory = build_dir(isa)
    name = f"fastgen_cpu_kernels_{isa}"
    start = time.perf_counter()
    try:
        import torch.utils.cpp_extension  # noqa: PLC0415 - setuptools and friends, only when a kernel is built

        os.makedirs(directory, exist_ok=True)
        _drop_stale_lock(directory)
        torch.utils.cpp_extension.load(name=name, sources=list(SOURCES),
                                       extra_cflags=[*ISA_FLAGS[isa], f"-DFASTGEN_ISA={isa}"],
                                       extra_include_paths=[os.path.dirname(HEADERS[0])], extra_ldflags=["-fopenmp"],
                                       build_directory=directory, is_python_module=False)
    except Exception as exc:  # noqa: BLE001 - any failure to build means the torch path, never an error
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        logger.warning("C++ CPU kernels (%s) unavailable, their callers stay on the torch path: %s", isa, lines[0])
        return False
    logger.info("C++ CPU kernels (%s) ready in %.1f s from %s", isa, time.perf_counter() - start, directory)
    return True


@functools.cache
def kernel_op(name: str, isa: str) -> torch._ops.OpOverloadPacket | None:
    """`fastgen::<name>_<isa>`, one of the library's ops (`paged_decode`, `lora_delta`, `q8_matmul`, `q4_matmul`,
    `bf16_matmul`, `decode_layer`:
    the source of that name), built or found in the cache on the first call of a process; None when it cannot
    be built."""
    return getattr(torch.ops.fastgen, f"{name}_{isa}") if _load_library(isa) else None


def traced_op(name: str, fake: Callable[..., Any]) -> torch._ops.OpOverload | None:
    """`fastgen::<name>_<isa>` of the variant this process runs now, with `fake` (its shape function)
    registered so that a compiled graph records the C++ op itself; None where the kernels are off or
    cannot be built."""
    isa = cpu_kernel_isa()
    return None if isa is None else _traced_op(name, isa, fake)


@functools.cache
def _traced_op(name: str, isa: str, fake: Callable[..., Any]) -> torch._ops.OpOverload | None:
    op = kernel_op(name, isa)
    if op is None:
        return None
    torch.library.register_fake(f"fastgen::{name}_{isa}", fake)
    return op.default


def active_op(name: str) -> torch._ops.OpOverloadPacket | None:
    """`kernel_op(name, isa)` for the ISA variant this process runs now (`cpu_kernel_isa`: the CPU's best, or
    what `FASTGEN_CPU_KERNELS` asks for); None where the kernels are off or cannot be built."""
    isa = cpu_kernel_isa()
    return kernel_op(name, isa) if isa is not None else None

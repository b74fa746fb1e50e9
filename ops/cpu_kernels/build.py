"""Building the C++ CPU kernels at first use, and reusing the builds in every later process.

The sources ship in the package and are compiled by torch's extension toolchain
(`torch.utils.cpp_extension.load`: the compiler and headers Inductor's CPU backend needs anyway), each kernel
(`<name>.cpp`) into a library of its own under `$FASTGEN_CACHE/cpu_kernels/<isa>-<name>-<key>`, where the key
hashes the source, the headers, the variant's flags, torch's version and the compiler. A process builds only the
kernels its plan uses (`prebuild` starts them side by side while the model loads; each kernel's first caller
waits for its build): a source costs ~8-13 s of one core, ~4 s of it torch's headers (2-core EPYC). A second
process finds the libraries there and only loads them. Where a build fails (no compiler, no ninja, a compiler
error) the caller gets None and one log line per variant, and every kernel's caller runs its torch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fastgen.ops.cache_dir import fastgen_cache_dir
from fastgen.ops.cpu_kernels.isa import ISA_FLAGS, cpu_kernel_isa

logger = logging.getLogger("fastgen")

KERNELS = ("paged_decode", "lora_delta", "q8_matmul", "q4_matmul", "bf16_matmul", "f32_matmul", "decode_layer")
"""The kernels, each the source `<name>.cpp` built into its own library (its ops are `fastgen::<name>_<isa>`;
`decode_layer` calls the others' ops, which their own users load)."""

HEADERS = tuple(os.path.join(os.path.dirname(__file__), name)
                for name in ("simd.h", "int8_dot.h", "tiles.h", "attention_rows.h", "attention_lanes.h"))
"""Headers the sources include (part of every build's key)."""


def kernels_dir() -> str:
    """Where the kernels are built: one directory per kernel, variant and key below it."""
    return os.path.join(fastgen_cache_dir(), "cpu_kernels")


def _source(name: str) -> str:
    if name not in KERNELS:
        raise ValueError(f"unknown C++ CPU kernel {name!r} (kernels: {', '.join(KERNELS)})")
    return os.path.join(os.path.dirname(__file__), f"{name}.cpp")


def build_dir(isa: str, name: str) -> str:
    """Where kernel `name`'s variant `isa` of the current sources is built for this torch and compiler."""
    digest = hashlib.sha256()
    for path in (_source(name), *HEADERS):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(ISA_FLAGS[isa]).encode())
    digest.update(torch.__version__.encode())
    digest.update(os.environ.get("CXX", "c++").encode())
    return os.path.join(kernels_dir(), f"{isa}-{name}-{digest.hexdigest()[:16]}")


@contextlib.contextmanager
def _directory_lock(directory: str) -> Iterator[None]:
    """Held by the one process that builds or loads the library in `directory`: an `flock`, which the OS releases
    when its holder dies. torch's own build lock (a `lock` file it waits on until it is removed) stays behind when
    a build is killed, and every later process would wait on it forever; under this lock no other process is
    building here, so any such file is a dead build's and is removed."""
    with open(os.path.join(directory, "fastgen.flock"), "a", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, "lock"))
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def _build_lock(name: str, isa: str) -> threading.Lock:
    """Held while this process builds or loads kernel `name`'s variant `isa` (a `prebuild` thread, or a caller)."""
    return threading.Lock()


@functools.cache
def _failure_logged(isa: str) -> threading.Lock:
    """Taken by the first kernel of variant `isa` that fails to build in this process (its failure is logged,
    later ones not); a non-blocking acquire decides which one, even when `prebuild` threads fail together."""
    return threading.Lock()


def _unavailable(isa: str, line: str) -> None:
    """The one log line of a variant whose kernels cannot be built: its first failure's reason."""
    if _failure_logged(isa).acquire(blocking=False):
        logger.warning("C++ CPU kernels (%s) unavailable, their callers stay on the torch path: %s", isa, line)


def _load_library(name: str, isa: str) -> bool:
    """Build kernel `name`'s variant `isa` (or find it in the cache) and load it into this process, once; False,
    logged once a variant, when it cannot be built. A caller waits for a build another thread started."""
    with _build_lock(name, isa):
        return _load_once(name, isa)


@functools.cache
def _load_once(name: str, isa: str) -> bool:
    directory = build_dir(isa, name)
    start = time.perf_counter()
    try:
        import torch.utils.cpp_extension  # noqa: PLC0415 - setuptools and friends, only when a kernel is built

        os.makedirs(directory, exist_ok=True)
        with _directory_lock(directory):
            torch.utils.cpp_extension.load(name=f"fastgen_{name}_{isa}", sources=[_source(name)],
                                           extra_cflags=[*ISA_FLAGS[isa], f"-DFASTGEN_ISA={isa}"],
                                           extra_include_paths=[os.path.dirname(HEADERS[0])],
                                           extra_ldflags=["-fopenmp"], build_directory=directory,
                                           is_python_module=False)
    except Exception as exc:  # noqa: BLE001 - any failure to build means the torch path, never an error
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        _unavailable(isa, lines[0])
        return False
    logger.info("C++ CPU kernel %s (%s) ready in %.1f s from %s", name, isa, time.perf_counter() - start, directory)
    return True


def prebuild(names: Iterable[str]) -> list[threading.Thread]:
    """Start building (or loading) the kernels `names` of the variant this process runs, side by side, each on a
    daemon thread; returns the threads (none where the kernels are off). Their first callers wait for them."""
    isa = cpu_kernel_isa()
    if isa is None:
        return []
    threads = [threading.Thread(target=_load_library, args=(name, isa), name=f"fastgen-build-{name}", daemon=True)
               for name in dict.fromkeys(names)]
    for thread in threads:
        thread.start()
    return threads


@functools.cache
def kernel_op(name: str, isa: str) -> torch._ops.OpOverloadPacket | None:
    """`fastgen::<name>_<isa>`, the op of kernel `name` (one of `KERNELS`), built or found in the cache on the first
    call of a process; None when it cannot be built."""
    return getattr(torch.ops.fastgen, f"{name}_{isa}") if _load_library(name, isa) else None


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

"""Backing a CPU KV cache with memory before the steps write it, off the engine's thread.

`allocate_kv_cache` leaves the cache uninitialised, so start-up does not zero gigabytes. The kernel then
maps each 4 KiB page at its first write, which happens inside a step: a page fault per page, in the
hot loop (2.5 s of a 128-request run on a 2-core Xeon, `bench_peer.py --profile`). `prefault_in_background`
asks the kernel to map the pages ahead of time with `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) from a
daemon thread started after the cache is allocated: the contents are left as they are, so pages the
engine has written meanwhile are unaffected, and start-up does not wait for it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger("fastgen")

MADV_POPULATE_WRITE = 23
"""Linux's advice to fault pages in writable without changing them (`<asm-generic/mman-common.h>`)."""

CHUNK_BYTES = 64 << 20
"""Bytes populated per call, so that one call never holds the mm lock for long."""


@functools.cache
def prefault_supported() -> bool:
    """Whether this OS takes `MADV_POPULATE_WRITE` (Linux 5.14+): tried on one anonymous page."""
    if not sys.platform.startswith("linux"):
        return False
    with mmap.mmap(-1, mmap.PAGESIZE) as page:
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        ok = _madvise(address, mmap.PAGESIZE) == 0
        del address  # the buffer export must end before the map closes
    return ok


@functools.cache
def _libc_madvise() -> Callable[..., int]:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def _madvise(address: int, length: int) -> int:
    return _libc_madvise()(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE)


def populate(tensors: Sequence[torch.Tensor]) -> int:
    """Map the whole pages of each CPU tensor's storage, writable, contents untouched; returns the bytes
    advised. Pages at the unaligned edges are left to fault as usual. Raises OSError when the kernel refuses."""
    page = mmap.PAGESIZE
    done = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        start = -(-storage.data_ptr() // page) * page
        end = (storage.data_ptr() + storage.nbytes()) // page * page
        for chunk in range(start, end, CHUNK_BYTES):
            length = min(CHUNK_BYTES, end - chunk)
            if _madvise(chunk, length) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")
            done += length
    return done


def prefault_in_background(tensors: Sequence[torch.Tensor]) -> threading.Thread:
    """`populate(tensors)` on a daemon thread (which keeps the tensors alive until it ends), logging
    what it did; the thread is returned already started."""
    def run() -> None:
        started = time.perf_counter()
        try:
            done = populate(tensors)
        except OSError as exc:
            logger.warning("KV cache prefault stopped (%s): its pages fault in at first write instead", exc)
            return
        logger.info("KV cache prefaulted in the background: %.0f MiB in %.1f s", done / 2**20,
                    time.perf_counter() - started)

    thread = threading.Thread(target=run, name="fastgen-kv-prefault", daemon=True)
    thread.start()
    return thread

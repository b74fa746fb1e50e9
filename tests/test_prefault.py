"""The KV cache's background prefault: pages mapped with the contents untouched, and the plan's choice."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from fastgen.ops.kv_cache import allocate_kv_cache
from fastgen.ops.prefault import populate, prefault_in_background, prefault_supported
from fastgen.planning.hardware import GPUInfo, Hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.policy import make_plan
from kit import build_checkpoint

GIB = 1 << 30

pytestmark = pytest.mark.skipif(not prefault_supported(), reason="this OS does not take MADV_POPULATE_WRITE")


def _resident_pages(buffer: mmap.mmap) -> int:
    """How many pages of `buffer` are in memory (mincore(2))."""
    pages = len(buffer) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(buffer)), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_populate_maps_pages_and_keeps_contents():
    cache = allocate_kv_cache(64, 16, 4, 64, torch.float32, "cpu")  # 1 MiB, a transposed view of its storage
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)))  # must survive the prefault
    before = cache.clone()
    fresh = mmap.mmap(-1, 16 << 20)  # anonymous memory never written: no page of it is mapped yet
    region = torch.frombuffer(fresh, dtype=torch.uint8)
    assert _resident_pages(fresh) == 0
    advised = populate([cache, region])
    assert _resident_pages(fresh) == (16 << 20) // mmap.PAGESIZE
    assert advised >= (16 << 20) and torch.equal(cache, before)
    del region


def test_background_thread_ends_and_leaves_the_cache_as_it_was():
    cache = torch.arange(1 << 20, dtype=torch.float32)
    thread = prefault_in_background([cache])
    thread.join(timeout=30)
    assert not thread.is_alive() and torch.equal(cache, torch.arange(1 << 20, dtype=torch.float32))


def test_plan_prefaults_only_when_asked_and_only_cpu_caches(tmp_path):
    facts = model_facts(build_checkpoint(str(tmp_path / "llama"), "llama"))
    cpu = Hardware("cpu", 2, frozenset({"avx2"}), "AVX2", 8 * GIB)
    default = make_plan(facts, cpu)
    assert default.kv_prefault is False and "kv_prefault=True" in default.reasons["kv_prefault"]
    asked = make_plan(facts, cpu, kv_prefault=True)
    assert asked.kv_prefault is True and asked.reasons["kv_prefault"] == "set by the user"
    gpu = Hardware("cuda", 8, frozenset({"avx2"}), "AVX2", 64 * GIB, (GPUInfo("NVIDIA H100", (9, 0), 80 * GIB, 79 * GIB, 132),))
    assert make_plan(facts, gpu).kv_prefault is False and "device memory" in make_plan(facts, gpu).reasons["kv_prefault"]


def test_an_engine_asked_to_prefault_starts_the_thread(tmp_path, monkeypatch):
    import fastgen
    import fastgen.executor.runner as runner_module

    started = []
    monkeypatch.setattr(runner_module, "prefault_in_background", lambda tensors: started.append(len(tensors)))
    path = build_checkpoint(str(tmp_path / "llama"), "llama")
    with fastgen.pipeline(path, dtype="float32", kv_prefault=True, progress=False) as pipe:
        layers = pipe.engine.runner.model.config.num_layers
    assert started == [2 * layers]  # each layer's K and V

"""Adaptive CPU threads: each step runs on the cores that other processes leave free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from fastgen import EngineConfig, SamplingParams
from fastgen.engine import Engine
from fastgen.ops.cpu_threads import OtherLoad, ThreadGovernor, adaptive_threads_supported, step_threads
from fastgen.planning.hardware import detect_hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.policy import make_plan
from fastgen.serving.metrics import ServingMetrics
from kit import run_to_end

needs_procfs = pytest.mark.skipif(not adaptive_threads_supported(), reason="needs Linux's /proc/stat")


@pytest.mark.parametrize("other_cores, expected", [
    (0.0, 4),  # alone
    (0.4, 4),  # brief work elsewhere rounds to no core
    (0.6, 3),  # one process most of the time
    (2.2, 2),
    (9.0, 1),  # more than every core: still one thread
])
def test_step_threads_leaves_the_cores_others_keep_busy(other_cores, expected):
    assert step_threads(max_threads=4, cores=4, other_cores=other_cores) == expected


def test_step_threads_never_exceeds_the_starting_count():
    assert step_threads(max_threads=2, cores=8, other_cores=0.0) == 2
    assert step_threads(max_threads=2, cores=8, other_cores=6.0) == 2  # 6 busy leave 2 of 8
    assert step_threads(max_threads=2, cores=8, other_cores=7.0) == 1


@needs_procfs
def test_other_load_counts_busy_processes_and_not_this_one():
    load = OtherLoad()
    assert load() == 0.0  # no window yet
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.6)
        busy = load()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    spin = time.monotonic() + 0.6
    while time.monotonic() < spin:  # this process's own work is not another's
        pass
    own = load()
    assert busy >= 0.8, busy  # two busy processes on however many cores (1 of 2 at the least)
    assert own < busy, (own, busy)


def test_governor_sets_the_count_for_the_step_and_restores_it():
    before = torch.get_num_threads()
    samples = iter([5.0, 0.0, 1.0, 0.2])  # the first is taken when the governor starts
    governor = ThreadGovernor(cores=2, max_threads=2, sample=lambda: next(samples))
    try:
        assert governor.adjust() == 2 and torch.get_num_threads() == 2
        assert governor.adjust() == 1 and torch.get_num_threads() == 1
        governor.restore()
        assert torch.get_num_threads() == 2
        assert governor.adjust() == 2
        assert governor.reduced_steps == 1
    finally:
        torch.set_num_threads(before)


def test_engine_steps_on_changing_thread_counts_equal_hf(tiny_checkpoints, hf_reference):
    """Steps alternate between 1 and 2 threads (a scripted load of other processes): greedy tokens equal
    HF's, each step ran on the count chosen for it, and the engine's thread gets its count back after each."""
    path = tiny_checkpoints["llama"]
    engine = Engine.from_config(EngineConfig(model=path, dtype="float32", num_kv_blocks=64, block_size=4,
                                             token_budget=16, max_seqs=8, progress=False))
    engine.eos_token_ids = set()
    before = torch.get_num_threads()
    flips = iter(range(10**6))
    engine.runner.threads = ThreadGovernor(cores=2, max_threads=2,
                                           sample=lambda: 1.0 if next(flips) % 2 else 0.0)
    seen = []
    forward = engine.runner._forward
    engine.runner._forward = lambda *tensors: seen.append(torch.get_num_threads()) or forward(*tensors)
    prompts = [list(range(5 + 3 * i, 5 + 3 * i + n)) for i, n in enumerate([1, 4, 9, 17, 30, 3])]
    try:
        seqs = run_to_end(engine, prompts, SamplingParams(do_sample=False, max_new_tokens=10), max_steps=500)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # The governor's first sample is taken when it starts: steps 1, 3, 5, ... see another process's core busy.
    assert seen[::2] == [1] * len(seen[::2]) and seen[1::2] == [2] * len(seen[1::2]) and len(seen) > 4
    for seq, (expected, _) in zip(seqs, hf_reference(path, prompts, 10)):
        assert seq.output_token_ids == expected
    assert engine.stats()["num_steps_fewer_threads"] == len(seen[::2])
    text = ServingMetrics(engine.stats).render()[0].decode()
    assert f"fastgen_engine_steps_fewer_threads_total {float(len(seen[::2]))}" in text


def test_plan_chooses_and_refuses(tiny_checkpoints):
    facts, hardware = model_facts(tiny_checkpoints["llama"]), detect_hardware("cpu")
    hardware.cpu_cores = hardware.machine_cpus = 2
    assert not make_plan(facts, hardware, dtype="float32").adaptive_threads
    if adaptive_threads_supported():
        assert "off unless asked" in make_plan(facts, hardware, dtype="float32").reasons["adaptive_threads"]
        assert make_plan(facts, hardware, dtype="float32", adaptive_threads=True).adaptive_threads
    off = make_plan(facts, hardware, dtype="float32", compile="default")
    assert not off.adaptive_threads and "Inductor" in off.reasons["adaptive_threads"]
    hardware.machine_cpus = 8
    shared = make_plan(facts, hardware, dtype="float32")
    assert not shared.adaptive_threads and "all 8 CPUs" in shared.reasons["adaptive_threads"]
    with pytest.raises(ValueError, match="adaptive_threads=True cannot apply: .*all 8 CPUs"):
        make_plan(facts, hardware, dtype="float32", adaptive_threads=True)
    hardware.cpu_cores = hardware.machine_cpus = 1
    assert "one core" in make_plan(facts, hardware, dtype="float32").reasons["adaptive_threads"]

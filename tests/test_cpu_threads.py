"""Adaptive CPU threads: each step runs on the cores that other runnable processes leave free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from fastgen import EngineConfig, SamplingParams
from fastgen.engine import Engine
from fastgen.ops.cpu_threads import RunnableTasks, ThreadGovernor, adaptive_threads_supported, step_threads
from fastgen.planning.hardware import detect_hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.policy import make_plan
from fastgen.serving.metrics import ServingMetrics
from kit import run_to_end

needs_procfs = pytest.mark.skipif(not adaptive_threads_supported(), reason="needs Linux's /proc/loadavg")


@pytest.mark.parametrize("running, own, expected", [
    (1, 1, 4),  # alone: only the reading thread
    (4, 4, 4),  # the team itself, spinning between regions
    (5, 4, 3),  # one other process
    (3, 1, 2),  # two others while our workers sleep
    (9, 1, 1),  # more others than cores: still one thread
    (7, 6, 3),  # this process's threads (a server thread besides the team) are not counted
])
def test_step_threads_leaves_the_cores_others_want(running, own, expected):
    assert step_threads(max_threads=4, cores=4, running=running, own_running=own) == expected


def test_step_threads_never_exceeds_the_starting_count():
    assert step_threads(max_threads=2, cores=8, running=1, own_running=1) == 2
    assert step_threads(max_threads=2, cores=8, running=7, own_running=1) == 2  # 6 others leave 2 of 8
    assert step_threads(max_threads=2, cores=8, running=8, own_running=1) == 1


@needs_procfs
def test_runnable_tasks_sees_busy_processes():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)  # past the interpreters' start-up
        tasks = RunnableTasks()
        samples = [(tasks.machine(), tasks.own()) for _ in range(20)]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    # This thread is running while it reads; the two busy processes always want a core.
    assert all(own >= 1 for _, own in samples)
    assert max(machine - own for machine, own in samples) >= 1


def test_governor_sets_the_count_for_the_step_and_restores_it():
    before = torch.get_num_threads()
    samples = iter([(1, 1), (3, 1), (2, 2)])
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
    """Steps alternate between 1 and 2 threads (a scripted sample of what is runnable): greedy tokens equal
    HF's, each step ran on the count chosen for it, and the engine's thread gets its count back after each."""
    path = tiny_checkpoints["llama"]
    engine = Engine.from_config(EngineConfig(model=path, dtype="float32", num_kv_blocks=64, block_size=4,
                                             token_budget=16, max_seqs=8, progress=False))
    engine.eos_token_ids = set()
    before = torch.get_num_threads()
    flips = iter(range(10**6))
    engine.runner.threads = ThreadGovernor(cores=2, max_threads=2,
                                           sample=lambda: (3, 1) if next(flips) % 2 else (1, 1))
    seen = []
    forward = engine.runner._forward
    engine.runner._forward = lambda *tensors: seen.append(torch.get_num_threads()) or forward(*tensors)
    prompts = [list(range(5 + 3 * i, 5 + 3 * i + n)) for i, n in enumerate([1, 4, 9, 17, 30, 3])]
    try:
        seqs = run_to_end(engine, prompts, SamplingParams(do_sample=False, max_new_tokens=10), max_steps=500)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen[::2] == [2] * len(seen[::2]) and seen[1::2] == [1] * len(seen[1::2]) and len(seen) > 4
    for seq, (expected, _) in zip(seqs, hf_reference(path, prompts, 10)):
        assert seq.output_token_ids == expected
    assert engine.stats()["num_steps_fewer_threads"] == len(seen[1::2])
    text = ServingMetrics(engine.stats).render()[0].decode()
    assert f"fastgen_engine_steps_fewer_threads_total {float(len(seen[1::2]))}" in text


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

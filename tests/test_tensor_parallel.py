"""Tensor parallelism on the CPU over gloo: two ranks must generate Hugging Face's greedy tokens.

The engine runs as rank 0 in this process and starts rank 1 as a worker process; the parity
workload is the engine parity test's (34 prompts of 1..64 tokens, chunked by a 16-token budget,
preempted by a 40-block cache, a shared prefix hitting the prefix cache).
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import fastgen
from fastgen.executor.distributed import CMD_STEP, TensorParallelError
from fastgen.models.loader import load_model
from fastgen.models.parallel import TensorParallel
from fastgen.executor.step_inputs import HostStepInputs
from kit import TINY_CONFIGS, build_checkpoint, hf_greedy
from test_engine_parity import NUM_NEW, TOKEN_BUDGET, _workload

GREEDY = dict(do_sample=False, max_new_tokens=NUM_NEW, ignore_eos=True)
PRESSURE = dict(num_kv_blocks=40, block_size=4, token_budget=TOKEN_BUDGET, max_seqs=8, progress=False)


def _hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    return [tokens for tokens, _ in hf_greedy(path, prompts, max_new_tokens)]


def _worker_processes(parent: int | None = None) -> list[int]:
    """Pids of live tensor-parallel worker processes started by `parent` (default: this process)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"fastgen.executor.tp_worker" in cmd and str(parent or os.getpid()).encode() in cmd and state != "Z":
            pids.append(int(entry))
    return pids


# Every family: each kit entry switches on its family's distinctive parts (mistral's one KV head is
# copied to both ranks, qwen2 ties and biases, phi's biased head is split by vocabulary, MoE experts
# split by intermediate columns, ...).
@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_tp2_pipeline_equals_hf_greedy_under_pressure(model_type, tiny_checkpoints, hf_reference):
    path = tiny_checkpoints[model_type]
    pipe = fastgen.pipeline(path, tensor_parallel=2, **PRESSURE)
    try:
        assert pipe.engine.plan.tensor_parallel == 2 and len(pipe.engine.tp_group.workers) == 1
        prompts = _workload(pipe.tokenizer)
        responses = pipe(prompts, **GREEDY)
        assert pipe.engine.block_manager.num_free_blocks == 40
    finally:
        pipe.destroy()
    assert [r.token_ids for r in responses] == [tokens for tokens, _ in hf_reference(path, prompts, NUM_NEW)]
    assert not _worker_processes()


def test_vocab_not_divisible_by_ranks_is_padded(tmp_path):
    path = build_checkpoint(str(tmp_path / "odd"), "llama", vocab_size=509)
    prompts = [[5 + i % 500 for i in range(n)] for n in (1, 4, 17, 30)]
    with fastgen.pipeline(path, tensor_parallel=2, progress=False) as pipe:
        got = [r.token_ids for r in pipe(prompts, do_sample=False, max_new_tokens=12, ignore_eos=True)]
    assert got == _hf_greedy(path, prompts, 12)


def test_tp2_compiled_step_equals_hf(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    prompts = [[7 + i for i in range(n)] for n in (1, 3, 9, 21)]
    with fastgen.pipeline(path, tensor_parallel=2, compile="default", buckets=(16,), token_budget=16,
                          progress=False) as pipe:
        got = [r.token_ids for r in pipe(prompts, do_sample=False, max_new_tokens=8, ignore_eos=True)]
    assert got == _hf_greedy(path, prompts, 8)


def test_killed_worker_is_a_clear_error_within_seconds(tiny_checkpoints):
    pipe = fastgen.pipeline(tiny_checkpoints["llama"], tensor_parallel=2, progress=False)
    worker = pipe.engine.tp_group.workers[1]
    threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {worker.pid}\) was killed by SIGKILL"):
        pipe([[5] * 30] * 16, do_sample=False, max_new_tokens=400, ignore_eos=True)
    assert time.monotonic() - start < 10
    assert not pipe.engine.requests, "the failed call aborted its requests"
    with pytest.raises(TensorParallelError, match="rank 1"):
        pipe("again", max_new_tokens=2)
    pipe.destroy()
    assert not _worker_processes()


def test_worker_that_fails_to_start_is_reported_not_waited_for(tiny_checkpoints, monkeypatch):
    # Rank 0 read the timeout when fastgen was imported; a fresh worker process fails to parse it.
    monkeypatch.setenv("FASTGEN_TP_TIMEOUT", "not-a-number")
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code 1"):
        fastgen.pipeline(tiny_checkpoints["llama"], tensor_parallel=2, progress=False)
    assert time.monotonic() - start < 60
    assert not _worker_processes()


def test_second_tensor_parallel_engine_in_one_process_is_refused_until_the_first_is_destroyed(tiny_checkpoints):
    first = fastgen.pipeline(tiny_checkpoints["llama"], tensor_parallel=2, progress=False)
    try:
        with pytest.raises(RuntimeError, match="already running in this process: destroy"):
            fastgen.pipeline(tiny_checkpoints["llama"], tensor_parallel=2, progress=False)
        assert len(_worker_processes()) == 1, "the refused engine started no worker"
    finally:
        first.destroy()
    with fastgen.pipeline(tiny_checkpoints["llama"], tensor_parallel=2, progress=False) as again:
        assert again([[5, 6]], do_sample=False, max_new_tokens=2)[0].generated_length == 2
    assert not _worker_processes()


def test_tensor_parallel_refuses_what_it_cannot_split(tiny_checkpoints, tmp_path):
    # Heads divide but the MLP width does not: refused before any worker starts, naming what does not divide.
    odd = build_checkpoint(str(tmp_path / "odd_mlp"), "llama", intermediate_size=127)
    with pytest.raises(ValueError, match=r"tensor_parallel 2 must divide each merged projection's rows \(127\)"):
        fastgen.pipeline(odd, tensor_parallel=2, progress=False)
    with pytest.raises(ValueError, match="tensor_parallel must be a positive int"):
        fastgen.pipeline(tiny_checkpoints["llama"], tensor_parallel=0)
    assert not _worker_processes()


@pytest.mark.parametrize("model_type", ["qwen2", "mixtral"])
def test_serve_with_tensor_parallel_equals_hf_and_stops_when_a_worker_dies(model_type, tiny_checkpoints):
    path = tiny_checkpoints[model_type]
    prompts = [[5, 6, 7], [11] * 20]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = fastgen.serve(path, tensor_parallel=2, deployment_name=f"tp-{model_type}", host="127.0.0.1",
                           port_number=port, progress=False)
    try:
        got = [r.token_ids for r in client(prompts, do_sample=False, max_new_tokens=10, ignore_eos=True)]
        assert got == _hf_greedy(path, prompts, 10)
        workers = _worker_processes(client.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(Exception, match="rank 1 .*killed by SIGKILL"):
            client(prompts, do_sample=False, max_new_tokens=10)
        # The deployment cannot serve any more: it exits rather than failing every request forever.
        client._process.wait(timeout=10)
        assert client._process.returncode == 1
    finally:
        if client._process.poll() is None:
            client.terminate_server(timeout=30)
    assert not _worker_processes(client.pid)


def test_torchrun_launch_serves_rank_0(tiny_checkpoints, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import fastgen, json, sys\n"
        "pipe = fastgen.pipeline(sys.argv[1], progress=False)\n"
        "if pipe.is_rank_0:\n"
        "    out = pipe([[5, 6, 7], [9] * 20], do_sample=False, max_new_tokens=8, ignore_eos=True)\n"
        "    print('RESULT', json.dumps([r.token_ids for r in out]), pipe.engine.plan.tensor_parallel)\n"
        "else:\n"
        "    print('RANK', pipe.rank, 'returned')\n")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--nproc-per-node", "2", str(script), tiny_checkpoints["llama"]],
                         capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    tokens, tp = result.split(" ", 1)[1].rsplit(" ", 1)
    assert tp == "2" and "RANK 1 returned" in out.stdout
    assert __import__("json").loads(tokens) == _hf_greedy(tiny_checkpoints["llama"], [[5, 6, 7], [9] * 20], 8)


_DRAIN_SCRIPT = """
import fastgen, json, os, signal, sys, time
pipe = fastgen.pipeline(sys.argv[1], progress=False)
if pipe.is_rank_0:
    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))  # what a draining server does
    print("READY", flush=True)
    while not terminated:
        time.sleep(0.05)
    if sys.argv[2] == "die":
        os._exit(7)  # rank 0 dies mid-drain
    # The drain: rank 0 still steps after SIGTERM, which needs rank 1.
    out = pipe([[5, 6, 7], [9] * 20], do_sample=False, max_new_tokens=8, ignore_eos=True)
    print("RESULT", json.dumps([r.token_ids for r in out]), flush=True)
    pipe.destroy()
else:
    print("RANK", pipe.rank, "returned", flush=True)
"""


@pytest.mark.parametrize("rank_0", ["drains", "dies"])
def test_torchrun_sigterm_leaves_ranks_above_0_to_rank_0(rank_0, tiny_checkpoints, tmp_path):
    """torchrun forwards SIGTERM to every rank: rank 1 keeps serving while rank 0 drains (its steps after
    the signal still run) and leaves when rank 0 shuts the group down; if rank 0 dies instead, rank 1
    leaves at once, long before torchrun's --shutdown-timeout would SIGKILL it."""
    script = tmp_path / "run.py"
    script.write_text(_DRAIN_SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    path = tiny_checkpoints["llama"]
    proc = subprocess.Popen([torchrun, "--nproc-per-node", "2", "--shutdown-timeout", "120", str(script), path,
                             "die" if rank_0 == "dies" else "drain"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        else:
            pytest.fail(f"rank 0 never got ready: {proc.wait(10)} {proc.stderr.read()[-3000:]}")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to both ranks
        stdout, stderr = proc.communicate(timeout=100)
        elapsed = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stdout = "".join(lines) + stdout
    assert elapsed < 60, f"ranks still running {elapsed:.0f} s after SIGTERM: {stderr[-3000:]}"
    if rank_0 == "drains":
        result = next((line for line in stdout.splitlines() if line.startswith("RESULT")), None)
        assert result is not None, stderr[-3000:]
        assert json.loads(result.split(" ", 1)[1]) == _hf_greedy(path, [[5, 6, 7], [9] * 20], 8)
        assert "RANK 1 returned" in stdout and "rank 1 got SIGTERM" in stderr
    else:
        assert "RESULT" not in stdout and "RANK 1 returned" not in stdout


def test_step_inputs_survive_the_broadcast_encoding():
    host = HostStepInputs(input_ids=[3, 4, 5, 6], positions=[0, 1, 7, 2], slot_mapping=[8, 9, 30, 2],
                          block_tables=[[1], [3, 4, 5], [0]], seq_lens=[2, 8, 3], query_start_loc=[0, 2, 3, 4],
                          long_rope=[False, True, True, False], state_slots=[2, -1, 0], lora_slots=[1, 1, -1, 0],
                          logits_indices=[1, 2, 3])
    header, payload = host.pack(CMD_STEP)
    assert header.tolist()[0] == CMD_STEP and len(payload) == HostStepInputs.payload_size(header.tolist())
    assert HostStepInputs.unpack(header.tolist(), payload) == dataclasses.replace(
        host, block_tables=[[1, 0, 0], [3, 4, 5], [0, 0, 0]])


def test_each_rank_loads_only_its_slice(tiny_checkpoints):
    """Shards from the loader (no collectives run) against the full weights: q heads split, KV heads
    split at TP=2 and copied at TP=4 (2 KV heads), o_proj columns split, vocabulary rows split."""
    path = tiny_checkpoints["llama"]
    full = dict(load_model(path, progress=False).model.named_parameters())
    for size in (2, 4):
        for rank in range(size):
            tp = TensorParallel(rank=rank, size=size, group=object())  # loading runs no collective
            shard = dict(load_model(path, progress=False, parallel=tp).model.named_parameters())
            head_dim, q_heads = 16, 4 // size
            qkv, qkv_full = shard["model.layers.0.self_attn.qkv_proj.weight"], full["model.layers.0.self_attn.qkv_proj.weight"]
            q_rows = q_heads * head_dim
            torch.testing.assert_close(qkv[:q_rows], qkv_full[rank * q_rows:(rank + 1) * q_rows], rtol=0, atol=0)
            kv_head = rank if size == 2 else rank // 2
            k_full = qkv_full[64 + kv_head * head_dim: 64 + (kv_head + 1) * head_dim]
            torch.testing.assert_close(qkv[q_rows:q_rows + head_dim], k_full, rtol=0, atol=0)
            o, o_full = shard["model.layers.0.self_attn.o_proj.weight"], full["model.layers.0.self_attn.o_proj.weight"]
            torch.testing.assert_close(o, o_full[:, rank * q_rows:(rank + 1) * q_rows], rtol=0, atol=0)
            rows = 512 // size
            torch.testing.assert_close(shard["model.embed_tokens.weight"],
                                       full["model.embed_tokens.weight"][rank * rows:(rank + 1) * rows], rtol=0, atol=0)


def test_fused_expert_stack_is_split_by_intermediate_columns():
    from fastgen.models.moe import StackedExperts

    full_gate_up = torch.randn(4, 2 * 6, 5)
    full_down = torch.randn(4, 5, 6)
    parts = [StackedExperts(4, 5, 6, "silu", TensorParallel(rank=r, size=2, group=object())) for r in range(2)]
    gate_up = [p.load_checkpoint_shard("gate_up_proj", None, full_gate_up) for p in parts]
    assert torch.equal(torch.cat([g[:, :3] for g in gate_up], dim=1), full_gate_up[:, :6])  # gate rows
    assert torch.equal(torch.cat([g[:, 3:] for g in gate_up], dim=1), full_gate_up[:, 6:])  # up rows
    assert torch.equal(torch.cat([p.load_checkpoint_shard("down_proj", None, full_down) for p in parts], dim=2),
                       full_down)
    with pytest.raises(ValueError, match="tensor_parallel 2 must divide the experts' intermediate size"):
        StackedExperts(4, 5, 7, "silu", TensorParallel(rank=0, size=2, group=object()))

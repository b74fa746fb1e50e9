"""Shared pieces of the bench_*.py scripts: a random-weight Llama-shaped checkpoint, seeded
workloads, and the machine's measured ceilings (memory read bandwidth, matmul rate)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time

import numpy as np
import torch
import transformers

import fastgen
from fastgen.engine import DEMO_MODEL_DIR


def build_llama_checkpoint(path: str, dtype: torch.dtype, layers: int, hidden: int) -> int:
    """Save a random-weight Llama-shaped checkpoint with the demo tokenizer; returns its parameter count."""
    tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def workload(n: int, prompt_mean: int, output_mean: int, vocab: int, seed: int,
             max_prompt: int = 1024) -> list[tuple[list[int], int]]:
    """Seeded (prompt token ids, output length) pairs: normal lengths with a 30% spread, prompts
    clipped to 16..max_prompt tokens (issue 9's workload)."""
    rng = np.random.default_rng(seed)
    plens = np.clip(rng.normal(prompt_mean, 0.3 * prompt_mean, n), 16, max_prompt).astype(int)
    olens = np.clip(rng.normal(output_mean, 0.3 * output_mean, n), 4, 8 * output_mean).astype(int)
    return [(rng.integers(3, vocab, p).tolist(), int(o)) for p, o in zip(plens, olens)]


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    """Median wall time of `fn()` (CUDA-synchronised when a GPU is present)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def memory_read_bandwidth(device: torch.device, megabytes: int = 512) -> float:
    """Bytes/s of streaming reads (a sum over a buffer much larger than the caches)."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    return x.numel() * 4 / median_seconds(lambda: x.sum(), repeats=5)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, rounds: int = 8) -> float:
    """FLOP/s of a square matmul in `dtype`: the best of `rounds` medians, because other tenants of
    shared cores only ever slow it down (on this CPU one median moved between 0.6 and 1.9 TFLOP/s)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return max(2 * n**3 / median_seconds(lambda: a @ b, repeats=5) for _ in range(rounds))


def latency_summary(values: list[float]) -> dict[str, float]:
    """Mean, median, p90, p99 and count of `values` (seconds); zeros with count 0 when empty."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "count": 0}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "median": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "count": int(a.size)}


def pyplot_or_none():
    """matplotlib's pyplot on a file-only backend, or None (with a printed note) when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[dev]'): skipping the PNG plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_json(path: str, payload: dict) -> None:
    """Write `payload` to `path`, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    print(f"\nwrote {path}")


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::mv", "aten::addmv", "aten::bmm", "aten::baddbmm", "aten::linear",
              "mkldnn::")


def profile_shares(prof) -> dict[str, float]:
    """Fractions of a CPU profile's time: fastgen's attention op (with everything it calls), matmuls
    outside it, and the rest (elementwise kernels, compiled-graph glue, Python between ops)."""
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    attention = sum(e.cpu_time_total for e in events if e.key.startswith("fastgen::paged_attention"))
    attention_parts = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select", "aten::index_fill_"}
    matmul = sum(e.self_cpu_time_total for e in events if e.key.startswith(MATMUL_OPS))
    return {"attention_op": attention / total, "matmul": matmul / total,
            "attention_sdpa_and_gathers": sum(e.self_cpu_time_total for e in events if e.key in attention_parts) / total,
            "other": max(0.0, 1 - (attention + matmul) / total)}


def time_one_sequence(engine: fastgen.Engine, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
    """Run one greedy sequence alone (EOS ignored), stepping `engine` directly: (seconds to its first token,
    seconds from the first token to the last, tokens generated)."""
    request = engine.add_request(prompt, fastgen.SamplingParams(do_sample=False, ignore_eos=True,
                                                                max_new_tokens=new_tokens))
    seq = engine.sequences(request)[0]
    started = time.perf_counter()
    while not seq.output_token_ids:
        engine.step()
    first = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return first - started, time.perf_counter() - first, len(seq.output_token_ids)


def run_offline(model: str, requests: list[tuple[list[int], int]], around_steps=None,
                warm: list[tuple[list[int], int]] | None = None, **options) -> float:
    """Seconds for a fastgen pipeline to serve every (prompt ids, output length) request, all
    submitted at once, greedy with EOS ignored; start-up and a warm-up request (or the `warm`
    requests, run the same way) are not timed. `around_steps` (a context manager, e.g. a
    `torch.profiler.profile`) wraps the stepping loop."""
    pipe = fastgen.pipeline(model, progress=False, **options)
    run_all(pipe.engine, warm or [(requests[0][0], 2)])
    start = time.perf_counter()
    with around_steps or contextlib.nullcontext():
        run_all(pipe.engine, requests)
    elapsed = time.perf_counter() - start
    pipe.destroy()
    return elapsed


def run_all(engine: fastgen.Engine, requests: list[tuple[list[int], int]]) -> None:
    """Submit every (prompt ids, output length) request at once (greedy, EOS ignored) and step `engine`
    until all are done."""
    for prompt, out_len in requests:
        engine.add_request(prompt, fastgen.SamplingParams(do_sample=False, max_new_tokens=out_len, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s: never leave the server behind."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""One engine of `bench_peer.py` in a process of its own: build it, time the job's workload, write JSON.

    python scripts/peer_worker.py ENGINE MODEL_DIR JOB_JSON OUT_JSON

ENGINE is fastgen, vllm or hf. JOB_JSON holds the prompts (token ids), output length, dtype, the
engine's constructor options and whether to profile (fastgen only). `bench_peer.py` starts this
file with each engine's interpreter (vLLM's from its own venv) and reads OUT_JSON back.
"""

from __future__ import annotations

# Only the standard library at module level: vLLM's interpreter (its own venv, without fastgen) runs
# this file, and vLLM's spawned engine process imports it again.
import contextlib
import json
import os
import sys
import time

WARMUP_PROMPT = list(range(3, 19))  # shares no prefix with the workload, so no engine's prefix cache is primed


def worker_fastgen(model: str, prompts: list[list[int]], output_len: int, options: dict,
                   dtype: str) -> tuple[float, list, dict]:
    """Build a fastgen pipeline; returns (t_ready, generate(prompts) -> per-prompt token ids, notes)."""
    import fastgen

    pipe = fastgen.pipeline(model, **{"dtype": dtype, "progress": False, **options})
    t_ready = time.time()
    gen = dict(do_sample=False, ignore_eos=True)
    pipe([WARMUP_PROMPT], max_new_tokens=2, **gen)
    compiles = getattr(pipe.engine.runner, "warmup_seconds", {})  # per bucket, when compile is on
    return t_ready, lambda: [r.token_ids for r in pipe(prompts, max_new_tokens=output_len, **gen)], \
        {"buckets": list(compiles), "compile_seconds": sum(compiles.values())}


def worker_vllm(model: str, prompts: list[list[int]], output_len: int, options: dict,
                dtype: str) -> tuple[float, list, dict]:
    """Build a vLLM `LLM` (its CPU defaults otherwise); same contract as `worker_fastgen`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, **options)
    t_ready = time.time()
    llm.generate([TokensPrompt(prompt_token_ids=WARMUP_PROMPT)],
                 SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    generate = lambda: [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]  # noqa: E731
    return t_ready, generate, {"vllm_version": sys.modules["vllm"].__version__}


def worker_hf(model: str, prompts: list[list[int]], output_len: int, options: dict,
              dtype: str) -> tuple[float, list, dict]:
    """Load the model into transformers; generation is left-padded batches of options['batch']."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    t_ready = time.time()
    hf.generation_config.eos_token_id = None  # EOS ignored, as for the other engines
    hf.generation_config.pad_token_id = 0
    batch_size = int(options.get("batch", 32))

    @torch.inference_mode()
    def generate(rows: list[list[int]], new: int) -> list[list[int]]:
        out = []
        for i in range(0, len(rows), batch_size):
            batch = rows[i : i + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            gen = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            out += gen[:, width:].tolist()
        return out

    generate([WARMUP_PROMPT], 2)
    return t_ready, lambda: generate(prompts, output_len), {"transformers_version": transformers.__version__}


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: user, nice, system, irq, softirq)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def session_cpu_seconds(session: int) -> float:
    """CPU seconds (user + system) of the live processes of `session`: a worker and the engine
    processes it started (vLLM's are never waited for, so rusage of children would miss them)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[3]) == session:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


WORKERS = {"fastgen": worker_fastgen, "vllm": worker_vllm, "hf": worker_hf}


def kernel_seconds(profiler) -> dict:
    """A CPU profile of the timed run: its ops' self seconds (the 12 largest), and the seconds of the
    kernels torch itself provides and fastgen calls as they are, its CPU flash attention and the matmuls
    (oneDNN's packed linears, BLAS): what they take of a run is a floor for any change made around them."""
    from bench_common import MATMUL_OPS  # fastgen's worker only: vLLM's interpreter lacks what it imports

    events = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
    kernels = {"attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",), "matmul": MATMUL_OPS}
    groups = {name: sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes)) / 1e6
              for name, prefixes in kernels.items()}
    return {"total_seconds": sum(e.self_cpu_time_total for e in events) / 1e6, "torch_kernels": groups,
            "top_ops": [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in events[:12]]}


def run_worker(engine: str, model: str, job_path: str, out: str) -> None:
    """Build one engine, time the job's workload, write the result JSON to `out`."""
    t_started = time.time()
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    t_ready, generate, notes = WORKERS[engine](model, job["prompts"], job["output_len"], job["options"],
                                               job.get("dtype", "bfloat16"))
    # The worker leads its own session (bench_peer's spawn_engine): the CPU the machine spent outside it
    # while generating is other tenants' load, which slows every engine there.
    load, busy, own = os.getloadavg(), busy_cpu_seconds(), session_cpu_seconds(os.getsid(0))
    import torch

    profiler = None
    if job.get("profile") and engine == "fastgen":
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with profiler or contextlib.nullcontext():
        start = time.perf_counter()
        outputs = generate()
        seconds = time.perf_counter() - start
        others = (busy_cpu_seconds() - busy) - (session_cpu_seconds(os.getsid(0)) - own)
    if profiler is not None:
        notes["profile"] = kernel_seconds(profiler)

    result = {"t_started": t_started, "t_ready": t_ready, "generate_seconds": seconds,
              "output_tokens": sum(map(len, outputs)), "first_tokens": outputs[0],
              "threads": torch.get_num_threads(), "torch_version": torch.__version__,
              "loadavg_before_generate": load, "others_cpu_share": max(0.0, others) / (seconds * os.cpu_count()),
              **notes}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(f"usage: {sys.argv[0]} ENGINE MODEL_DIR JOB_JSON OUT_JSON")
    run_worker(*sys.argv[1:])

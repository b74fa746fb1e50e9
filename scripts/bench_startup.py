"""Start-up time of the bundled demo model: process spawn to the first streamed token.

    .venv/bin/python scripts/bench_startup.py [--buckets 1,4,16,64,256] [--no-serve]

Each run is a fresh `python -c` process that imports fastgen, builds `fastgen.pipeline()` and
streams one prompt; the clock starts just before the process is spawned and stops when the
first token arrives. Runs, in order:
- compile="default" with a cold Inductor cache (TORCHINDUCTOR_CACHE_DIR = a fresh temp dir);
- compile="default" again with that cache warm (`--repeats` times; the median run is shown);
- compile="off" (the policy's choice for the demo model on a CPU; also `--repeats` times);
- `scripts/serve.py` (compile="default", the warm cache, then compile="off"): spawn to the first
  token streamed over gRPC by `fastgen.client`; the server is terminated afterwards.
Per-bucket compile seconds come from `engine.runner.warmup_seconds` (pipeline runs) and from the
server's "bucket N tokens ready in S s" log lines (serve runs). Buckets are the policy's unless
`--buckets` is given. Prints a table and writes JSON (default bench_results/startup.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from bench_common import write_json

import fastgen

# The child reports wall-clock stamps (time.time(), comparable across processes) as one JSON line.
CHILD = """
import json, sys, time
t_start = time.time()
import fastgen
t_import = time.time()
pipe = fastgen.pipeline(**json.loads(sys.argv[1]))
t_built = time.time()
for delta in pipe.stream(sys.argv[2], max_new_tokens=8, do_sample=False):
    if delta.token_ids:
        break
t_first = time.time()
print(json.dumps({"t_start": t_start, "t_import": t_import, "t_built": t_built, "t_first": t_first,
                  "buckets": pipe.engine.runner.buckets,
                  "warmup_seconds": {str(b): s for b, s in pipe.engine.runner.warmup_seconds.items()}}))
"""

BUCKET_LINE = re.compile(r"bucket (\d+) tokens ready in ([\d.]+) s")


def run_pipeline(config: dict, prompt: str, env: dict, timeout: float) -> dict:
    """Spawn a fresh interpreter that builds a pipeline and streams one token; its phase timings."""
    spawn = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config), prompt], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the start-up child exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"first_token_s": child["t_first"] - spawn, "interpreter_s": child["t_start"] - spawn,
            "import_s": child["t_import"] - child["t_start"], "pipeline_s": child["t_built"] - child["t_import"],
            "first_step_s": child["t_first"] - child["t_built"], "buckets": child["buckets"],
            "warmup_seconds": child["warmup_seconds"]}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(compile_mode: str, buckets: list[int] | None, prompt: str, env: dict, timeout: float) -> dict:
    """Spawn scripts/serve.py, wait for SERVING, stream one token over gRPC; then stop the server."""
    port = free_port()
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py"),
           "--host", "127.0.0.1", "--port", str(port), "--deployment-name", f"bench-startup-{os.getpid()}",
           "--no-progress", "--compile", compile_mode]
    if buckets:
        cmd += ["--buckets", ",".join(map(str, buckets))]
    log = tempfile.NamedTemporaryFile("w+", prefix="fastgen-serve-", suffix=".log", delete=False)
    client = fastgen.client(f"127.0.0.1:{port}")
    spawn = time.time()
    # Its own session, so that a Ctrl-C reaches only us; the finally below stops it.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while client.health(timeout=1.0) != "SERVING":
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"serve.py exited with {proc.returncode}:\n{log.read()[-3000:]}")
            if time.time() - spawn > timeout:
                raise TimeoutError(f"serve.py was not SERVING after {timeout:.0f} s (log: {log.name})")
            time.sleep(0.05)
        serving = time.time()
        for delta in client.stream(prompt, max_new_tokens=8, do_sample=False):
            if delta.token_ids:
                break
        first = time.time()
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    log.seek(0)
    warmup = {b: float(s) for b, s in BUCKET_LINE.findall(log.read())}
    log.close()
    os.unlink(log.name)
    return {"first_token_s": first - spawn, "serving_s": serving - spawn, "first_step_s": first - serving,
            "buckets": sorted(map(int, warmup)), "warmup_seconds": warmup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", default=None, help="comma-separated bucket sizes (default: the policy's)")
    parser.add_argument("--prompt", default="DeepSpeed is")
    parser.add_argument("--no-serve", action="store_true", help="skip the scripts/serve.py runs")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each warm-cache and compile-off "
                        "pipeline case (shared cores make one run noisy); the median is shown")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--target", type=float, default=15.0, help="issue 9's warm start-up target, seconds")
    parser.add_argument("--out", default="bench_results/startup.json")
    args = parser.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None

    cache = tempfile.mkdtemp(prefix="fastgen-inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    base = {"progress": False, **({"buckets": buckets} if buckets else {})}
    runs: list[tuple[str, dict]] = []
    try:
        for name, compile_mode, repeats in (("pipeline, compile, cold cache", "default", 1),
                                            ("pipeline, compile, warm cache", "default", args.repeats),
                                            ("pipeline, compile off", "off", args.repeats)):
            print(f"{name} ...", flush=True)
            tries = sorted((run_pipeline({**base, "compile": compile_mode}, args.prompt, env, args.timeout)
                            for _ in range(repeats)), key=lambda r: r["first_token_s"])
            runs.append((name, {**tries[len(tries) // 2], "first_token_s_all": [r["first_token_s"] for r in tries]}))
        if not args.no_serve:
            for name, compile_mode in (("serve.py, compile, warm cache", "default"), ("serve.py, compile off", "off")):
                print(f"{name} ...", flush=True)
                runs.append((name, run_serve(compile_mode, buckets, args.prompt, env, args.timeout)))
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    print(f"\n{'run':<32}{'first token':>12}{'import':>8}{'load+compile':>14}{'compile':>9}{'first step':>12}")
    for name, r in runs:
        load = r.get("pipeline_s", r.get("serving_s"))
        compile_total = sum(r["warmup_seconds"].values())
        imports = f"{r['import_s']:.2f}s" if "import_s" in r else "-"
        print(f"{name:<32}{r['first_token_s']:>11.2f}s{imports:>8}{load:>13.2f}s"
              f"{compile_total:>8.2f}s{r['first_step_s']:>11.3f}s")
    if not args.no_serve:
        print("(serve.py rows: 'load+compile' is spawn to SERVING, including the interpreter and imports)")
    for name, r in runs:
        if len(r.get("first_token_s_all", ())) > 1:
            print(f"{name}: median of {len(r['first_token_s_all'])} runs; first token after "
                  + ", ".join(f"{t:.2f}" for t in r["first_token_s_all"]) + " s")
    print("\ncompile seconds per bucket (tokens):")
    for name, r in runs:
        if r["warmup_seconds"]:
            items = sorted(((int(b), s) for b, s in r["warmup_seconds"].items()))
            print(f"  {name}: " + ", ".join(f"{b}: {s:.2f}" for b, s in items))
    warm = dict(runs)["pipeline, compile, warm cache"]["first_token_s"]
    print(f"\nwarm-cache start-up to first token: {warm:.2f} s (target < {args.target:.0f} s: "
          f"{'met' if warm < args.target else 'missed'})")
    write_json(args.out, {"args": vars(args), "python": sys.version.split()[0], "runs": [{"run": n, **r} for n, r in runs],
                          "warm_first_token_s": warm, "target_s": args.target, "target_met": warm < args.target})


if __name__ == "__main__":
    main()

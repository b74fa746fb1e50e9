"""Throughput through Ray Serve's HTTP proxy (1 and 2 replicas) against `scripts/serve.py` served
directly with as many replicas, on the same host, with the same OpenAI requests.

    python scripts/bench_ray.py [--model DIR] [--requests 48] [--concurrency 8] [--max-tokens 64]
        [--repeats 2] [--stream-interval-ms MS] [--engine-threads 2]

Each configuration serves the model (default: the bundled demo model) with the same engine settings
and gets the same load: `--requests` completions of `--max-tokens` tokens each (`ignore_eos`, greedy),
`--concurrency` at a time, streamed (server-sent events) and not, each mode `--repeats` times with
the configurations alternating within a round. Figures: generated tokens per second of wall time
(median over the repeats) and the proxy's overhead, 1 - Ray's tok/s / direct's with the same number
of replicas. `--engine-threads` (default: the machine's 2 cores) are split evenly among the engines,
the same way on both sides: one replica has them all (`OMP_NUM_THREADS=2`; a Serve replica
`num_cpus=2`), two have half each (`OMP_NUM_THREADS=1`, `num_cpus=1`); a replica count that would
leave an engine without a thread is skipped. With fewer engine threads than cores
(`--engine-threads 1`), the servers' own threads, Ray's processes and the load generator run on a
core of their own, as on a host with cores to spare beside the engines. The direct server with one
replica steps its engine on the process's main thread (`--replica-num 1`, whatever the policy would
plan); with two it runs fastgen's single-host router in front of two replica processes
(`--replica-num 2`). A Serve replica builds and steps its engine on one thread of the actor
(`EngineLoop.start`). `--stream-interval-ms` sets the Ray app's `stream_interval_ms` (default:
`build_app`'s). Everything listens on 127.0.0.1; the Ray cluster is local (`ray.init(num_cpus=2)`).
JSON goes to `bench_results/bench_ray.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from bench_common import free_port  # noqa: E402

ENGINE = {"progress": False}
"""Engine options of every Serve configuration (the direct server gets the same through `--no-progress`)."""
CORES = 2
"""The machine's cores: Ray's cluster has this many CPUs."""


async def _load(base: str, model: str, requests: int, concurrency: int, max_tokens: int, stream: bool) -> dict:
    """Send the load; returns tokens generated, wall seconds and request latencies."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        body = {"model": model, "prompt": f"Request {i}: once upon a time", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        async with gate:
            started = time.perf_counter()
            if stream:
                usage = None
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            usage = json.loads(line[6:]).get("usage") or usage
            else:
                resp = await client.post("/v1/completions", json=body)
                resp.raise_for_status()
                usage = resp.json()["usage"]
            latencies.append(time.perf_counter() - started)
            tokens += usage["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, i) for i in range(2)))  # warm-up, not counted
        tokens, latencies[:] = 0, []
        started = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(requests)))
        wall = time.perf_counter() - started
    return {"tokens": tokens, "seconds": wall, "tok_per_s": tokens / wall,
            "latency_p50_s": statistics.median(latencies)}


def _replicas(replicas: int) -> str:
    return f"{replicas} replica{'s' if replicas > 1 else ''}"


class Direct:
    """`scripts/serve.py --enable-restful-api --replica-num N` in its own process."""

    def __init__(self, model: str | None, replicas: int, threads: int) -> None:
        port, self.rest_port = free_port(), free_port()
        self.name = f"direct serve.py, {_replicas(replicas)}"
        # The cores split as among Serve's replicas (the policy could plan another replica count).
        argv = [sys.executable, os.path.join(REPO, "scripts", "serve.py"), "--port", str(port), "--enable-restful-api",
                "--restful-api-port", str(self.rest_port), "--deployment-name", "bench-ray-direct", "--no-progress",
                "--replica-num", str(replicas)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads // replicas)}
        self.proc = subprocess.Popen(argv + (["--model", model] if model else []), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
        # Read its log all along, so a full pipe never blocks the server.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.rest_port}"
        # Ready when the gateway answers (its replicas print their own "listening on" lines first).
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"scripts/serve.py exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


class RayApp:
    """`build_app` with `replicas` replicas, behind Serve's proxy on `url`."""

    def __init__(self, url: str, model: str | None, replicas: int, threads: int, engine: dict) -> None:
        from ray import serve

        from fastgen.serving.ray_app import build_app

        options = {**engine, "num_replicas": replicas, "deployment_name": "bench-ray",
                   "ray_actor_options": {"num_cpus": threads / replicas,
                                         "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads // replicas)}}}}
        if model:
            options["model"] = model
        self.name = f"Ray Serve, {_replicas(replicas)}"
        self.url = url
        self.app = f"bench{replicas}"
        serve.run(build_app(options), name=self.app, route_prefix="/")

    def close(self) -> None:
        from ray import serve

        serve.delete(self.app)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stream-interval-ms", type=float, default=None,
                        help="the Ray app's stream_interval_ms (default: build_app's own)")
    parser.add_argument("--engine-threads", type=int, default=CORES,
                        help=f"threads all engines share (default: the machine's {CORES} cores); fewer leaves the "
                             "servers and Ray a core of their own")
    parser.add_argument("--out", default=os.path.join(REPO, "bench_results", "bench_ray.json"))
    args = parser.parse_args()

    import ray
    from ray import serve

    from fastgen.engine import DEMO_MODEL_DIR

    if not 1 <= args.engine_threads <= CORES:
        parser.error(f"--engine-threads must be 1..{CORES}")
    replica_counts = [n for n in (1, 2) if args.engine_threads // n >= 1]
    for n in sorted({1, 2} - set(replica_counts)):
        print(f"{_replicas(n)}: skipped, {args.engine_threads} engine thread(s) cannot give each replica one")
    engine = dict(ENGINE)
    if args.stream_interval_ms is not None:
        engine["stream_interval_ms"] = args.stream_interval_ms

    ray.init(num_cpus=CORES, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    proxy_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
    proxy = f"http://127.0.0.1:{proxy_port}"
    model_id = args.model or os.path.basename(DEMO_MODEL_DIR)  # the id both servers list in /v1/models

    results: dict[str, dict[str, list[dict]]] = {}
    threads = args.engine_threads
    makers = [make for n in replica_counts
              for make in (lambda n=n: Direct(args.model, n, threads),
                           lambda n=n: RayApp(proxy, args.model, n, threads, engine))]
    try:
        for _ in range(args.repeats):
            # Each configuration alone on the machine: the others are stopped before it starts.
            for make in makers:
                server = make()
                try:
                    for stream in (False, True):
                        run = asyncio.run(_load(server.url, model_id, args.requests, args.concurrency,
                                                args.max_tokens, stream))
                        results.setdefault(server.name, {}).setdefault("stream" if stream else "unary", []).append(run)
                        print(f"{server.name:28s} {'stream' if stream else 'unary':6s} {run['tok_per_s']:8.1f} tok/s "
                              f"p50 {run['latency_p50_s']:.2f} s", flush=True)
                finally:
                    server.close()
    finally:
        serve.shutdown()
        ray.shutdown()

    summary = {name: {mode: statistics.median(r["tok_per_s"] for r in runs) for mode, runs in modes.items()}
               for name, modes in results.items()}
    print(f"\n{'configuration':28s} {'unary tok/s':>12s} {'stream tok/s':>13s}   overhead vs direct (unary, stream)")
    overheads = {}
    for name, modes in summary.items():
        direct = summary[f"direct serve.py, {name.partition(', ')[2]}"]
        overheads[name] = {m: 1 - modes[m] / direct[m] for m in ("unary", "stream")}
        print(f"{name:28s} {modes['unary']:12.1f} {modes['stream']:13.1f}   "
              f"{overheads[name]['unary']:+.1%}, {overheads[name]['stream']:+.1%}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "runs": results, "median_tok_per_s": summary, "overhead": overheads}, f,
                  indent=1)


if __name__ == "__main__":
    main()

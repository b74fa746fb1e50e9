"""Soak test: many random requests against a running deployment, a third cancelled mid-stream.

    .venv/bin/python scripts/soak.py [--duration 120] [--max-requests 2000] [--clients 6] [--model DIR]
                                     [--kinds grpc,grpc_stream,openai,openai_stream,mii]

Starts `scripts/serve.py` with the REST gateway on free 127.0.0.1 ports (loopback only; the demo
model unless `--model`), then runs `--clients` closed-loop client threads until `--duration`
seconds or `--max-requests` requests have passed. Each request picks at random an entry point
(gRPC `Generate`, gRPC `GenerateStream`, OpenAI `/v1/completions` streamed or not through the
`openai` package, MII's `/mii/` route; `--kinds` narrows the choice, to tell one entry point's cost
from another's) and valid random generation parameters (greedy or sampled,
seeds, top-k/top-p, penalties, stop strings, logprobs, n, one or several prompts); a third of the
streamed requests are cancelled after a few chunks. Every request must succeed: any error counts.

At the end, once the engine is idle, the KV blocks still in use are leaked blocks; the server's
resident memory is sampled every half second, and its growth after the warm-up (the first
`--warmup` fraction of the run) shows whether memory stays flat. (On CPU the KV cache is allocated
untouched and enters RSS as its blocks are first written; the block manager reuses the most
recently freed blocks, so this traffic keeps RSS flat, but a prefix cache that fills the whole KV
cache grows RSS up to the cache's size: bounded, not a leak.) Prints a table and writes JSON
(bench_results/soak.json). Exits 1 if there were errors or leaked blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import fastgen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the module", "a function", "Python is", "class", "import os", "def main():", "return", "for i in",
         "an error", "the value", "with open", "list of", "é ü 中文", "  spaces  ", "\n\n")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def metric(rest: str, name: str, api_key: str) -> float | None:
    """One unlabelled sample of the deployment's /metrics."""
    request = urllib.request.Request(f"http://{rest}/metrics", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


def random_prompt(rng: random.Random) -> str:
    """A short text prompt from a few words."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def random_params(rng: random.Random) -> dict:
    """Valid random generation parameters (MII/fastgen names)."""
    gen: dict = {"max_new_tokens": rng.randint(1, 48)}
    if rng.random() < 0.4:
        gen["do_sample"] = False
    else:
        gen["temperature"] = round(rng.uniform(0.1, 1.5), 2)
        gen["top_p"] = round(rng.uniform(0.3, 1.0), 2)
        if rng.random() < 0.5:
            gen["top_k"] = rng.randint(1, 80)
    if rng.random() < 0.5:
        gen["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.3:
        gen["stop"] = [rng.choice(("e", "\n", "the", "()", "ü"))]
    if rng.random() < 0.2:
        gen["repetition_penalty"] = round(rng.uniform(0.8, 1.5), 2)
    if rng.random() < 0.2:
        gen["presence_penalty"] = round(rng.uniform(-1, 1), 2)
        gen["frequency_penalty"] = round(rng.uniform(-1, 1), 2)
    if rng.random() < 0.2:
        gen["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        gen["n"] = rng.randint(2, 3)
    if rng.random() < 0.2:
        gen["ignore_eos"] = True
    return gen


def openai_params(gen: dict) -> dict:
    """The same parameters under OpenAI's names."""
    out = {"max_tokens": gen["max_new_tokens"]}
    out["temperature"] = 0.0 if gen.get("do_sample") is False else gen["temperature"]
    for key in ("top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logprobs", "n"):
        if key in gen:
            out[key] = gen[key]
    extra = {k: gen[k] for k in ("top_k", "repetition_penalty", "ignore_eos") if k in gen}
    if extra:
        out["extra_body"] = extra
    return out


KINDS = ("grpc", "grpc_stream", "openai", "openai_stream", "mii")
"""The entry points a request may take (`--kinds` picks some)."""


class Soak:
    """The client side: counts requests, cancellations and errors per entry point."""

    def __init__(self, grpc_address: str, rest: str, deployment_name: str, api_key: str,
                 kinds: tuple[str, ...] = KINDS) -> None:
        import openai

        self.grpc = fastgen.client(grpc_address, api_key=api_key)
        self.openai = openai.OpenAI(base_url=f"http://{rest}/v1", api_key=api_key, max_retries=0, timeout=120)
        self.rest = rest
        self.api_key = api_key
        self.deployment_name = deployment_name
        self.model_name = next(m.id for m in self.openai.models.list().data)
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.cancelled = 0
        self.errors: list[str] = []
        self.num_requests = 0
        self.kinds = kinds

    def take(self, max_requests: int) -> bool:
        """Claim the next request slot (False once `max_requests` have been claimed)."""
        with self.lock:
            if self.num_requests >= max_requests:
                return False
            self.num_requests += 1
            return True

    def one(self, rng: random.Random) -> None:
        """Send one random request and check its answer."""
        gen = random_params(rng)
        kind = rng.choice(self.kinds)
        cancel = kind.endswith("stream") and rng.random() < 1 / 3
        prompts = [random_prompt(rng) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
        try:
            if kind == "grpc":
                out = self.grpc.generate(prompts, **gen)
                assert len(out) == len(prompts) * gen.get("n", 1), "missing completions"
            elif kind == "grpc_stream":
                stream = self.grpc.stream(prompts, **gen)
                for i, _ in enumerate(stream):
                    if cancel and i >= 2:
                        stream.close()
                        break
            elif kind == "openai":
                reply = self.openai.completions.create(model=self.model_name, prompt=prompts, **openai_params(gen))
                assert len(reply.choices) == len(prompts) * gen.get("n", 1), "missing choices"
            elif kind == "openai_stream":
                stream = self.openai.completions.create(model=self.model_name, prompt=prompts, stream=True,
                                                        **openai_params(gen))
                for i, _ in enumerate(stream):
                    if cancel and i >= 2:
                        stream.close()
                        break
            else:
                body = json.dumps({"prompts": prompts, **gen}).encode()
                request = urllib.request.Request(f"http://{self.rest}/mii/{self.deployment_name}", body,
                                                 {"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.api_key}"})
                with urllib.request.urlopen(request, timeout=120) as reply:
                    assert len(json.load(reply)) == len(prompts) * gen.get("n", 1), "missing responses"
        except Exception as exc:
            with self.lock:
                self.errors.append(f"{kind} {gen}: {type(exc).__name__}: {exc}"[:400])
            return
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.cancelled += cancel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    parser.add_argument("--max-requests", type=int, default=2000, help="stop after this many requests")
    parser.add_argument("--clients", type=int, default=6, help="concurrent closed-loop clients")
    parser.add_argument("--warmup", type=float, default=0.3, help="fraction of the run before RSS counts as settled")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random requests")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated entry points to use (default: all of {','.join(KINDS)})")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_results", "soak.json"))
    args = parser.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds takes some of {','.join(KINDS)}, got {args.kinds!r}")

    grpc_port, rest_port = free_port(), free_port()
    api_key = "soak-" + os.urandom(8).hex()
    model_name = os.path.basename(os.path.normpath(args.model)) if args.model else "demo_model"
    name = f"{model_name}-deployment"
    command = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--host", "127.0.0.1",
               "--port", str(grpc_port), "--deployment-name", name, "--enable-restful-api",
               "--restful-api-port", str(rest_port), "--api-key", api_key, "--compile", "off"]
    if args.model:
        command += ["--model", args.model]
    log_path = os.path.join(ROOT, "bench_results", "soak-server.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    grpc_address, rest = f"127.0.0.1:{grpc_port}", f"127.0.0.1:{rest_port}"
    try:
        deadline = time.monotonic() + 300
        probe = fastgen.client(grpc_address, api_key=api_key)
        while probe.health() != "SERVING":
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start (see {log_path})")
            time.sleep(0.5)
        soak = Soak(grpc_address, rest, name, api_key, kinds)
        rss: list[tuple[float, int]] = []
        started = time.monotonic()
        end = started + args.duration
        done = threading.Event()

        def sample_rss() -> None:
            while not done.wait(0.5):
                rss.append((time.monotonic() - started, rss_bytes(server.pid)))

        def client(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            while time.monotonic() < end and soak.take(args.max_requests):
                soak.one(rng)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        # Cancelled requests are freed at the engine's next step: wait until it is idle.
        idle_deadline = time.monotonic() + 30
        while (metric(rest, "fastgen_engine_requests", api_key) or 0) > 0 and time.monotonic() < idle_deadline:
            time.sleep(0.2)
        done.set()
        total = metric(rest, "fastgen_kv_blocks_total", api_key) or 0
        free = metric(rest, "fastgen_kv_blocks_free", api_key) or 0
        settled = [b for t, b in rss if t >= args.warmup * elapsed]
        growth = (max(settled) - settled[0]) if settled else 0
        result = {
            "duration_s": round(elapsed, 1), "requests": sum(soak.counts.values()) + len(soak.errors),
            "by_entry_point": soak.counts, "cancelled_mid_stream": soak.cancelled, "errors": len(soak.errors),
            "error_samples": soak.errors[:10], "leaked_kv_blocks": int(total - free), "kv_blocks_total": int(total),
            "rss_start_mb": round(settled[0] / 2**20, 1) if settled else None,
            "rss_max_after_warmup_mb": round(max(settled) / 2**20, 1) if settled else None,
            "rss_growth_after_warmup_mb": round(growth / 2**20, 1),
            "rss_peak_mb": round(max(b for _, b in rss) / 2**20, 1) if rss else None,
            # Every 10 s: whether memory climbs steadily (a leak) or levels off (caches, allocator arenas).
            "rss_series_mb": [[round(t), round(b / 2**20, 1)] for t, b in rss[::20]],
        }
    finally:
        try:
            fastgen.client(grpc_address, api_key=api_key).terminate_server(timeout=30)
        except Exception:
            pass
        if server.poll() is None:
            server.terminate()
        server.wait(30)
    print(f"{'duration':<28}{result['duration_s']} s")
    for key in ("requests", "cancelled_mid_stream", "errors", "leaked_kv_blocks", "rss_start_mb",
                "rss_max_after_warmup_mb", "rss_growth_after_warmup_mb", "rss_peak_mb"):
        print(f"{key:<28}{result[key]}")
    print(f"{'by entry point':<28}{soak.counts}")
    for line in result["error_samples"]:
        print("error:", line)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 1 if result["errors"] or result["leaked_kv_blocks"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Graceful drain on SIGTERM: admission stops (gRPC UNAVAILABLE, HTTP 503, health fails) while the
requests already admitted finish, then the process exits 0. The budget's drain itself, and
`scripts/serve.py` as a real process (one engine, and a front end over replicas), each signalled during
8 streams over gRPC and REST. Only 127.0.0.1."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastgen.serving.admission import Draining, PendingBudget
from fastgen.serving.cli import build_parser, validate
from fastgen.serving.deploy import registry
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc
from fastgen.serving.limits import API_KEY_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 480
N = 3
"""Tokens per choice and choices per stream: 24 sequences of 480 tokens keep every stream generating for
seconds after its first token (a single 480-token sequence of the tiny model takes well under one),
so SIGTERM, sent once every stream has its first token, lands while all 8 are in flight."""


@pytest.fixture(autouse=True)
def registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_DIR, str(tmp_path / "deployments"))
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _eventually(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout} s"
        time.sleep(0.02)


def test_budget_drain_refuses_new_and_waits_for_admitted():
    budget = PendingBudget(None)
    first, second = budget.acquire(2, "prompts"), budget.acquire(1, "prompts")
    assert not budget.wait_idle(0.05)
    budget.drain()
    assert budget.draining
    with pytest.raises(Draining, match="shutting down"):
        budget.acquire(1, "prompts")
    first()
    assert not budget.wait_idle(0.05) and budget.pending == 1
    threading.Timer(0.2, second).start()
    started = time.monotonic()
    assert budget.wait_idle(10) and budget.pending == 0
    assert time.monotonic() - started >= 0.15  # it waited for the release, not a poll that gave up


def test_drain_timeout_flag():
    parser = build_parser()
    assert parser.parse_args([]).drain_timeout == 30.0
    with pytest.raises(SystemExit):
        validate(parser, parser.parse_args(["--drain-timeout", "-1", "--deployment-name", "x"]))


def _start(model: str, *extra: str) -> tuple[subprocess.Popen, int, int, list[str]]:
    port, rest_port = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "scripts", "serve.py"), "--model", model, "--port", str(port),
         "--enable-restful-api", "--restful-api-port", str(rest_port), "--deployment-name", "drain",
         "--no-progress", "--num-kv-blocks", "2048", "--block-size", "8", "--token-budget", "32", "--max-seqs", str(8 * N),
         "--drain-timeout", "120", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    _eventually(lambda: f"listening on 127.0.0.1:{port}\n" in lines or proc.poll() is not None, 120, "start")
    assert proc.poll() is None, "".join(lines)
    return proc, port, rest_port, lines


def _sigterm_during_8_streams(proc: subprocess.Popen, port: int, rest_port: int, lines: list[str]) -> None:
    """4 REST and 4 gRPC streams; SIGTERM once each has its first token; all 8 run to their end while
    new calls of both protocols are refused and health fails; the process then exits 0."""
    url = f"http://127.0.0.1:{rest_port}"
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.FastGenStub(channel)
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    first_token = threading.Barrier(9)
    results: list = [None] * 8
    last_token_at = [0.0] * 8

    def rest_stream(i: int) -> None:
        body = {"model": model, "prompt": f"stream {i}", "max_tokens": TOKENS, "n": N, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            events = (json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {"))
            next(events)
            first_token.wait(60)
            finish, usage = {}, None
            for event in events:
                for choice in event["choices"]:
                    if choice["finish_reason"]:
                        finish[choice["index"]] = choice["finish_reason"]
                    last_token_at[i] = time.monotonic()
                usage = event.get("usage") or usage
            results[i] = (resp.status_code, finish, usage["completion_tokens"])

    def grpc_stream(i: int) -> None:
        call = stub.GenerateStream(pb.GenerateRequest(prompts=[pb.Prompt(text=f"stream {i}")], params=pb.SamplingParams(
            max_new_tokens=TOKENS, n=N, ignore_eos=True, do_sample=False)), timeout=120)
        deltas = iter(call)
        next(deltas)
        first_token.wait(60)
        finish = {}
        for delta in deltas:
            last_token_at[i] = time.monotonic()
            if delta.finish_reason not in ("", "none"):
                finish[delta.index] = (delta.finish_reason, delta.generated_length)
        results[i] = ("OK", finish)

    def run(target, i: int) -> None:
        try:
            target(i)
        except Exception as exc:  # kept, so a failure names itself instead of hanging the barrier
            results[i] = exc
            first_token.abort()

    threads = [threading.Thread(target=run, args=(rest_stream if i < 4 else grpc_stream, i)) for i in range(8)]
    for t in threads:
        t.start()
    first_token.wait(60)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        resp = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "late", "max_tokens": 2}, timeout=30)
        return resp.status_code == 503
    _eventually(refused, 10, "new REST requests refused")
    late = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "late", "max_tokens": 2}, timeout=30)
    assert late.json()["error"]["code"] == "draining" and late.headers["connection"] == "close"
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(pb.GenerateRequest(prompts=[pb.Prompt(text="late")], params=pb.SamplingParams(max_new_tokens=2)),
                      timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert proc.poll() is None and any(t.is_alive() for t in threads)  # refused while streams were running

    for t in threads:
        t.join(120)
    channel.close()
    assert results[:4] == [(200, dict.fromkeys(range(N), "length"), N * TOKENS)] * 4, results
    assert results[4:] == [("OK", dict.fromkeys(range(N), ("length", TOKENS)))] * 4, results
    assert min(last_token_at) > signalled  # every stream was still generating when SIGTERM came
    assert proc.wait(60) == 0, "".join(lines)
    assert any("drained: every admitted request finished" in line for line in lines), "".join(lines)


def test_sigterm_drains_one_engine(tiny_checkpoints):
    proc, port, rest_port, lines = _start(tiny_checkpoints["llama"])
    try:
        _sigterm_during_8_streams(proc, port, rest_port, lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sigterm_drains_a_front_end_over_replicas(tiny_checkpoints):
    """With replicas, the front end drains (the streams it routed finish on the replicas), then stops
    its replicas, which exit at once: nothing is left in flight there."""
    proc, port, rest_port, lines = _start(tiny_checkpoints["llama"], "--replica-num", "2")
    try:
        try:
            _sigterm_during_8_streams(proc, port, rest_port, lines)
        except Exception as exc:
            raise AssertionError("".join(lines)) from exc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

"""Big bodies beside a running stream: the real server (uvicorn on 127.0.0.1) keeps streaming and
answering `/health` while it is sent 2 MB prompts (admitted under a 4 MiB limit, then refused by
the character pre-check or the context) and 20 MB bodies (413 from the headers, or as soon as a
chunked body passes the limit), and its memory grows by far less than what it was sent.

The stream's largest gap between chunks and the slowest `/health` answer are printed (run with
`-s`) so they can be reported against the 0.25 s goal; the asserted bound is a generous 1 s,
since the client threads share this process and two cores with the server.
"""

import json
import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from fastgen import EngineConfig
from fastgen.engine import Engine
from fastgen.engine import EngineLoop
from fastgen.serving.limits import ServingLimits
from fastgen.serving.http.app import create_app

KEY = "big-key"
MODEL = "tiny-llama"
DEPLOYMENT = "big"
LIMIT = 4 * 1024 * 1024
BIG = 2 * 1024 * 1024
HUGE = 20 * 1024 * 1024
STREAM_TOKENS = 400
GOAL_S = 0.25
BOUND_S = 1.0


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    engine = Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], num_kv_blocks=128, block_size=8, token_budget=32,
                                 max_seqs=8, progress=False))
    engine.eos_token_ids = set()  # the stream runs to max_tokens: its token count is exact
    loop = EngineLoop(engine)
    app = create_app(loop, DEPLOYMENT, engine.tokenizer, MODEL, max_model_len=engine.max_model_len,
                     limits=ServingLimits(api_keys=(KEY,), max_body_bytes=LIMIT))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield sock.getsockname()[1], engine, app
    srv.should_exit = True
    thread.join(15)
    loop.shutdown()
    sock.close()


def _request(port: int, path: str, body: bytes, *, chunked: bool = False) -> tuple[int, dict, float]:
    """Send one POST over a raw socket the way a careful client does (stop sending once the server
    has answered); returns (status, JSON body, seconds until the answer)."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n" \
           "Content-Type: application/json\r\nConnection: close\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {len(body)}\r\n\r\n"
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(head.encode())
        view, step = memoryview(body), 256 * 1024
        try:
            for offset in range(0, len(body), step):
                if select.select([conn], [], [], 0)[0]:
                    break  # answered already: the rest would only be thrown away
                piece = view[offset:offset + step]
                conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            else:
                if chunked:
                    conn.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed after answering; the answer is read below
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw) < raw.index(b"\r\n\r\n") + 4 + _length(raw):
            data = conn.recv(65536)
            if not data:
                break
            raw += data
    elapsed = time.perf_counter() - started
    status = int(raw.split(b" ", 2)[1])
    return status, json.loads(raw.partition(b"\r\n\r\n")[2] or b"{}"), elapsed


def _length(raw: bytes) -> int:
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _bodies() -> list[tuple[str, str, bytes, bool, int, str]]:
    """(what, path, body, chunked, expected status, expected error param) for one round."""
    text = "hello world " * (BIG // 12)
    ids = list(range(3, 300)) * (BIG // (len(range(3, 300)) * 4))
    padding = b" " * (HUGE - 64)
    return [
        ("2 MB text prompt", "/v1/completions",
         json.dumps({"model": MODEL, "prompt": text, "max_tokens": 4}).encode(), False, 400, "prompt"),
        ("2 MB token-id prompt", "/v1/completions",
         json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 4}).encode(), False, 400, "prompt"),
        ("2 MB chat message", "/v1/chat/completions",
         json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode(), False, 400,
         "messages"),
        ("2 MB MII prompt", f"/mii/{DEPLOYMENT}", json.dumps({"prompts": [text]}).encode(), False, 400, "prompts"),
        ("20 MB body", "/v1/completions", b'{"model": "' + padding + b'"}', False, 413, None),
        ("20 MB chunked body", "/v1/completions", b'{"model": "' + padding + b'"}', True, 413, None),
    ]


def test_big_bodies_do_not_stall_a_stream_or_health(server):
    port, engine, app = server
    url = f"http://127.0.0.1:{port}"
    bodies = _bodies()  # built before the first RSS reading: the client's copies are not the server's growth
    headers = {"Authorization": f"Bearer {KEY}"}
    rss_before = _rss_mb()
    sending = threading.Event()
    sending.set()
    results, health = [], []

    def send_rounds() -> None:
        try:
            for _ in range(3):
                for what, path, body, chunked, status, param in bodies:
                    results.append((what, status, param, *_request(port, path, body, chunked=chunked)))
        finally:
            sending.clear()

    def poll_health() -> None:
        with httpx.Client(base_url=url) as client:
            while True:  # at least one probe, however fast the sender is
                started = time.perf_counter()
                assert client.get("/health").status_code == 200
                health.append(time.perf_counter() - started)
                if not sending.is_set():
                    return
                time.sleep(0.01)

    gaps, streams = [], 0
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": STREAM_TOKENS, "temperature": 1.0,
                "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
        sender, poller = threading.Thread(target=send_rounds), threading.Thread(target=poll_health)
        # One stream after another until the big bodies are all sent, so every one of them meets a stream.
        while streams == 0 or sending.is_set():
            with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                last, usage, text = None, None, ""
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    usage = event.get("usage") or usage
                    text += "".join(c["text"] for c in event["choices"])
                    if streams == 0 and not sender.is_alive() and len(gaps) == 2:
                        sender.start()
                        poller.start()
            assert usage["completion_tokens"] == STREAM_TOKENS, usage  # the stream finished with all its tokens
            streams += 1
        sender.join(60)
        poller.join(10)
    rss_growth = _rss_mb() - rss_before

    for what, status, param, got_status, error, elapsed in results:
        print(f"{what}: {got_status} in {elapsed:.3f} s")
        assert got_status == status, (what, error)
        assert error["error"]["param"] == param and error["error"]["message"], (what, error)
        if status == 413:
            assert str(LIMIT) in error["error"]["message"] and elapsed < BOUND_S, (what, elapsed)
    assert len(results) == 3 * len(bodies) and health
    worst_gap, worst_health = max(gaps), max(health)
    print(f"{streams} stream(s) of {STREAM_TOKENS} tokens beside {len(results)} big bodies: largest inter-chunk "
          f"gap {worst_gap:.3f} s, slowest /health {worst_health:.3f} s over {len(health)} probes "
          f"(goal {GOAL_S} s), server RSS growth {rss_growth:.1f} MB")
    assert worst_gap < BOUND_S and worst_health < BOUND_S
    assert rss_growth < 300
    assert not engine.requests and app.state.gateway.pending == 0
    ok = httpx.post(url + "/v1/completions", headers=headers, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2

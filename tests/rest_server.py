"""A real REST server for tests that drive it with real clients: the gateway app over a tiny
checkpoint's engine, served by uvicorn on 127.0.0.1 in a thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from fastgen import EngineConfig
from fastgen.engine import Engine, EngineLoop
from fastgen.serving.metrics import ServingMetrics
from fastgen.serving.http.app import create_app


@dataclass
class Served:
    """One running server: its base URL, the engine behind it and the app."""

    url: str
    engine: Engine
    app: Any

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no request is left in the engine or the gateway (a stream's admission slots come
        back in a task that runs after its last byte was sent); fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.engine.requests or self.app.state.gateway.pending:
            assert time.monotonic() < deadline, "requests were left behind in the engine or the gateway"
            time.sleep(0.02)


@contextlib.contextmanager
def serve(model_dir: str, model_name: str, engine_options: dict, **app_options: Any) -> Iterator[Served]:
    """Serve `model_dir` as `model_name` until the block ends; `app_options` go to `create_app`."""
    engine = Engine.from_config(EngineConfig(model=model_dir, **engine_options))
    loop = EngineLoop(engine)
    app = create_app(loop, "test-deployment", engine.tokenizer, model_name, max_model_len=engine.max_model_len,
                     metrics=ServingMetrics(engine.stats), **app_options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, app)
    finally:
        server.should_exit = True
        thread.join(15)
        loop.shutdown()
        sock.close()


def openai_token_ids(client: Any, model: str, prompt: list[int], max_tokens: int, stream: bool = False) -> list[int]:
    """Greedy token ids of `prompt` under `model` through the official `openai` client (read back from
    `token_id:N` logprob tokens; EOS ignored), streamed or not."""
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                                    stream=stream, extra_body=extra)
    chunks = list(out) if stream else [out]
    return [int(t.removeprefix("token_id:")) for c in chunks for t in c.choices[0].logprobs.tokens]

"""LoRA adapters served: the official `openai` client (unmodified) against the real server over a tiny
llama checkpoint, where `model=<adapter>` generates peft's greedy tokens and the base name the base
model's (completions and chat, streamed and not), `/v1/models` lists adapters with their `parent`,
vLLM's load/unload routes work at run time behind the API key (a bad adapter is a 400 and serving
goes on, an unknown one a 404, one in use a 409) and `vllm:lora_requests_info` is on `/metrics`;
`--lora-modules` is read and checked by the launcher (end to end through `scripts/serve.py`) and the
Ray app's `lora_modules`; gRPC's `GenerateRequest.lora` selects an adapter (NOT_FOUND for one not
loaded), also through the Python gRPC client's `lora=`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx
import openai
import pytest
from kit_lora import ENGINE, NUM_NEW, build_family
from rest_server import openai_token_ids, serve

from fastgen import EngineConfig
from fastgen.engine import DEMO_MODEL_DIR, Engine
from fastgen.engine.lora_manager import UnknownLoRAError
from fastgen.serving.backend import LocalBackend, served_adapters
from fastgen.serving.deploy.launcher import _load_lora_modules
from fastgen.serving.cli import build_parser, validate
from fastgen.serving.client import Client
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc
from fastgen.serving.grpc.server import GrpcServer
from fastgen.serving.lora import LoRAModule, parse_lora_module
from fastgen.serving.ray_app import FastGenServer, _server_options

MODEL = "tiny-base"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sekret"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("lora_serving"), "llama")


@pytest.fixture(scope="module")
def served(family):
    with serve(family.path, MODEL, ENGINE, api_key=KEY) as server:
        server.engine.load_lora("a", family.adapters["a"])  # the loop is idle: as --lora-modules does before serving
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)


def _post(served, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(served.url + path, json=body, headers=headers, timeout=60)


def _tokens(client, model: str, prompt: list[int], stream: bool = False) -> list[int]:
    return openai_token_ids(client, model, prompt, NUM_NEW, stream)


def test_model_selects_adapter(family, served, client):
    for prompt, want_a, want_base in zip(family.prompts[:3], family.want["a"], family.want[None]):
        assert _tokens(client, "a", prompt) == want_a
        assert _tokens(client, "a", prompt, stream=True) == want_a
        assert _tokens(client, MODEL, prompt) == want_base
    reply = client.completions.create(model="a", prompt=family.prompts[0], max_tokens=2)
    assert reply.model == "a"
    served.wait_idle()


def test_chat_under_adapter_equals_completion_of_its_prompt(served, client):
    messages = [{"role": "user", "content": "hi"}]
    kwargs = dict(messages=messages, max_tokens=NUM_NEW, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(model="a", **kwargs)
    streamed = client.chat.completions.create(model="a", stream=True, **kwargs)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    base = client.chat.completions.create(model=MODEL, **kwargs)
    assert plain.model == "a" and plain.choices[0].message.content == text
    assert base.choices[0].message.content != text  # the adapter (random, non-zero B) changes the reply
    served.wait_idle()


def test_models_lists_adapters_with_parent(family, client):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["a"].parent == MODEL and cards["a"].root == family.adapters["a"]
    assert client.models.retrieve("a").parent == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_tokenize_takes_an_adapter_name(served):
    assert _post(served, "/tokenize", {"model": "a", "prompt": "hi"}).json()["tokens"] == \
        _post(served, "/tokenize", {"model": MODEL, "prompt": "hi"}).json()["tokens"]
    assert _post(served, "/tokenize", {"model": "nope", "prompt": "hi"}).status_code == 404


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_load_and_unload_at_run_time(family, served, client):
    assert _post(served, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": family.adapters["b"]},
                 key=None).status_code == 401
    loaded = _post(served, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": family.adapters["b"]})
    assert loaded.status_code == 200, loaded.text
    assert _tokens(client, "b", family.prompts[1]) == family.want["b"][1]
    again = _post(served, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": family.adapters["b"]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt="x", max_tokens=2)
    missing = _post(served, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
    assert "b" not in {m.id for m in client.models.list().data}


def test_bad_adapter_is_400_and_serving_goes_on(family, served, client, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")
    for body, field in (({"lora_name": "bad", "lora_path": str(tmp_path)}, "lora_path"),
                        ({"lora_name": "bad", "lora_path": str(tmp_path / "none")}, "lora_path"),
                        ({"lora_name": MODEL, "lora_path": family.adapters["b"]}, "lora_name"),
                        ({"lora_path": family.adapters["b"]}, "lora_name")):
        refused = _post(served, "/v1/load_lora_adapter", body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    assert "bad" not in served.engine.lora_adapters()
    assert _tokens(client, "a", family.prompts[0]) == family.want["a"][0]


def test_unloading_an_adapter_in_use_is_409(family, served, client):
    loaded = _post(served, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": family.adapters["b"]})
    assert loaded.status_code == 200, loaded.text
    # As long as the KV cache allows, so the request still runs when the unload comes.
    longest = served.engine.max_model_len - len(family.prompts[0]) - 1
    stream = client.completions.create(model="c", prompt=family.prompts[0], max_tokens=longest, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))  # the request runs under "c" now
    assert first.model == "c"
    busy = _post(served, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"]
    stream.close()
    served.wait_idle()
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200


def test_metrics_gauge(family, served, client):
    seen: list[str] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            text = httpx.get(served.url + "/metrics", timeout=10).text
            seen.extend(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        client.completions.create(model="a", prompt=family.prompts[0], max_tokens=served.engine.max_model_len - 2,
                                  extra_body={"ignore_eos": True})
    finally:
        stop.set()
        scraper.join()
    assert any('running_lora_adapters="a"' in line for line in seen), seen[:3]
    assert all('max_lora="2"' in line for line in seen)
    idle = [line for line in httpx.get(served.url + "/metrics").text.splitlines()
            if line.startswith("vllm:lora_requests_info{")]
    assert idle and 'running_lora_adapters=""' in idle[0] and 'waiting_lora_adapters=""' in idle[0]


def test_a_server_without_lora_refuses_loads():
    adapters = served_adapters(None)  # a backend without an engine loop, or an engine built without enable_lora
    assert adapters.paths() == {} and "a" not in adapters and adapters.usage() == {}
    for call, args in ((adapters.load, ("a", "/p")), (adapters.unload, ("a",))):
        with pytest.raises(ValueError, match="--enable-lora"):
            call(*args)


def test_lora_modules_flag(tmp_path):
    assert parse_lora_module("a=/x/y") == LoRAModule("a", "/x/y")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') == LoRAModule("a", "/x")
    odd = LoRAModule("a=b", "/x=y")  # what the front end passes its replicas reads back the same
    assert parse_lora_module(odd.spec()) == odd
    for bad in ("a", "=/x", "a=", '{"name": "a"}', '{"name": "a", "path": "/x", "rank": 2}', "{bad"):
        with pytest.raises(ValueError):
            parse_lora_module(bad)
    parser = build_parser()
    args = parser.parse_args(["--deployment-name", "d", "--enable-lora", "--lora-modules", "a=/p",
                              '{"name": "b", "path": "/q"}'])
    assert args.lora_modules == [LoRAModule("a", "/p"), LoRAModule("b", "/q")]
    config, _ = validate(parser, args)
    assert config.enable_lora
    args = parser.parse_args(["--deployment-name", "d", "--enable-lora", "--replica-num", "2", "--lora-modules",
                              "a=/p"])
    assert validate(parser, args)[0].enable_lora  # every replica loads them
    base = os.path.basename(DEMO_MODEL_DIR)  # the name requests give the demo model
    for argv in (["--lora-modules", "a=/p"], ["--enable-lora", "--lora-modules", "a=/p", "a=/q"],
                 ["--enable-lora", "--lora-modules", f"{base}=/p"]):
        with pytest.raises(SystemExit):
            validate(parser, parser.parse_args(["--deployment-name", "d", *argv]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-lora", "--lora-modules", "nopath"])


def test_grpc_lora_field(family, served):
    backend = LocalBackend(served.app.state.gateway.backend, "tiny")  # the REST server's engine loop
    server = GrpcServer("127.0.0.1", 0, deployment_name="tiny", backend=backend)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.FastGenStub(channel)
            params = pb.SamplingParams(max_new_tokens=NUM_NEW, do_sample=False, ignore_eos=True)
            prompt = pb.Prompt(token_ids=pb.TokenIds(ids=family.prompts[2]))
            for lora, want in (("a", family.want["a"][2]), ("", family.want[None][2])):
                reply = stub.Generate(pb.GenerateRequest(prompts=[prompt], params=params, lora=lora))
                assert list(reply.completions[0].token_ids) == want
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(pb.GenerateRequest(prompts=[prompt], params=params, lora="nope"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()
        client = Client(server.address)
        try:
            assert client.generate([family.prompts[2]], lora="a", max_new_tokens=NUM_NEW, do_sample=False,
                                   ignore_eos=True)[0].token_ids == family.want["a"][2]
            with pytest.raises(UnknownLoRAError, match="nope"):
                client.generate(["x"], lora="nope", max_new_tokens=2)
        finally:
            client.close()
    finally:
        server.stop(grace=0)


def test_lora_modules_load_at_start_up(family, tmp_path):
    good = argparse.Namespace(model=family.path, lora_modules=[LoRAModule("a", family.adapters["a"])])
    engine = Engine.from_config(EngineConfig(model=family.path, **ENGINE))
    _load_lora_modules(engine, good)
    assert engine.lora_adapters() == {"a": family.adapters["a"]}
    engine.shutdown()
    bad = argparse.Namespace(model=family.path, lora_modules=[LoRAModule("x", str(tmp_path / "none"))])
    with pytest.raises(SystemExit, match="--lora-modules x="):
        _load_lora_modules(Engine.from_config(EngineConfig(model=family.path, **ENGINE)), bad)


def test_ray_app_lora_modules(family):
    options = _server_options({"model": family.path, "lora_modules": f"a={family.adapters['a']}"},
                              {**ENGINE, "enable_lora": True})
    assert options.lora_modules == (LoRAModule("a", family.adapters["a"]),)
    server = FastGenServer(options)
    try:
        assert server.engine.lora_adapters() == {"a": family.adapters["a"]}
    finally:
        server.shutdown()
    for value, engine in (("a=/p", {}), ([3], {"enable_lora": True}), ("nopath", {"enable_lora": True})):
        with pytest.raises((TypeError, ValueError), match="lora_modules"):
            _server_options({"lora_modules": value}, engine)
    bad = dataclasses.replace(options, lora_modules=(LoRAModule("x", "/no/such/dir"),))
    with pytest.raises(ValueError, match="lora_modules x=/no/such/dir"):
        FastGenServer(bad)


def _serve_process(family, *modules: str) -> tuple[subprocess.Popen, int, list[str]]:
    """`scripts/serve.py` over the family's checkpoint with `--lora-modules *modules`, started or exited."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        port, rest_port = a.getsockname()[1], b.getsockname()[1]
    argv = [sys.executable, os.path.join(REPO, "scripts", "serve.py"), "--model", family.path, "--port", str(port),
            "--enable-restful-api", "--restful-api-port", str(rest_port), "--deployment-name",
            f"lora-{os.getpid()}-{port}", "--no-progress", "--num-kv-blocks", "24", "--block-size", "4",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--drain-timeout", "0",
            "--lora-modules", *modules]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while f"listening on 127.0.0.1:{port}\n" not in lines and proc.poll() is None:
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    if proc.poll() is not None:
        reader.join(10)
    return proc, rest_port, lines


def test_serve_py_lora_modules(family):
    proc, rest_port, lines = _serve_process(family, f"a={family.adapters['a']}")
    try:
        assert proc.poll() is None, "".join(lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{rest_port}/v1", api_key="none", max_retries=0)
        assert client.models.retrieve("a").parent == family.path  # --model names the base
        assert _tokens(client, "a", family.prompts[1]) == family.want["a"][1]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(lines)
    bad, _, lines = _serve_process(family, f"bad={family.path}")  # a checkpoint, not an adapter
    assert bad.wait(60) != 0 and "--lora-modules bad=" in "".join(lines), "".join(lines)

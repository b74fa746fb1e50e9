"""LoRA adapters behind the replica router: one `scripts/serve.py --replica-num 2 --enable-lora` deployment
(shared by every test: processes are dear on two cores) over a tiny llama checkpoint.

Through the router, the official `openai` client's `model=<adapter>` (and gRPC's `lora`) generates
peft's greedy tokens, which a single engine generates too (tests/test_lora_serving.py), on either
replica; an unknown adapter is a 404 / NOT_FOUND. vLLM's load and unload routes reach both replicas
(each asked directly over gRPC's ListLoRA); a load that fails, even on one replica only, leaves
nothing loaded anywhere; unloading an adapter a request uses is a 409; `vllm:lora_requests_info`
covers both replicas; a replica out of rotation while an adapter loads gets it before it is back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import httpx
import openai
import pytest
from kit_lora import NUM_NEW, build_family
from rest_server import openai_token_ids
from test_serving_process import _eventually, _free_port, _kill_group

from fastgen.engine import UnknownLoRAError
from fastgen.serving.client import Client
from fastgen.serving.deploy import registry
from fastgen.serving.grpc.guard import auth_metadata
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc
from fastgen.serving.limits import API_KEY_ENV

KEY = "rsekret"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Deployment:
    """The running deployment: its REST base URL, a gRPC client of the front end and the replicas' addresses."""

    def __init__(self, url: str, grpc_address: str) -> None:
        self.url = url
        self.grpc_address = grpc_address
        self.client = Client(grpc_address, api_key=KEY)
        replicas = self.client.model_info()["replicas"]
        self.replicas = [r["address"] for r in replicas]
        self.pids = [r["pid"] for r in replicas]

    def post(self, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60)

    def unload_once_idle(self, name: str) -> None:
        """Unload `name`, once the requests just closed under it have ended (409 until then)."""
        _eventually(lambda: self.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200, timeout=30)

    def adapters_of(self, replica: int) -> dict[str, str]:
        """What replica `replica` itself says it holds (ListLoRA, straight to it, with the key)."""
        with grpc.insecure_channel(self.replicas[replica]) as channel:
            return dict(pb_grpc.FastGenStub(channel).ListLoRA(pb.ListLoRARequest(), timeout=10,
                                                              metadata=auth_metadata(KEY)).adapters)

    def front_end(self, method: str, request: Any) -> Any:
        """`method(request)` of the front end's typed gRPC service, with the key."""
        with grpc.insecure_channel(self.grpc_address) as channel:
            return getattr(pb_grpc.FastGenStub(channel), method)(request, timeout=60, metadata=auth_metadata(KEY))

    def requests_per_replica(self) -> list[int]:
        return [r["num_requests"] for r in self.client.model_info()["replicas"]]

    def healthy(self) -> list[bool]:
        return [r["healthy"] for r in self.client.model_info()["replicas"]]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("lora_replicas"), "llama")


@pytest.fixture(scope="module")
def deployment(family, tmp_path_factory):
    port, rest_port = _free_port(), _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", API_KEY_ENV: KEY,
           registry.ENV_DIR: str(tmp_path_factory.mktemp("deployments"))}
    argv = [sys.executable, os.path.join(REPO, "scripts", "serve.py"), "--model", family.path, "--port", str(port),
            "--replica-num", "2", "--enable-restful-api", "--restful-api-port", str(rest_port),
            "--deployment-name", f"lora-replicas-{os.getpid()}", "--no-progress", "--num-kv-blocks", "128",
            "--block-size", "4", "--token-budget", "16", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--drain-timeout", "0", "--lora-modules", f"a={family.adapters['a']}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        _eventually(lambda: f"listening on 127.0.0.1:{port}\n" in lines or proc.poll() is not None, timeout=180)
        assert proc.poll() is None, "".join(lines)
        served = Deployment(f"http://127.0.0.1:{rest_port}", f"127.0.0.1:{port}")
        yield served
        served.client.close()
    finally:
        _kill_group(proc.pid)
        proc.wait()


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=deployment.url + "/v1", api_key=KEY, max_retries=0)


def _tokens(client, model: str, prompt: list[int], stream: bool = False) -> list[int]:
    return openai_token_ids(client, model, prompt, NUM_NEW, stream)


def _longest(client, prompt: list[int]) -> int:
    """max_tokens that keeps a request under way as long as the context allows."""
    return client.models.list().data[0].max_model_len - len(prompt) - 1  # the base model's card comes first


def test_adapter_through_the_router_on_both_replicas(family, deployment, client):
    before = deployment.requests_per_replica()
    for i in (0, 2):  # one after the other: ties go to the replicas in turn
        assert _tokens(client, "a", family.prompts[i]) == family.want["a"][i]
        assert _tokens(client, "a", family.prompts[i], stream=True) == family.want["a"][i]
    assert all(after - was >= 2 for after, was in zip(deployment.requests_per_replica(), before))
    assert client.completions.create(model="a", prompt=family.prompts[0], max_tokens=2).model == "a"
    assert client.models.retrieve("a").parent == family.path
    assert deployment.client.generate([family.prompts[1]], lora="a", max_new_tokens=NUM_NEW, do_sample=False,
                                      ignore_eos=True)[0].token_ids == family.want["a"][1]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(UnknownLoRAError, match="nope"):
        deployment.client.generate(["x"], lora="nope", max_new_tokens=2)


def test_load_and_unload_reach_every_replica(family, deployment, client):
    assert deployment.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": family.adapters["b"]},
                           key=None).status_code == 401
    loaded = deployment.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": family.adapters["b"]})
    assert loaded.status_code == 200, loaded.text
    assert [deployment.adapters_of(i).get("b") for i in (0, 1)] == [family.adapters["b"]] * 2
    assert {m.id: m for m in client.models.list().data}["b"].parent == family.path
    before = deployment.requests_per_replica()
    for _ in range(2):
        assert _tokens(client, "b", family.prompts[3]) == family.want["b"][3]
    assert all(after > was for after, was in zip(deployment.requests_per_replica(), before))
    again = deployment.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": family.adapters["b"]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert deployment.post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    assert ["b" in deployment.adapters_of(i) for i in (0, 1)] == [False, False]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt="x", max_tokens=2)
    assert deployment.post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
    # The same through the front end's gRPC service.
    deployment.front_end("LoadLoRA", pb.LoadLoRARequest(name="b2", path=family.adapters["b"]))
    listing = deployment.front_end("ListLoRA", pb.ListLoRARequest())
    assert dict(listing.adapters) == {"a": family.adapters["a"], "b2": family.adapters["b"]} and listing.max_loras == 2
    assert ["b2" in deployment.adapters_of(i) for i in (0, 1)] == [True, True]
    deployment.front_end("UnloadLoRA", pb.UnloadLoRARequest(name="b2"))
    assert ["b2" in deployment.adapters_of(i) for i in (0, 1)] == [False, False]
    with pytest.raises(grpc.RpcError) as missing:
        deployment.front_end("UnloadLoRA", pb.UnloadLoRARequest(name="b2"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_failed_load_leaves_nothing_anywhere(family, deployment, tmp_path):
    bad = deployment.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "none")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
    # Replica 1 alone holds "x" already: replica 0 loads it first, then the router takes it back.
    with grpc.insecure_channel(deployment.replicas[1]) as channel:
        stub = pb_grpc.FastGenStub(channel)
        with pytest.raises(grpc.RpcError) as refused:  # the new RPCs want the key like every other
            stub.LoadLoRA(pb.LoadLoRARequest(name="x", path=family.adapters["b"]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.LoadLoRA(pb.LoadLoRARequest(name="x", path=family.adapters["b"]), timeout=60,
                      metadata=auth_metadata(KEY))
        split = deployment.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": family.adapters["b"]})
        assert split.status_code == 400 and "already loaded" in split.json()["error"]["message"], split.text
        assert [sorted(deployment.adapters_of(i)) for i in (0, 1)] == [["a"], ["a", "x"]]
        stub.UnloadLoRA(pb.UnloadLoRARequest(name="x"), timeout=10, metadata=auth_metadata(KEY))
    assert "bad" not in {m["id"] for m in httpx.get(deployment.url + "/v1/models", headers={
        "authorization": f"Bearer {KEY}"}).json()["data"]}


def test_unloading_an_adapter_in_use_is_409(family, deployment, client):
    assert deployment.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": family.adapters["b"]}).is_success
    stream = client.completions.create(model="c", prompt=family.prompts[0], stream=True,
                                       max_tokens=_longest(client, family.prompts[0]), extra_body={"ignore_eos": True})
    assert next(iter(stream)).model == "c"  # under way on one replica
    busy = deployment.post("/v1/unload_lora_adapter", {"lora_name": "c"})
    assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"], busy.text
    assert ["c" in deployment.adapters_of(i) for i in (0, 1)] == [True, True]  # neither replica unloaded it
    stream.close()
    deployment.unload_once_idle("c")
    assert ["c" in deployment.adapters_of(i) for i in (0, 1)] == [False, False]


def test_metrics_gauge_covers_both_replicas(family, deployment, client):
    """The router's /metrics carries vllm:lora_requests_info from its replicas: an adapter under way on
    either shows as running (which replicas' sets are joined: `test_usage_joins_every_live_replica`)."""
    assert deployment.post("/v1/load_lora_adapter", {"lora_name": "g", "lora_path": family.adapters["b"]}).is_success
    # One request under each adapter: the least-loaded replica takes the second, so each runs one.
    streams = [client.completions.create(model=model, prompt=family.prompts[0], stream=True, extra_body={
        "ignore_eos": True}, max_tokens=_longest(client, family.prompts[0])) for model in ("a", "g")]
    seen: list[str] = []

    def one_running() -> bool:
        text = httpx.get(deployment.url + "/metrics", timeout=10).text
        seen.extend(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))
        return any(f'running_lora_adapters="{names}"' in seen[-1] for names in ("a", "g", "a,g"))

    try:
        for stream in streams:
            next(iter(stream))  # under way
        deadline = time.monotonic() + 10
        while not one_running():
            assert time.monotonic() < deadline, (len(seen), seen[-3:], deployment.client.model_info()["replicas"])
    finally:
        for stream in streams:
            stream.close()
    assert all('max_lora="2"' in line for line in seen)
    deployment.unload_once_idle("g")


def test_usage_joins_every_live_replica():
    """Running and waiting adapters are the union over the replicas that answer; a dead replica is not asked and
    one that fails to answer is left out (its health check reports it), never failing the scrape."""
    from types import SimpleNamespace

    from fastgen.serving.deploy.replica_lora import ReplicaAdapters

    answers = {0: (["a"], ["x"]), 1: (["g"], []), 3: None}

    class Router:
        replicas = [SimpleNamespace(index=i, status="DEAD: gone" if i == 2 else "SERVING") for i in range(4)]

        def call(self, replica, method, request, timeout):
            assert method == "ListLoRA" and replica.index != 2, "a dead replica was asked"
            if answers.get(replica.index) is None:
                raise RuntimeError("no answer")
            running, waiting = answers[replica.index]
            return pb.ListLoRAResponse(adapters={"a": "/a", "g": "/g"}, max_loras=2, running=running,
                                       waiting=waiting)

    usage = ReplicaAdapters(Router()).usage()
    assert usage == {"lora_running": ["a", "g"], "lora_waiting": ["x"], "lora_max_loras": 2}


def test_a_replica_back_in_rotation_gets_the_adapters_loaded_meanwhile(family, deployment, client):
    os.kill(deployment.pids[1], signal.SIGSTOP)  # unreachable for a while, not dead
    try:
        _eventually(lambda: deployment.healthy() == [True, False], timeout=30)
        loaded = deployment.post("/v1/load_lora_adapter", {"lora_name": "h", "lora_path": family.adapters["b"]})
        assert loaded.status_code == 200, loaded.text
        assert "h" in deployment.adapters_of(0)
    finally:
        os.kill(deployment.pids[1], signal.SIGCONT)
    _eventually(lambda: deployment.healthy() == [True, True], timeout=30)
    assert deployment.adapters_of(1).get("h") == family.adapters["b"]
    before = deployment.requests_per_replica()
    for _ in range(2):
        assert _tokens(client, "h", family.prompts[1]) == family.want["b"][1]
    assert all(after > was for after, was in zip(deployment.requests_per_replica(), before))
    assert deployment.post("/v1/unload_lora_adapter", {"lora_name": "h"}).status_code == 200

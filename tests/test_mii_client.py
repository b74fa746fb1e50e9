"""DeepSpeed-MII 0.3.3's own client against a real `scripts/serve.py` (and `fastgen.serve`) process.

The test downloads MII's wheel (`pip download --no-deps deepspeed-mii==0.3.3`, cached under pytest's
cache) and runs MII's real `MIIClient`, its generated gRPC stubs, `kwarg_dict_to_proto` and
`Response` from it, unmodified. MII's package `__init__`s import DeepSpeed's engines, so they are
not run: `mii`, `mii.backend` and `mii.batching` are bare packages over the wheel's directories,
and only the modules the client needs are imported from them. Two stand-ins fill what those need
and cannot have here: `mii.config` (pydantic models over DeepSpeed's; the client only names
`MIIConfig` in an annotation and `data_classes` `GenerateParamsConfig` in one) and `deepspeed`
(which `mii.utils` imports for a function the client never calls). MII's client reads four
attributes of its config, which a SimpleNamespace gives it.

Each deployment serves the bundled demo model on free 127.0.0.1 ports with its own registry
directory; each test checks the deployment exits with 0 after MII's `terminate_server`.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
import zipfile
from types import SimpleNamespace

import grpc
import pytest

import fastgen
from fastgen.serving.deploy import registry
from fastgen.serving.limits import API_KEY_ENV

MII_VERSION = "0.3.3"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_FLAGS = ["--no-progress", "--num-kv-blocks", "64", "--block-size", "8", "--token-budget", "32",
                "--max-seqs", "8"]
DEPLOYMENT = "demo_model-mii-deployment"  # MII's default name for the demo model
GREEDY = dict(max_new_tokens=6, do_sample=False, ignore_eos=True)
MII_MODULES = ("mii.constants", "mii.logging", "mii.score", "mii.utils", "mii.grpc_related.proto.modelresponse_pb2",
               "mii.grpc_related.proto.modelresponse_pb2_grpc", "mii.batching.data_classes",
               "mii.grpc_related.task_methods", "mii.backend.client")
"""The wheel's modules the client needs, in import order."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wheel_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """MII's wheel, unpacked (downloaded once into pytest's cache; skip if the registry is unreachable)."""
    cache = getattr(request.config, "cache", None)
    root = str(cache.mkdir(f"deepspeed-mii-{MII_VERSION}") if cache is not None
               else tmp_path_factory.mktemp("deepspeed-mii"))
    unpacked = os.path.join(root, "unpacked")
    if os.path.exists(os.path.join(unpacked, "mii", "backend", "client.py")):
        return unpacked
    wheels = [f for f in os.listdir(root) if f.endswith(".whl")]
    if not wheels:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-input",
             "--disable-pip-version-check", "--retries", "1", "--timeout", "30", f"deepspeed-mii=={MII_VERSION}",
             "-d", root], capture_output=True, text=True, timeout=300)
        wheels = [f for f in os.listdir(root) if f.endswith(".whl")]
        if done.returncode != 0 or not wheels:
            pytest.skip(f"cannot download deepspeed-mii=={MII_VERSION} from the package registry, so MII's own "
                        f"client cannot be tested: {(done.stderr or done.stdout).strip()[-500:]}")
    with zipfile.ZipFile(os.path.join(root, wheels[0])) as wheel:
        wheel.extractall(unpacked, [n for n in wheel.namelist() if n.startswith("mii/")])
    return unpacked


@pytest.fixture(scope="module")
def mii(request, tmp_path_factory) -> SimpleNamespace:
    """MII's real client modules, imported from the wheel into a bare `mii` namespace (removed afterwards)."""
    root = os.path.join(_wheel_dir(request, tmp_path_factory), "mii")
    if any(name == "mii" or name.startswith("mii.") for name in sys.modules):
        pytest.fail("a module named mii is already imported; this test needs the name for MII's wheel")
    added = []

    def add(name: str, module: types.ModuleType) -> None:
        sys.modules[name] = module
        added.append(name)

    for name, path in (("mii", root), ("mii.backend", os.path.join(root, "backend")),
                       ("mii.batching", os.path.join(root, "batching"))):
        package = types.ModuleType(name)
        package.__path__ = [path]
        add(name, package)
    config = types.ModuleType("mii.config")
    config.MIIConfig = type("MIIConfig", (), {"__doc__": "stand-in: the client reads 4 attributes of its config"})
    config.GenerateParamsConfig = type("GenerateParamsConfig", (), {"__doc__": "stand-in: an annotation only"})
    add("mii.config", config)
    if importlib.util.find_spec("deepspeed") is None:
        add("deepspeed", types.ModuleType("deepspeed"))
    try:
        loaded = {name: importlib.import_module(name) for name in MII_MODULES}
        yield SimpleNamespace(client=loaded["mii.backend.client"], data_classes=loaded["mii.batching.data_classes"],
                              constants=loaded["mii.constants"], utils=loaded["mii.utils"],
                              pb2=loaded["mii.grpc_related.proto.modelresponse_pb2"])
    finally:
        for name in [n for n in sys.modules if n == "mii" or n.startswith("mii.")] + added:
            sys.modules.pop(name, None)


@pytest.fixture
def event_loop_for_mii():
    """MII's client takes `asyncio.get_event_loop()` when built: give it a fresh loop, closed afterwards."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


@pytest.fixture(autouse=True)
def registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_DIR, str(tmp_path / "deployments"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(API_KEY_ENV, raising=False)


class _ServeScript:
    """`python scripts/serve.py` (the demo model) with its output collected."""

    def __init__(self, *flags: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "scripts", "serve.py"), "--port", str(self.port), *ENGINE_FLAGS,
             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 120
        while f"listening on 127.0.0.1:{self.port}\n" not in self.lines:
            assert self.proc.poll() is None, "serve.py exited before serving:\n" + "".join(self.lines)
            assert time.monotonic() < deadline, "serve.py did not start within 120 s:\n" + "".join(self.lines)
            time.sleep(0.05)

    def wait(self, timeout: float = 30) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def _mii_config(mii, port: int, rest_port: int | None) -> SimpleNamespace:
    """What MIIClient reads of its MIIConfig: the task, the gRPC port and the REST gateway's."""
    task = mii.constants.TaskType.TEXT_GENERATION
    return SimpleNamespace(model_conf=SimpleNamespace(task=task), port_number=port,
                           enable_restful_api=rest_port is not None, restful_api_port=rest_port or 51080)


def _post_mii(rest_port: int, body: dict) -> list[dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{rest_port}/mii/{DEPLOYMENT}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def _check_generation(mii, client, want) -> None:
    """MII's generate, __call__, streaming_fn and `stream=True` on the unary call, against fastgen's answers."""
    prompts = ["Hello", "DeepSpeed is"]
    got = client.generate(prompts, **GREEDY)
    assert all(isinstance(r, mii.data_classes.Response) for r in got)
    assert [(r.generated_text, r.prompt_length, r.generated_length, r.finish_reason) for r in got] == \
        [(w.generated_text, w.prompt_length, 6, "length") for w in want]
    assert repr(got) == repr(want)  # MII's Response and ours both print as their texts
    assert [r.generated_text for r in client(prompts, **GREEDY)] == [w.generated_text for w in want]
    # MII's server chose per-token replies by `stream`; the unary call answers in full here.
    assert [r.generated_text for r in client.generate(prompts, stream=True, **GREEDY)] == \
        [w.generated_text for w in want]

    chunks = []
    assert client.generate("Hello", streaming_fn=chunks.append, **GREEDY) is None  # MII's returns nothing
    assert all(len(c) == 1 and isinstance(c[0], mii.data_classes.Response) for c in chunks)
    assert "".join(c[0].generated_text for c in chunks) == want[0].generated_text
    assert [c[0].finish_reason for c in chunks] == ["none"] * (len(chunks) - 1) + ["length"]
    assert chunks[-1][0].generated_length == 6 and len(chunks) > 1

    # Every kind of value MII's kwarg_dict_to_proto sends (int, bool, float as float32, str).
    sampled = dict(max_new_tokens=5, do_sample=True, temperature=0.7, top_p=0.9, seed=3, stop="zzz")
    with fastgen.client(DEPLOYMENT) as typed:
        assert [r.generated_text for r in client.generate(prompts, **sampled)] == \
            [r.generated_text for r in typed.generate(prompts, **sampled)]

    with pytest.raises(grpc.aio.AioRpcError) as err:
        client.generate("Hello", bogus=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'bogus'" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        client.generate("Hello", stream="yes")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream" in err.value.details()


@pytest.mark.parametrize("rest", [False, True], ids=["rest-off", "rest-on"])
def test_mii_client_against_serve_script(mii, event_loop_for_mii, rest):
    rest_port = _free_port() if rest else None
    server = _ServeScript(*(["--enable-restful-api", "--restful-api-port", str(rest_port)] if rest else []))
    try:
        with fastgen.client(DEPLOYMENT) as typed:
            want = typed.generate(["Hello", "DeepSpeed is"], **GREEDY)
        client = mii.client.MIIClient(_mii_config(mii, server.port, rest_port))
        _check_generation(mii, client, want)
        if rest:
            # MII's gateway passed the body to its client's generate(**body): `stream` included.
            for body in ({"prompts": ["Hello", "DeepSpeed is"], **GREEDY},
                         {"prompts": ["Hello", "DeepSpeed is"], "stream": True, **GREEDY}):
                assert _post_mii(rest_port, body) == [w.to_msg_dict() for w in want]
            with pytest.raises(urllib.error.HTTPError) as refused:
                _post_mii(rest_port, {"prompts": "Hello", "stream": "yes"})
            assert refused.value.code == 400 and "stream" in refused.value.read().decode()
        # With REST on, MII's terminate_server also GETs the gateway's /terminate after Terminate.
        client.terminate_server()
        assert server.wait() == 0, "".join(server.lines)
        assert registry.live_record(DEPLOYMENT) is None
    finally:
        server.kill()


def test_mii_client_against_fastgen_serve_with_mii_configs(mii, event_loop_for_mii, recwarn):
    """`fastgen.serve` configured the MII way (mii_config / model_config dicts, DeepSpeed's engine
    config), then driven and stopped by MII's client, REST on."""
    port, rest_port = _free_port(), _free_port()
    mii_config = {"deployment_name": "mii-configured", "port_number": port, "enable_restful_api": True,
                  "restful_api_port": rest_port, "restful_api_host": "127.0.0.1", "deployment_type": "local",
                  "model_config": {"tensor_parallel": 1, "replica_num": 1, "max_length": 256, "task": "text-generation",
                                   "inference_engine_config": {"state_manager": {
                                       "max_ragged_batch_size": 32, "max_ragged_sequence_count": 8,
                                       "memory_config": {"mode": "allocate", "size": 64}}}}}
    client = fastgen.serve(mii_config=mii_config, block_size=8, progress=False, startup_timeout=120)
    try:
        info = client.model_info()
        assert (info["deployment_name"], info["max_length"], info["num_kv_blocks"]) == ("mii-configured", 256, 64)
        assert (info["token_budget"], info["max_seqs"]) == (32, 8)
        assert not [w for w in recwarn if issubclass(w.category, fastgen.MIICompatibilityWarning)]
        want = client.generate(["Hello", "DeepSpeed is"], **GREEDY)
        mii_client = mii.client.MIIClient(_mii_config(mii, port, rest_port))
        assert [r.generated_text for r in mii_client.generate(["Hello", "DeepSpeed is"], **GREEDY)] == \
            [w.generated_text for w in want]
        mii_client.terminate_server()
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{client.pid}"):  # stopped, and reaped by fastgen.serve's reaper
            assert time.monotonic() < deadline, "the deployment did not stop after MII's terminate_server"
            time.sleep(0.05)
        assert registry.live_record("mii-configured") is None
    finally:
        try:
            os.killpg(client.pid, 9)
        except ProcessLookupError:
            pass


def test_client_resolves_mii_names(mii, event_loop_for_mii):
    """`fastgen.client` finds a deployment as `mii.client` does: by its name, or by the model name or
    path it serves (`<basename>-mii-deployment`); or by host:port."""
    server = _ServeScript()
    try:
        for target in (DEPLOYMENT, fastgen.DEMO_MODEL_DIR, fastgen.DEMO_MODEL_DIR + "/", "demo_model",
                       "org/demo_model", f"127.0.0.1:{server.port}"):
            with fastgen.client(target) as c:
                assert c.health() == "SERVING", target
                assert c.deployment_name == (None if ":" in target else DEPLOYMENT), target
        with pytest.raises(ValueError, match="no running deployment named 'other' or 'other-mii-deployment'.*"
                                             f"running: {DEPLOYMENT}"):
            fastgen.client("other")
        with pytest.raises(ValueError, match="no running deployment named 'other-mii-deployment'"):
            fastgen.client("/models/other")
        mii.client.MIIClient(_mii_config(mii, server.port, None)).terminate_server()
        assert server.wait() == 0, "".join(server.lines)
    finally:
        server.kill()

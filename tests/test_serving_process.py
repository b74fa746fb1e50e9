"""Deployments as real processes: `fastgen.serve`/`fastgen.client`, replicas, and `scripts/serve.py`.

Each test starts its own deployment on a free 127.0.0.1 port with its own registry directory,
and kills whatever is left of it (the deployment's whole process group) in teardown; every test
checks that no process of the deployment is left, not even a zombie: each is reaped by its parent.
"""

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import httpx
import pytest
from test_grpc_auth import _self_signed

import fastgen
from fastgen.serving.deploy import launcher, registry
from fastgen.serving.client import client as connect
from fastgen.serving.deploy.deployment import SERVE_OPTIONS, DeploymentError
from fastgen.serving.limits import API_KEY_ENV
from fastgen.serving.deploy.processes import pid_alive
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc

ENGINE = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_DIR, str(tmp_path / "deployments"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _eventually(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _reaped(pid) -> bool:
    """Gone from the process table: neither running nor a zombie waiting for its parent."""
    return not os.path.exists(f"/proc/{pid}")


def _kill_group(pid):
    """Teardown: SIGKILL the deployment's process group (it is its own session) if anything is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_serve_client_terminate_and_start_errors(tiny_checkpoints, tmp_path, monkeypatch):
    """serve() with a key; other clients with and without it; start errors; Terminate from another
    client, after which this process (the deployment's parent) has reaped it: no zombie."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    path = tiny_checkpoints["llama"]
    port = _free_port()
    client = fastgen.serve(path, deployment_name="tiny-a", port_number=port, api_key="proc-key",
                           startup_timeout=120, **ENGINE)
    pid = client.pid
    try:
        want = client.generate(["Hello", [5, 6, 7]], do_sample=False, max_new_tokens=5)
        assert [r.generated_length for r in want] == [5, 5] and want[0].token_ids != want[1].token_ids
        for other in (connect("tiny-a", api_key="proc-key"), connect(f"127.0.0.1:{port}", api_key="proc-key")):
            assert [r.token_ids for r in other(["Hello", [5, 6, 7]], do_sample=False, max_new_tokens=5)] == \
                [r.token_ids for r in want]
            other.close()
        with connect("tiny-a") as keyless, pytest.raises(PermissionError, match="requires an API key"):
            keyless.generate("Hello", max_new_tokens=1)
        record = registry.live_record("tiny-a")
        assert record["pid"] == pid and record["host"] == "127.0.0.1"  # serve()'s default: this machine only
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"proc-key" not in f.read()  # the key travels in the environment, not on the command line

        with pytest.raises(DeploymentError, match=f"port {port} on 127.0.0.1 is already in use"):
            fastgen.serve(path, deployment_name="tiny-b", host="127.0.0.1", port_number=port, **ENGINE)
        with pytest.raises(DeploymentError, match="'tiny-a' is already running"):
            fastgen.serve(path, deployment_name="tiny-a", host="127.0.0.1", port_number=_free_port(), **ENGINE)
        with pytest.raises(TypeError, match="unknown serve option.*'bogus'"):
            fastgen.serve(path, bogus=1)
        with pytest.raises(ValueError, match="tensor_parallel must be in"):
            fastgen.serve(path, tensor_parallel=0)
        with pytest.raises(ValueError, match="device_map must be 'auto'"):
            fastgen.serve(path, device_map="balanced")
        with pytest.raises(ValueError, match=r"mii_config\['deployment_type'\]='aml'"):
            fastgen.serve(path, mii_config={"deployment_type": "aml"})
        with pytest.raises(ValueError, match="port_number: .*contradicts"):
            fastgen.serve(path, port_number=port, mii_config={"port_number": port + 1})
        with pytest.raises(TypeError, match="all_rank_output is a pipeline"):
            fastgen.serve(path, all_rank_output=False)
        with pytest.raises(ValueError, match="max_length"):
            fastgen.serve(path, max_length=0)
        with pytest.raises(ValueError, match="max_n must be a positive int"):
            fastgen.serve(path, max_n=0)
        with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
            fastgen.serve(path, tls_cert=__file__)

        monkeypatch.setenv(API_KEY_ENV, "proc-key")  # fastgen.client() reads the key from the environment
        second = fastgen.client("tiny-a")
        assert second.generate("Hello", do_sample=False, max_new_tokens=5)[0].token_ids == want[0].token_ids
        second.terminate_server(timeout=30)
        _eventually(lambda: _reaped(pid), timeout=5)
        client.terminate_server(timeout=5)  # already stopped by the other client: nothing left to do
        assert registry.live_record("tiny-a") is None
        with pytest.raises(ValueError, match="no running deployment named 'tiny-a'"):
            fastgen.client("tiny-a")
    finally:
        _kill_group(pid)

    # A model that fails to load: the error names the cause from the deployment's own log.
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(DeploymentError, match="exited with code 1 before serving") as err:
        fastgen.serve(missing, deployment_name="broken", host="127.0.0.1", port_number=_free_port(), **ENGINE)
    assert "no-such-model" in str(err.value) and "Traceback" in str(err.value)


def _rest_mii(port, prompt, cert, key="rkey", **gen):
    """MII's REST route over HTTPS, verifying the deployment's self-signed certificate."""
    body = json.dumps({"prompts": [prompt], **gen}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"https://127.0.0.1:{port}/mii/llama-mii-deployment", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=30, context=ssl.create_default_context(cafile=cert)) as reply:
        return json.loads(reply.read())[0]


def test_serve_script_replicas_rest_and_sigterm(tiny_checkpoints, tmp_path, monkeypatch):
    """`scripts/serve.py --replica-num 2 --enable-restful-api --api-key K --tls-cert C --tls-key P`: both
    replicas used (the router presents the key, which the replicas require too), one killed and
    routed around (over gRPC and HTTPS), then SIGTERM stops and reaps the front end and the survivor."""
    cert, tls_key = _self_signed(tmp_path)
    port, rest_port = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "scripts", "serve.py"), "--model", tiny_checkpoints["llama"],
         "--port", str(port), "--replica-num", "2", "--enable-restful-api", "--api-key", "rkey",
         "--tls-cert", cert, "--tls-key", tls_key,
         "--restful-api-port", str(rest_port), "--no-progress", "--num-kv-blocks", "64", "--block-size", "8",
         "--token-budget", "32", "--max-seqs", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={k: v for k, v in os.environ.items() if k != API_KEY_ENV})  # the key comes from --api-key alone
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        _eventually(lambda: f"listening on 127.0.0.1:{port}\n" in lines or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, "".join(lines)
        monkeypatch.setenv(API_KEY_ENV, "rkey")
        client = fastgen.client("llama-mii-deployment")  # the default name; TLS with the recorded certificate
        want = client.generate("Hi", do_sample=False, max_new_tokens=4)[0]
        for _ in range(3):
            assert client.generate("Hi", do_sample=False, max_new_tokens=4)[0].token_ids == want.token_ids
        info = client.model_info()
        assert info["num_kv_blocks"] == 64 and [r["num_requests"] for r in info["replicas"]] == [2, 2]
        assert [client.health(f"fastgen.replica.{i}") for i in range(2)] == ["SERVING", "SERVING"]
        assert _rest_mii(rest_port, "Hi", cert, do_sample=False, max_new_tokens=4)["generated_text"] == \
            want.generated_text
        with pytest.raises(urllib.error.HTTPError) as refused:
            _rest_mii(rest_port, "Hi", cert, key=None)
        assert refused.value.code == 401
        with grpc.insecure_channel(info["replicas"][1]["address"]) as channel, pytest.raises(grpc.RpcError) as err:
            pb_grpc.FastGenStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # a replica is keyed like its front end
        pids = [r["pid"] for r in info["replicas"]]

        os.kill(pids[0], signal.SIGKILL)
        _eventually(lambda: client.health("fastgen.replica.0") == "NOT_SERVING")
        assert client.health() == "SERVING"
        for _ in range(2):
            assert client.generate("Hi", do_sample=False, max_new_tokens=4)[0].token_ids == want.token_ids
            assert _rest_mii(rest_port, "Hi", cert, do_sample=False, max_new_tokens=4)["generated_text"] == \
                want.generated_text
        # The router may first see the dead replica as UNREACHABLE (a failed call); its monitor then names the death.
        _eventually(lambda: client.model_info()["replicas"][0]["status"] == "DEAD: exited with code -9")
        assert client.model_info()["replicas"][1]["healthy"]
        assert _reaped(pids[0])  # the front end's health check reaped the killed replica
        client.close()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        reader.join(5)
        assert _reaped(pids[1]) and registry.live_record("llama-mii-deployment") is None
        assert any("replica 0" in line and "DEAD" in line for line in lines)
    finally:
        _kill_group(proc.pid)
        proc.wait()


def test_replica_exits_when_its_front_end_dies(tiny_checkpoints, tmp_path):
    """A replica whose front end is SIGKILLed (no cleanup at all) notices and exits by itself."""
    ready = str(tmp_path / "ready.json")
    argv = ["--model", tiny_checkpoints["llama"], "--host", "127.0.0.1", "--port", "0", "--no-progress",
            "--num-kv-blocks", "64", "--block-size", "8", "--token-budget", "32", "--max-seqs", "8"]
    front = subprocess.Popen(  # stands in for a front end: starts one replica, then waits to be killed
        [sys.executable, "-c", "import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-m', "
         "'fastgen.serving.deploy.launcher', *sys.argv[1:], '--replica-of', str(os.getpid())]); time.sleep(120)",
         *argv, "--ready-file", ready], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _eventually(lambda: os.path.exists(ready), timeout=120)
        replica = json.load(open(ready))["pid"]
        assert pid_alive(replica)
        front.kill()
        front.wait()
        _eventually(lambda: not pid_alive(replica))
    finally:
        _kill_group(front.pid)


def test_launcher_rejects_bad_options(capsys):
    for argv, message in ((["--tensor-parallel", "0"], "--tensor-parallel must be >= 1"),
                          (["--replica-num", "0"], "--replica-num must be >= 1"),
                          (["--max-length", "0"], "max_length must be a positive int or None, got 0"),
                          (["--deployment-name", "../x"], "deployment_name must be"),
                          (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
                          (["--tls-cert", "/no/cert.pem", "--tls-key", "/no/key.pem"], "--tls-cert: no such file"),
                          (["--max-n", "0"], "--max-n must be a positive int, got 0"),
                          (["--max-pending-requests", "-1"], "--max-pending-requests must be a positive int"),
                          (["--max-body-bytes", "0"], "--max-body-bytes must be a positive int"),
                          (["--api-key", ""], "--api-key / $FASTGEN_API_KEY: an API key must be a non-empty")):
        with pytest.raises(SystemExit) as exit_info:
            launcher.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    parser = launcher.build_parser()
    assert parser.parse_args([]).host == "127.0.0.1" == SERVE_OPTIONS["host"]
    assert parser.parse_args(["--api-key", "a", "--api-key", "b"]).api_key == ["a", "b"]
    help_text = " ".join(parser.format_help().split())
    for promise in ("--host 0.0.0.0 exposes the server", "every method is open", "Terminate included",
                    "grpc.health.v1.Health", "stay open"):
        assert promise in help_text, promise
    options = {"dtype": "bfloat16", "enable_prefix_caching": False, "cuda_graphs": False, "buckets": (1, 4),
               "kv_cache_memory": 0.5, "num_kv_blocks": 64, "seed": None}
    argv = launcher.engine_argv(options)
    assert argv == ["--dtype", "bfloat16", "--no-prefix-caching", "--no-cuda-graphs", "--buckets", "1,4",
                    "--kv-cache-memory", "0.5", "--num-kv-blocks", "64"]
    args = vars(launcher.build_parser().parse_args(argv))
    assert {name: args[name] for name in options} == options
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    args = vars(launcher.build_parser().parse_args(launcher.engine_argv({"speculative_config": spec})))
    assert args["speculative_config"].to_dict() == spec


def test_serve_and_planning_flags_take_the_same_spelling():
    """Every plan field reads its value with the field's own parser in both command lines, so what
    `python -m fastgen.planning` takes, `scripts/serve.py` takes too, to the same value."""
    from fastgen.planning.cli import build_parser as planning_parser

    spellings = [["--buckets", "1,8,64"], ["--cuda-graphs", "no"], ["--cuda-graphs"], ["--weight-prepack", "true"],
                 ["--kv-cache-memory", "0.5"], ["--kv-cache-memory", "1000000"], ["--token-budget", "256"],
                 ["--compile", "off"], ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']]
    for argv in spellings:
        name = argv[0][2:].replace("-", "_")
        served = getattr(launcher.build_parser().parse_args(argv), name)
        planned = getattr(planning_parser().parse_args(["MODEL", *argv]), name)
        assert served == planned and served is not None, argv
    assert launcher.build_parser().parse_args(["--no-cuda-graphs"]).cuda_graphs is False
    for parser, prefix in ((launcher.build_parser(), []), (planning_parser(), ["MODEL"])):
        with pytest.raises(SystemExit):
            parser.parse_args([*prefix, "--buckets", "1", "8"])  # one spelling: comma-separated


def test_max_pending_requests_bounds_grpc_and_rest_together(tiny_checkpoints, monkeypatch):
    """`max_pending_requests=2` is the deployment's bound, both protocols together: one gRPC and one
    REST stream in flight fill it, and the next call of either protocol is refused (gRPC
    RESOURCE_EXHAUSTED, HTTP 429) until a stream ends."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    port, rest_port = _free_port(), _free_port()
    # Room for both long streams in the KV cache: they stay in flight for hundreds of steps.
    client = fastgen.serve(tiny_checkpoints["llama"], deployment_name="tiny-pending", port_number=port,
                           enable_restful_api=True, restful_api_port=rest_port, max_pending_requests=2,
                           startup_timeout=120, **{**ENGINE, "num_kv_blocks": 160})
    pid = client.pid
    long = dict(max_new_tokens=480, ignore_eos=True, do_sample=False)
    url = f"http://127.0.0.1:{rest_port}"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, httpx.Client(base_url=url, timeout=60) as http:
            stub = pb_grpc.FastGenStub(channel)
            model = http.get("/v1/models").json()["data"][0]["id"]
            busy_grpc = stub.GenerateStream(pb.GenerateRequest(prompts=[pb.Prompt(text="busy")],
                                                               params=pb.SamplingParams(**long)))
            grpc_deltas = iter(busy_grpc)
            next(grpc_deltas)  # admitted and generating: 1 of 2
            body = {"model": model, "prompt": "busy", "max_tokens": 480, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as busy_rest:
                assert busy_rest.status_code == 200
                lines = busy_rest.iter_lines()  # kept referenced: dropping it closes the connection
                next(line for line in lines if line.startswith("data: "))  # 2 of 2
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Generate(pb.GenerateRequest(prompts=[pb.Prompt(text="one more")],
                                                     params=pb.SamplingParams(max_new_tokens=2)), timeout=30)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "limit of 2 pending sequences (2 in flight)" in refused.value.details()
                resp = http.post("/v1/completions", json={"model": model, "prompt": "one more", "max_tokens": 2})
                assert resp.status_code == 429 and resp.json()["error"]["code"] == "too_many_pending_requests"
                assert resp.headers["Retry-After"] == "1"
                mii = http.post("/mii/tiny-pending", json={"prompts": "one more", "max_new_tokens": 2})
                assert mii.status_code == 429
            busy_grpc.cancel()  # both streams gone: their places come back
            _eventually(lambda: http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2,
                                                                   "n": 2}).status_code == 200, timeout=30)
            reply = stub.Generate(pb.GenerateRequest(prompts=[pb.Prompt(text="a"), pb.Prompt(text="b")],
                                                     params=pb.SamplingParams(max_new_tokens=2)), timeout=30)
            assert [c.generated_length for c in reply.completions] == [2, 2]
        client.terminate_server(timeout=30)
        assert _reaped(pid)
    finally:
        _kill_group(pid)

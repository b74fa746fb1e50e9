"""Deployments as real processes: `fastgen.serve`/`fastgen.client`, replicas, and `scripts/serve.py`.

Each test starts its own deployment on a free 127.0.0.1 port with its own registry directory,
and kills whatever is left of it (the deployment's whole process group) in teardown; every test
checks that no process of the deployment is left.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

import fastgen
from fastgen.serving import launcher, registry
from fastgen.serving.deployment import DeploymentError
from fastgen.serving.processes import pid_alive

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


def _kill_group(pid):
    """Teardown: SIGKILL the deployment's process group (it is its own session) if anything is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_serve_client_terminate_and_start_errors(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    port = _free_port()
    client = fastgen.serve(path, deployment_name="tiny-a", host="127.0.0.1", port_number=port, startup_timeout=120,
                           **ENGINE)
    pid = client.pid
    try:
        want = client.generate(["Hello", [5, 6, 7]], do_sample=False, max_new_tokens=5)
        assert [r.generated_length for r in want] == [5, 5] and want[0].token_ids != want[1].token_ids
        for other in (fastgen.client("tiny-a"), fastgen.client(f"127.0.0.1:{port}")):
            assert [r.token_ids for r in other(["Hello", [5, 6, 7]], do_sample=False, max_new_tokens=5)] == \
                [r.token_ids for r in want]
            other.close()
        assert registry.live_record("tiny-a")["pid"] == pid

        with pytest.raises(DeploymentError, match=f"port {port} on 127.0.0.1 is already in use"):
            fastgen.serve(path, deployment_name="tiny-b", host="127.0.0.1", port_number=port, **ENGINE)
        with pytest.raises(DeploymentError, match="'tiny-a' is already running"):
            fastgen.serve(path, deployment_name="tiny-a", host="127.0.0.1", port_number=_free_port(), **ENGINE)
        with pytest.raises(TypeError, match="unknown serve option.*'bogus'"):
            fastgen.serve(path, bogus=1)
        with pytest.raises(ValueError, match="tensor_parallel must be in"):
            fastgen.serve(path, tensor_parallel=0)
        with pytest.raises(NotImplementedError, match="device_map"):
            fastgen.serve(path, device_map="balanced")
        with pytest.raises(ValueError, match="max_length"):
            fastgen.serve(path, max_length=0)

        client.terminate_server(timeout=30)
        assert not pid_alive(pid)
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


def _rest_mii(port, prompt, **gen):
    body = json.dumps({"prompts": [prompt], **gen}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/mii/llama-mii-deployment", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())[0]


def test_serve_script_replicas_rest_and_sigterm(tiny_checkpoints):
    """`scripts/serve.py --replica-num 2 --enable-restful-api`: both replicas used, one killed and routed
    around (over gRPC and REST), then SIGTERM stops the front end and the surviving replica."""
    port, rest_port = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "scripts", "serve.py"), "--model", tiny_checkpoints["llama"],
         "--host", "127.0.0.1", "--port", str(port), "--replica-num", "2", "--enable-restful-api",
         "--restful-api-port", str(rest_port), "--no-progress", "--num-kv-blocks", "64", "--block-size", "8",
         "--token-budget", "32", "--max-seqs", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        _eventually(lambda: f"listening on 127.0.0.1:{port}\n" in lines or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, "".join(lines)
        client = fastgen.client("llama-mii-deployment")  # the default name, from the registry
        want = client.generate("Hi", do_sample=False, max_new_tokens=4)[0]
        for _ in range(3):
            assert client.generate("Hi", do_sample=False, max_new_tokens=4)[0].token_ids == want.token_ids
        info = client.model_info()
        assert info["num_kv_blocks"] == 64 and [r["num_requests"] for r in info["replicas"]] == [2, 2]
        assert [client.health(f"fastgen.replica.{i}") for i in range(2)] == ["SERVING", "SERVING"]
        assert _rest_mii(rest_port, "Hi", do_sample=False, max_new_tokens=4)["generated_text"] == want.generated_text
        pids = [r["pid"] for r in info["replicas"]]

        os.kill(pids[0], signal.SIGKILL)
        _eventually(lambda: client.health("fastgen.replica.0") == "NOT_SERVING")
        assert client.health() == "SERVING"
        for _ in range(2):
            assert client.generate("Hi", do_sample=False, max_new_tokens=4)[0].token_ids == want.token_ids
            assert _rest_mii(rest_port, "Hi", do_sample=False, max_new_tokens=4)["generated_text"] == want.generated_text
        replicas = client.model_info()["replicas"]
        assert replicas[0]["status"] == "DEAD: exited with code -9" and replicas[1]["healthy"]
        client.close()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        reader.join(5)
        assert not pid_alive(pids[1]) and registry.live_record("llama-mii-deployment") is None
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
         "'fastgen.serving.launcher', *sys.argv[1:], '--replica-of', str(os.getpid())]); time.sleep(120)",
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
                          (["--deployment-name", "../x"], "deployment_name must be")):
        with pytest.raises(SystemExit) as exit_info:
            launcher.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    options = {"dtype": "bfloat16", "enable_prefix_caching": False, "cuda_graphs": False, "buckets": (1, 4),
               "kv_cache_memory": 0.5, "num_kv_blocks": 64, "seed": None}
    argv = launcher.engine_argv(options)
    assert argv == ["--dtype", "bfloat16", "--no-prefix-caching", "--no-cuda-graphs", "--buckets", "1", "4",
                    "--kv-cache-memory", "0.5", "--num-kv-blocks", "64"]
    args = vars(launcher.build_parser().parse_args(argv))
    assert {name: args[name] for name in options} == {**options, "buckets": [1, 4]}

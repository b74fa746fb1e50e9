"""fastgen on Ray Serve (`fastgen.serving.ray_app`): a local Ray cluster on loopback (`ray.init(num_cpus=2)`)
running 2 replicas of the bundled demo model, driven through Ray's HTTP proxy by the official openai
client. One cluster and one application serve the whole module (starting Ray costs tens of seconds);
the drain test runs last because it deletes the application. The cluster also declares 2 GPUs that do
not exist (Ray takes `num_gpus` on trust): the tensor-parallel placement test reads which of them Ray
assigned to each bundle; the replicas of the application reserve CPUs only.
"""

import json
import os
import socket
import threading
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="the ray extra (pip install 'fastgen[ray]') is not installed")
from ray import serve  # noqa: E402

import fastgen  # noqa: E402
from fastgen.serving.ray_app import REPLICA_HEADER, FastGenServer, build_app  # noqa: E402
from fastgen.serving.ray_placement import default_actor_resources, placement_group_gpu_ids  # noqa: E402

APP = "fastgen"
MODEL = "demo"
ENGINE = {"num_kv_blocks": "128", "block_size": "16", "token_budget": "64", "max_seqs": "16", "progress": "false"}
PROMPTS = ["DeepSpeed is", "Seattle is"]
ABORTED = 'fastgen_sequences_finished_total{finish_reason="abort"}'
KV_USAGE = f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}}'


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _eventually(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout} s"
        time.sleep(interval)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster on 127.0.0.1 and Serve's HTTP proxy on a free loopback port."""
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "FASTGEN_COMPILE": "off"}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def app(cluster):
    # Strings, as `serve run fastgen.serving.ray_app:build_app num_replicas=2 ...` passes them.
    options = {**ENGINE, "num_replicas": "2", "served_model_name": MODEL, "max_ongoing_requests": "32",
               "ray_actor_options": json.dumps({"num_cpus": 0.5}), "health_check_period_s": "1",
               "drain_timeout": "60"}
    serve.run(build_app(options), name=APP, route_prefix="/")
    return cluster


@pytest.fixture(scope="module")
def client(app):
    with openai.OpenAI(base_url=app + "/v1", api_key="none", max_retries=5, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """Greedy completions (Responses) of the demo model from a local pipeline with the same engine settings."""
    pipe = fastgen.pipeline(None, num_kv_blocks=128, block_size=16, token_budget=64, max_seqs=16, progress=False)
    try:
        yield dict(zip(PROMPTS, pipe(PROMPTS, do_sample=False, max_new_tokens=12)))
    finally:
        pipe.destroy()


def _replicas() -> list[str]:
    """The names of the application's live replica actors."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{APP}#FastGenDeployment#"))


def _running_replicas() -> int:
    status = serve.status().applications.get(APP)
    if status is None or status.status != "RUNNING":
        return 0
    return status.deployments["FastGenDeployment"].replica_states.get("RUNNING", 0)


def _engine_stats(base: str) -> dict[str, dict[str, float]]:
    """replica id -> its engine gauges, scraping /metrics through the proxy until both replicas answered."""
    seen: dict[str, dict[str, float]] = {}
    for _ in range(60):
        resp = httpx.get(base + "/metrics", timeout=10)
        values = {}
        for line in resp.text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        seen[resp.headers[REPLICA_HEADER]] = values
        if len(seen) == 2:
            break
    return seen


def test_openai_client_through_the_proxy(app, client, reference):
    """Non-streamed and streamed completions and chat through Ray's proxy equal the pipeline's greedy output."""
    assert [m.id for m in client.models.list().data] == [MODEL]
    for prompt in PROMPTS:
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert resp.choices[0].text == reference[prompt].generated_text
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert len(chunks) > 2  # server-sent events arrive one by one, not as one body
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[prompt].generated_text
        assert chunks[-1].usage.completion_tokens == reference[prompt].generated_length
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=8, temperature=0, stream=True))
    assert any(c.choices and c.choices[0].delta.content for c in chat)
    assert chat[-1].choices[0].finish_reason in ("stop", "length")
    # MII's REST route is on the same app.
    mii = httpx.post(app + "/mii/fastgen", json={"prompts": PROMPTS[:1], "max_new_tokens": 12, "do_sample": False},
                     timeout=60)
    assert mii.status_code == 200 and mii.json()[0]["generated_text"] == reference[PROMPTS[0]].generated_text


def test_both_replicas_serve(app, client):
    replicas = set()
    for _ in range(40):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1)
        replicas.add(raw.headers[REPLICA_HEADER])
        if len(replicas) == 2:
            break
    assert len(replicas) == 2


def test_a_client_disconnect_aborts_the_request(app):
    """A stream closed by its client after its first event is aborted in the engine: nothing is left running
    and every KV block is free again (`fastgen_kv_blocks_free`, `vllm:kv_cache_usage_perc`)."""
    aborted_before = sum(v.get(ABORTED, 0) for v in _engine_stats(app).values())
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", app + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())

    def idle() -> bool:
        stats = _engine_stats(app)
        aborted = sum(v.get(ABORTED, 0) for v in stats.values())
        return len(stats) == 2 and aborted == aborted_before + 1 and all(
            v["fastgen_engine_requests"] == 0 and v["fastgen_kv_blocks_free"] == v["fastgen_kv_blocks_total"]
            and v[KV_USAGE] == 0 for v in stats.values())

    # 60 s: under a full suite on 2 cores the abort has been seen to take ~30 s to show in both replicas.
    _eventually(idle, 60, "the disconnected request aborted, its KV blocks free and its replica idle")


def test_check_health_fails_once_the_engine_loop_stopped():
    """What Serve's health check calls: fine while the loop runs, an error naming why once it stopped."""
    from fastgen.serving.ray_app import ServerOptions

    server = FastGenServer(ServerOptions(engine={"num_kv_blocks": 16, "progress": False}))
    try:
        server.check_health()
        server.loop.shutdown()
        with pytest.raises(RuntimeError, match="engine loop has stopped"):
            server.check_health()
    finally:
        server.shutdown()


def test_a_killed_replica_is_routed_around_and_restored(app, client, reference):
    assert _running_replicas() == 2
    victim = _replicas()[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    # The client retries what reached the dying replica (max_retries); every request is answered.
    for i in range(6):
        prompt = PROMPTS[i % 2]
        assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0).choices[0].text == reference[prompt].generated_text
    _eventually(lambda: _running_replicas() == 2 and victim not in _replicas() and len(_replicas()) == 2, 180,
                "Serve restoring the killed replica", interval=1)
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                     temperature=0).choices[0].text == reference[PROMPTS[0]].generated_text


def test_drain_finishes_the_streams_in_flight_and_refuses_new_ones(app):
    """Serve stops the application during 8 streams: all 8 finish whole; new requests are refused.

    The refusal is Serve's, not a replica's, so it is 404 or 503 and never the replica's own 503 with
    `/health` failing (as `scripts/serve.py` drains). Ray Serve 2.60 tells a replica nothing when its
    graceful shutdown begins: the replica actor's `_perform_graceful_shutdown` sets a private
    `_shutting_down` flag (read only by the direct-ingress data-plane health check, off by default),
    waits for the ongoing requests, and only then calls the user callable's `__del__`; no public hook
    runs before the wait. Nor could a replica's 503 reach a client: from the moment the controller
    stops a replica, the proxy's router sends it nothing new, `/health` included. What a client gets
    comes from the proxy: 503 (`DeploymentUnavailableError`) while the deleted deployment is still
    routed with no replica to take the request, then 404 once the application's route is gone. The
    test asserts that no replica answered the refusal (no `x-fastgen-replica` header).
    """
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "stream": True, "ignore_eos": True}
    started = threading.Barrier(9)
    results: list = [None] * 8
    finished_at = [0.0] * 8

    def stream(i: int) -> None:
        tokens = 0
        try:
            with httpx.stream("POST", app + "/v1/completions", json=body, timeout=120) as resp:
                lines = resp.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        break
                started.wait(60)
                finish = None
                for line in lines:
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        finish = choice["finish_reason"] or finish
                        tokens += 1
                finished_at[i] = time.monotonic()
                results[i] = (resp.status_code, finish, tokens)
        except Exception as exc:  # recorded, so a failure names it instead of hanging the barrier
            results[i] = exc
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has its first token
    deleted_at = time.monotonic()
    serve.delete(APP, _blocking=False)

    def refused() -> bool:
        resp = httpx.post(app + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30)
        return resp.status_code in (404, 503) and REPLICA_HEADER not in resp.headers

    _eventually(refused, 60, "new requests refused while draining")
    for t in threads:
        t.join(180)
    assert [r[:2] if isinstance(r, tuple) else r for r in results] == [(200, "length")] * 8
    assert min(finished_at) > deleted_at  # all 8 were in flight when the drain began
    _eventually(lambda: not _replicas(), 60, "the drained replicas gone")


def test_build_app_checks_its_options_before_ray_starts_anything():
    with pytest.raises(TypeError, match="unknown option.*'bogus'"):
        build_app({"bogus": "1"})
    with pytest.raises(ValueError, match="num-kv-blocks"):
        build_app({"num_kv_blocks": "many"})
    with pytest.raises(ValueError, match="not both"):
        build_app({"num_replicas": 2, "autoscaling_config": {"min_replicas": 1}})
    with pytest.raises(ValueError, match="ray_actor_options must be a JSON object"):
        build_app({"ray_actor_options": "{num_cpus: 1"})
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        build_app({"enable_prefix_caching": "maybe"})
    with pytest.raises(ValueError, match="max_n must be >= 1"):
        build_app({"max_n": "0"})
    with pytest.raises(ValueError, match="max_length"):
        build_app({"max_length": 0})
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        build_app({"tool_call_parser": "xml"})
    with pytest.raises(ValueError, match="stream_interval_ms must be >= 0"):
        build_app({"stream_interval_ms": "-5"})


def test_build_app_options_reach_serve():
    """Strings parse as the launcher's flags do; Ray's options become the deployment's; TP gets one bundle per rank."""
    app = build_app({"num_kv_blocks": "64", "enable_prefix_caching": "false", "buckets": "1,2,4", "cuda_graphs": "no",
                     "autoscaling_config": '{"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}',
                     "max_ongoing_requests": "16", "drain_timeout": "5", "tensor_parallel": "2",
                     "ray_actor_options": {"num_cpus": 2}, "tool_call_parser": "hermes",
                     "reasoning_parser": "deepseek_r1", "stream_interval_ms": "20"})
    deployment = app._bound_deployment
    (options,) = deployment.init_args
    assert (options.tool_call_parser, options.reasoning_parser) == ("hermes", "deepseek_r1")
    assert options.stream_interval_ms == 20.0
    # Unless told, a replica batches a stream's writes to the proxy as Ray Serve LLM does (50 ms).
    (default,) = build_app({})._bound_deployment.init_args
    assert default.stream_interval_ms == 50.0
    assert options.engine == {"num_kv_blocks": 64, "enable_prefix_caching": False, "buckets": (1, 2, 4),
                              "cuda_graphs": False, "tensor_parallel": 2}
    config = deployment._deployment_config
    assert config.max_ongoing_requests == 16 and config.graceful_shutdown_timeout_s == 5
    assert config.autoscaling_config.max_replicas == 3 and config.autoscaling_config.target_ongoing_requests == 8
    assert deployment._replica_config.placement_group_bundles == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert deployment._replica_config.placement_group_strategy == "STRICT_PACK"


def test_placement_group_gpu_ids_never_asks_for_the_replicas_own_bundle():
    """Bundle 0's GPU is the replica actor's (a task asking Ray for it would wait forever); the others are
    read from their bundles, and the ids come out in rank order."""
    asked: list[list[tuple[int, float]]] = []

    def others(bundles: list[tuple[int, float]]) -> list[list[str]]:
        asked.append(bundles)
        return [[str(4 + index)] for index, _ in bundles]

    bundles = [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]
    assert placement_group_gpu_ids(bundles, ["2"], others) == ["2", "5", "6"]
    assert asked == [[(1, 1.0), (2, 1.0)]]
    # A CPU placement group: nothing to look up, CUDA_VISIBLE_DEVICES stays as it is.
    assert placement_group_gpu_ids([{"CPU": 2.0}, {"CPU": 2.0}], [], others) == [] and len(asked) == 1
    with pytest.raises(ValueError, match="holds no GPU"):
        placement_group_gpu_ids(bundles, [], others)
    with pytest.raises(RuntimeError, match="bundle 1"):
        placement_group_gpu_ids(bundles, ["2"], lambda b: [[] for _ in b])


def test_a_tensor_parallel_replica_sees_every_gpu_of_its_bundles(cluster):
    """In a real placement group of 2 one-GPU bundles (the cluster's 2 declared GPUs), the task holding
    bundle 0's GPU, as a replica does, widens CUDA_VISIBLE_DEVICES to both GPUs, its own first, without
    waiting for a GPU it holds itself."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=1)
    def replica_devices() -> tuple[str, list[str]]:
        from fastgen.serving.ray_placement import use_placement_group_devices

        own = [str(i) for i in ray.get_runtime_context().get_accelerator_ids()["GPU"]]
        use_placement_group_devices(2)
        return os.environ["CUDA_VISIBLE_DEVICES"], own

    group = placement_group([{"GPU": 1}, {"GPU": 1}], strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=60)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        visible, own = ray.get(replica_devices.options(scheduling_strategy=strategy).remote(), timeout=90)
    finally:
        remove_placement_group(group)
    assert visible.split(",")[:1] == own and sorted(visible.split(",")) == ["0", "1"]


def test_default_actor_resources_follow_the_device_the_plan_would_pick(cluster):
    """No resources in ray_actor_options: a GPU for CUDA, a CPU for the CPU, and with the device unset a
    GPU exactly when the cluster has GPUs (this one declares 2)."""
    def never() -> bool:
        raise AssertionError("the cluster is asked only when the device is unset")

    assert default_actor_resources("cuda:1", never) == {"num_gpus": 1}
    assert default_actor_resources("cpu", never) == {"num_cpus": 1}
    assert default_actor_resources(None, lambda: True) == {"num_gpus": 1}
    assert default_actor_resources(None, lambda: False) == {"num_cpus": 1}
    unset = build_app({})._bound_deployment._replica_config.ray_actor_options
    assert unset["num_gpus"] == 1
    cpu = build_app({"device": "cpu"})._bound_deployment._replica_config.ray_actor_options
    assert cpu["num_cpus"] == 1 and not cpu.get("num_gpus")

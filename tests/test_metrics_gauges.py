"""The engine gauges on /metrics that load balancers and autoscalers read: the Gateway API inference
extension's model-server protocol (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`), read from the engine's stats at scrape time, and their value on a
live engine while a request holds KV blocks."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

import fastgen
from fastgen.engine import EngineLoop, submit_group
from fastgen.serving.metrics import ServingMetrics

MODEL = "tiny"
GATEWAY_API = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
GAUGES = (*GATEWAY_API, "vllm:gpu_cache_usage_perc")


def _gauges(metrics: ServingMetrics) -> dict[str, float]:
    text = metrics.render()[0].decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in GAUGES and s.labels == {"model_name": MODEL}}


def test_gauges_follow_the_engine_stats():
    stats = {"num_waiting": 3, "num_running": 5, "kv_blocks_total": 200, "kv_blocks_free": 50}
    metrics = ServingMetrics(lambda: stats, model_name=MODEL)
    assert _gauges(metrics) == {"vllm:num_requests_waiting": 3, "vllm:num_requests_running": 5,
                                "vllm:kv_cache_usage_perc": 0.75, "vllm:gpu_cache_usage_perc": 0.75}
    stats.update(num_waiting=0, num_running=1, kv_blocks_free=199)
    assert _gauges(metrics)["vllm:kv_cache_usage_perc"] == pytest.approx(0.005)
    assert _gauges(metrics)["vllm:num_requests_waiting"] == 0


def test_gauges_of_a_live_engine(tiny_checkpoints):
    pipe = fastgen.pipeline(tiny_checkpoints["llama"], num_kv_blocks=32, block_size=8, token_budget=16, max_seqs=1,
                            progress=False)
    loop = EngineLoop(pipe.engine)
    try:
        pipe.engine.eos_token_ids = set()
        metrics = ServingMetrics(pipe.engine.stats, model_name=MODEL)
        assert {k: _gauges(metrics)[k] for k in GATEWAY_API} == dict.fromkeys(GATEWAY_API, 0.0)
        # max_seqs=1: one request runs, the second waits behind it.
        streams = [submit_group(loop, [[5, 6, 7, 8]], fastgen.SamplingParams(max_new_tokens=200, do_sample=False))
                   for _ in range(2)]
        deadline = time.monotonic() + 30
        while _gauges(metrics)["vllm:num_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busy = _gauges(metrics)
        assert busy["vllm:num_requests_running"] == 1 and busy["vllm:num_requests_waiting"] == 1
        assert 0 < busy["vllm:kv_cache_usage_perc"] <= 1
        for stream in streams:
            stream.abort()
            list(stream)
        while pipe.engine.requests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert {k: _gauges(metrics)[k] for k in GATEWAY_API} == dict.fromkeys(GATEWAY_API, 0.0)
    finally:
        loop.shutdown()
        pipe.destroy()

"""Prometheus metrics of one deployment, kept in the deployment's own registry.

The gateway records what only it can see (requests by endpoint and status, tokens, time to first
token, inter-token latency); the engine's state (queue depth, running sequences, KV blocks,
prefix-cache hit rate, step time) is read lazily at scrape time from a callback, so a scrape costs
the engine nothing between scrapes. Nothing is registered globally: two deployments in one
process (or one test after another) never share a metric.

The same measurements are also exported under vLLM's names (`vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, ... with a `model_name` label), so dashboards and autoscalers
written for a vLLM server read this one unchanged, and so does the Gateway API inference extension,
which routes by `vllm:num_requests_waiting`, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

logger = logging.getLogger("fastgen")

EngineStats = Callable[[], Mapping[str, Any]]
"""Returns a snapshot like `Engine.stats()`; keys it lacks are simply not exported."""

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# (key in the stats snapshot, exported gauge name, help text)
_ENGINE_GAUGES = (
    ("num_requests", "fastgen_engine_requests", "Requests the engine holds (waiting or running)."),
    ("num_waiting", "fastgen_engine_sequences_waiting", "Sequences queued in the scheduler, not yet running."),
    ("num_running", "fastgen_engine_sequences_running", "Sequences the scheduler is running."),
    ("kv_blocks_total", "fastgen_kv_blocks_total", "KV-cache blocks in the engine."),
    ("kv_blocks_free", "fastgen_kv_blocks_free", "KV-cache blocks free or held only by the prefix cache."),
    ("prefix_cache_hit_rate", "fastgen_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up."),
)


# (key in the stats snapshot, vLLM's gauge name, help text)
_VLLM_GAUGES = (
    ("num_running", "vllm:num_requests_running", "Number of requests in model execution batches."),
    ("num_waiting", "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
)
# (key in the stats snapshot, vLLM's counter name, help text): speculative decoding, when it is on
_VLLM_SPEC_COUNTERS = (
    ("spec_num_drafts", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts (rows verified with drafts)."),
    ("spec_num_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("spec_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
)
_FINISH_REASONS = ("stop", "length", "abort")


class _EngineCollector:
    """Turns an engine-stats snapshot into gauges (and a step-time summary) at scrape time."""

    def __init__(self, engine_stats: EngineStats, model_name: Callable[[], str]) -> None:
        self._engine_stats = engine_stats
        self._model_name = model_name

    def describe(self) -> list[Metric]:
        # Empty on purpose: otherwise registering would call the engine once to learn the names.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            stats = dict(self._engine_stats())
        except Exception:  # a scrape must never fail because the engine is stopping
            logger.warning("engine stats unavailable for /metrics", exc_info=True)
            return
        for key, name, doc in _ENGINE_GAUGES:
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        labels = [self._model_name()]
        for key, name, doc in _VLLM_GAUGES:
            if key in stats:
                family = GaugeMetricFamily(name, doc, labels=["model_name"])
                family.add_metric(labels, float(stats[key]))
                yield family
        total, free = stats.get("kv_blocks_total"), stats.get("kv_blocks_free")
        if total and free is not None:
            usage = 1.0 - float(free) / float(total)
            yield GaugeMetricFamily("fastgen_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", value=usage)
            # vLLM's current name (the Gateway API inference extension reads it) and its older one, which
            # says GPU: the fraction is the same on any device.
            for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                family = GaugeMetricFamily(name, "KV-cache usage. 1 means 100 percent usage.", labels=["model_name"])
                family.add_metric(labels, usage)
                yield family
        for key, name, doc in _VLLM_SPEC_COUNTERS:
            if key in stats:
                family = CounterMetricFamily(name, doc, labels=["model_name"])
                family.add_metric(labels, float(stats[key]))
                yield family
        if "spec_accepted_per_position" in stats:
            family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position.", labels=["model_name", "position"])
            for position, count in enumerate(stats["spec_accepted_per_position"]):
                family.add_metric([labels[0], str(position)], float(count))
            yield family
        if "lora_max_loras" in stats:
            # vLLM's adapter gauge, which the Gateway API inference extension reads for adapter-affinity
            # routing: the adapters in use are labels, the value is when they were read (as vLLM's).
            family = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                                       labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            family.add_metric([",".join(stats["lora_running"]), ",".join(stats["lora_waiting"]),
                               str(int(stats["lora_max_loras"]))], time.time())
            yield family
        if "num_steps" in stats and "step_seconds_total" in stats:
            yield SummaryMetricFamily("fastgen_engine_step_seconds", "Wall time of engine steps that ran the model.",
                                      count_value=int(stats["num_steps"]), sum_value=float(stats["step_seconds_total"]))
        if "num_steps_fewer_threads" in stats:
            family = CounterMetricFamily("fastgen_engine_steps_fewer_threads",
                                         "Steps run on fewer CPU threads because other processes kept cores busy.")
            family.add_metric([], float(stats["num_steps_fewer_threads"]))
            yield family


class ServingMetrics:
    """Counters, gauges and histograms of one deployment, in their own `CollectorRegistry`.

    `engine_stats` (for example `engine.stats`) is called at each scrape for the engine's
    queue depth, running sequences, KV-block usage, prefix-cache hit rate and step time.
    `model_name` is the `model_name` label of the vLLM-named metrics; `create_app` sets it to the
    served model's name when it is not given here (`bind_model`).
    """

    def __init__(self, engine_stats: EngineStats | None = None, model_name: str | None = None) -> None:
        self.model_name: str | None = None
        self.registry = CollectorRegistry()
        registry = self.registry
        self._requests = Counter("fastgen_http_requests", "HTTP requests by endpoint (route template) and status.",
                                 ["endpoint", "status"], registry=registry)
        self._prompt_tokens = Counter("fastgen_prompt_tokens", "Prompt tokens of admitted requests (once per prompt).",
                                      registry=registry)
        self._generation_tokens = Counter("fastgen_generation_tokens", "Generated tokens over all choices.",
                                          registry=registry)
        self._finished = Counter("fastgen_sequences_finished", "Finished choices by finish reason (abort = cancelled).",
                                 ["finish_reason"], registry=registry)
        self._pending = Gauge("fastgen_gateway_pending_sequences",
                              "Sequences admitted by the gateway and not finished yet.", registry=registry)
        self._ttft = Histogram("fastgen_time_to_first_token_seconds",
                               "Time from admission to a choice's first token, measured in the gateway.",
                               buckets=_TTFT_BUCKETS, registry=registry)
        self._itl = Histogram("fastgen_inter_token_latency_seconds",
                              "Time between consecutive token deltas of one choice, measured in the gateway.",
                              buckets=_ITL_BUCKETS, registry=registry)
        self._latency = Histogram("fastgen_request_latency_seconds",
                                  "Time from admission to the last token of a request that completed.",
                                  buckets=_LATENCY_BUCKETS, registry=registry)
        by_model = ["model_name"]
        self._vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", by_model,
                                           registry=registry)
        self._vllm_generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                               by_model, registry=registry)
        self._vllm_success = Counter("vllm:request_success", "Count of successfully processed requests (per "
                                     "choice, by finish reason).", [*by_model, "finished_reason"], registry=registry)
        self._vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                    by_model, buckets=_TTFT_BUCKETS, registry=registry)
        self._vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                   by_model, buckets=_ITL_BUCKETS, registry=registry)
        self._vllm_tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                    "seconds (a choice's mean after its first token).", by_model,
                                    buckets=_ITL_BUCKETS, registry=registry)
        self._vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                   by_model, buckets=_LATENCY_BUCKETS, registry=registry)
        if engine_stats is not None:
            if not callable(engine_stats):
                raise TypeError(f"engine_stats must be a callable returning a dict, got {type(engine_stats).__name__}")
            registry.register(_EngineCollector(engine_stats, lambda: self.model_name or ""))
        if model_name is not None:
            self.bind_model(model_name)

    def bind_model(self, model_name: str) -> None:
        """Set the `model_name` label of the vLLM-named metrics, once (the same name again is a no-op)."""
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
        if self.model_name is not None and self.model_name != model_name:
            raise ValueError(f"these metrics are labelled model_name={self.model_name!r}; an app serving "
                             f"{model_name!r} needs its own ServingMetrics")
        self.model_name = model_name
        # Created now, so every series is exported (at zero) from the first scrape, as vLLM does.
        for metric in (self._vllm_prompt_tokens, self._vllm_generation_tokens, self._vllm_ttft, self._vllm_itl,
                       self._vllm_tpot, self._vllm_e2e):
            metric.labels(model_name=model_name)
        for reason in _FINISH_REASONS:
            self._vllm_success.labels(model_name=model_name, finished_reason=reason)

    def _label(self) -> str:
        return self.model_name or ""

    def count_request(self, endpoint: str, status: int) -> None:
        """One HTTP request answered with `status` on `endpoint` (a route template, not a raw path)."""
        self._requests.labels(endpoint=endpoint, status=str(status)).inc()

    def count_prompt_tokens(self, num_tokens: int) -> None:
        """Prompt tokens of one admitted prompt."""
        self._prompt_tokens.inc(num_tokens)
        self._vllm_prompt_tokens.labels(model_name=self._label()).inc(num_tokens)

    def count_generation_tokens(self, num_tokens: int) -> None:
        """Tokens generated in one delta."""
        self._generation_tokens.inc(num_tokens)
        self._vllm_generation_tokens.labels(model_name=self._label()).inc(num_tokens)

    def count_finished(self, finish_reason: str, num: int = 1) -> None:
        """`num` choices finished with `finish_reason` ("stop", "length" or "abort")."""
        self._finished.labels(finish_reason=finish_reason).inc(num)
        self._vllm_success.labels(model_name=self._label(), finished_reason=finish_reason).inc(num)

    def set_pending(self, num_sequences: int) -> None:
        """Sequences the gateway has admitted and not finished."""
        self._pending.set(num_sequences)

    def observe_first_token(self, seconds: float) -> None:
        """Time to first token of one choice."""
        self._ttft.observe(seconds)
        self._vllm_ttft.labels(model_name=self._label()).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        """Gap between two token deltas of one choice."""
        self._itl.observe(seconds)
        self._vllm_itl.labels(model_name=self._label()).observe(seconds)

    def observe_request_latency(self, seconds: float) -> None:
        """End-to-end time of one completed request."""
        self._latency.observe(seconds)
        self._vllm_e2e.labels(model_name=self._label()).observe(seconds)

    def observe_time_per_output_token(self, seconds: float) -> None:
        """A finished choice's mean time per token after its first (vLLM's time per output token)."""
        self._vllm_tpot.labels(model_name=self._label()).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The registry in Prometheus text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

"""fastgen on Ray Serve: one engine per replica, the OpenAI and MII REST routes through Ray's HTTP proxy.

    serve run fastgen.serving.ray_app:build_app model=PATH num_replicas=2
    serve.run(build_app({"model": PATH, "num_replicas": 2, "dtype": "bfloat16"}))

`build_app` takes every engine option (`EngineConfig`'s fields, spelled and parsed as the
launcher's flags are when they come from `serve run` as strings), the serving bounds of
`ServingLimits`, and Ray Serve's scaling options (`num_replicas` or `autoscaling_config`,
`max_ongoing_requests`, `ray_actor_options`, the health-check period and timeout, and
`drain_timeout`). Each replica builds its own engine on an `EngineLoop` and serves the gateway's
FastAPI app (`create_app`: the OpenAI routes, `/mii/{deployment}`, `/health`, `/metrics`) through
`@serve.ingress`, so streaming (server-sent events) goes through Ray's proxy (with `stream_interval_ms`, a
stream's events after its first are batched into one write, one message to the proxy, per interval), and
a client that disconnects has its request aborted (its KV blocks are freed at the next step).

Failures and shutdown are Ray's to manage: `check_health` fails once the replica's engine loop has
stopped (the engine failed for good, a tensor-parallel rank died), so Serve replaces the replica;
when Serve stops a replica (scale-down, redeploy, `serve shutdown`) it routes nothing new to it and
waits up to `drain_timeout` seconds (Serve's `graceful_shutdown_timeout_s`) for its requests in
flight before the replica's engine is shut down. `tensor_parallel > 1` reserves one placement-group
bundle per rank on one node (`STRICT_PACK`: GPUs, or CPUs on a CPU-only cluster); the replica
runs rank 0 in the first bundle and starts the other ranks itself, on the bundles' devices (the
GPU ids of bundles 1.. are read by a short task placed in each, `placement_group_gpu_ids`).
The gRPC server does not run inside Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
from typing import Any

from fastgen.config import EngineConfig
from fastgen.engine import DEMO_MODEL_DIR, Engine, EngineLoop
from fastgen.serving.cli import build_parser, engine_fields
from fastgen.serving.limits import ServingLimits, api_keys_from_env
from fastgen.serving.lora import LoRAModule, load_lora_modules, parse_lora_module
from fastgen.serving.metrics import ServingMetrics
from fastgen.serving.ray_placement import cluster_has_gpus, default_actor_resources, use_placement_group_devices
from fastgen.serving.http.app import create_app
from fastgen.serving.http.chat.reasoning import REASONING_PARSERS
from fastgen.serving.http.chat.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_MAX_ONGOING_REQUESTS = 64
"""Requests Ray's router lets one replica hold at once (Ray's own default, 5, starves continuous batching)."""

DEFAULT_DRAIN_TIMEOUT_S = 30.0
"""Seconds a stopping replica waits for its requests in flight (Serve's `graceful_shutdown_timeout_s`)."""

REPLICA_HEADER = "x-fastgen-replica"
"""Response header naming the Serve replica that answered (its unique id)."""

_SCALING_OPTIONS = ("num_replicas", "autoscaling_config", "max_ongoing_requests", "ray_actor_options",
                    "health_check_period_s", "health_check_timeout_s", "drain_timeout")
_SERVER_OPTIONS = ("model", "deployment_name", "served_model_name", "api_key", "max_pending_requests",
                   "max_prompts_per_request", "max_n", "max_body_bytes", "strict_params", "protect_metrics",
                   "tool_call_parser", "reasoning_parser", "lora_modules", "stream_interval_ms")

DEFAULT_STREAM_INTERVAL_MS = 50.0
"""A replica's `stream_interval_ms` unless told, Ray Serve LLM's default (`stream_batching_interval_ms`):
each write is a message from the replica to Ray's proxy and on to the client, two hops a direct server
does not have, so a stream's events after its first go in one write per 50 ms (each token still its own
server-sent event). On a 2-core EPYC (SmolLM2-135M bf16, 8 streams of 64 tokens, `scripts/bench_ray.py`)
writing each event as it came cost 28% of direct serving's streamed tok/s; 50 ms, none."""


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What one replica serves and how (everything `build_app` takes but Ray's scaling options)."""

    engine: dict[str, Any]
    """EngineConfig keywords (typed), `model` excluded."""
    model: str | None = None
    """Checkpoint directory or .gguf file; None = the bundled demo model."""
    deployment_name: str = "fastgen"
    """MII's deployment name: the `/mii/{deployment_name}` route."""
    served_model_name: str | None = None
    """The `model` id OpenAI clients send; default: the model path (the demo model's directory name)."""
    limits: ServingLimits = ServingLimits()
    """Keys and bounds, as for `scripts/serve.py`."""
    strict_params: bool = False
    """Refuse OpenAI bodies with fields this server does not know (400) instead of ignoring them."""
    protect_metrics: bool = False
    """Put `/metrics` behind the API key too."""
    tool_call_parser: str | None = None
    """The format tool calls are parsed out of `tool_choice: auto` chat replies in (`--tool-call-parser`)."""
    reasoning_parser: str | None = None
    """The format of reasoning models' thinking, split off as `reasoning_content` (`--reasoning-parser`)."""
    lora_modules: tuple[LoRAModule, ...] = ()
    """LoRA adapters each replica loads at start-up (`--lora-modules`; needs `enable_lora`)."""
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS
    """A stream's events after its first go to the proxy in one write per this many milliseconds (0: each
    event as it comes)."""

    @property
    def model_name(self) -> str:
        """The id `/v1/models` lists."""
        return self.served_model_name or self.model or os.path.basename(DEMO_MODEL_DIR)


class FastGenServer:
    """One replica: an engine on its own loop thread and the gateway app over it.

    Plain Python: `FastGenDeployment` is this class under `@serve.deployment` and `@serve.ingress`.
    """

    def __init__(self, options: ServerOptions) -> None:
        use_placement_group_devices(options.engine.get("tensor_parallel"))
        self.options = options
        # Built on the thread that steps it: the actor's main thread is Ray's (`EngineLoop.start`).
        self.loop = EngineLoop.start(lambda: _build_engine(options))
        self.engine = self.loop.engine
        self.gateway_app = create_app(self.loop, options.deployment_name, self.engine.tokenizer, options.model_name,
                              limits=options.limits, max_model_len=self.engine.max_model_len,
                              metrics=ServingMetrics(self.engine.stats), strict_params=options.strict_params,
                              protect_metrics=options.protect_metrics, tool_call_parser=options.tool_call_parser,
                              reasoning_parser=options.reasoning_parser,
                              stream_interval_ms=options.stream_interval_ms)
        self.gateway_app.middleware("http")(_name_replica(_replica_id()))

    def __serve_build_asgi_app__(self) -> Any:
        """The app `@serve.ingress` serves (Ray calls this once the replica is built)."""
        return self.gateway_app

    def check_health(self) -> None:
        """Raise once the engine loop has stopped, so Serve replaces this replica."""
        if self.loop.stopped:
            reason = self.loop.fatal_error
            raise RuntimeError(f"the engine loop has stopped: {reason}" if reason is not None else
                               "the engine loop has stopped")

    def shutdown(self) -> None:
        """Stop the loop (aborting anything left: Serve calls this after the drain) and free the engine."""
        self.loop.shutdown()
        self.engine.shutdown()

    def __del__(self) -> None:
        # Serve's destructor hook: it runs after the graceful-shutdown wait for requests in flight.
        if "loop" in self.__dict__:
            self.shutdown()


def _build_engine(options: ServerOptions) -> Engine:
    """The replica's engine, with the LoRA adapters `options` names loaded."""
    engine = Engine.from_config(EngineConfig.from_kwargs(options.model, **options.engine))
    load_lora_modules(engine, options.lora_modules, "lora_modules")
    return engine


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # built outside a Serve replica (a unit test, a plain process)
        return f"pid-{os.getpid()}"


def _name_replica(replica_id: str) -> Any:
    async def name_replica(request: Any, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers[REPLICA_HEADER] = replica_id
        return response

    return name_replica


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application for `args` (from `serve run ... key=value` as strings, or typed from Python).

    Keys: every EngineConfig field (`model`, `dtype`, `num_kv_blocks`, `tensor_parallel`, ...);
    `deployment_name`, `served_model_name`, `api_key` (default `FASTGEN_API_KEY` in the replicas'
    environment), `max_pending_requests`, `max_prompts_per_request`, `max_n`, `max_body_bytes`,
    `strict_params`, `protect_metrics`, `tool_call_parser`, `reasoning_parser`, `lora_modules` (a list
    of `name=path` entries, or one string of them space-separated), `stream_interval_ms` (a stream's
    events after its first go to the proxy in one write per this many milliseconds; default 50,
    `DEFAULT_STREAM_INTERVAL_MS`; 0: each event as it comes); and Ray's `num_replicas` (an int, or "auto") or
    `autoscaling_config` (a dict or its JSON, e.g. `{"min_replicas": 1, "max_replicas": 4,
    "target_ongoing_requests": 16}`), `max_ongoing_requests` (default 64), `ray_actor_options` (a
    dict or its JSON; default per replica: one GPU when CUDA is the device, or when the device is unset
    and the cluster has GPUs, else one CPU: `default_actor_resources`), `health_check_period_s`,
    `health_check_timeout_s` and `drain_timeout` (seconds a stopping replica waits for its requests,
    default 30). An unknown key is a TypeError, a bad value a ValueError/TypeError naming it,
    raised here before Ray starts anything.
    """
    from ray import serve

    if not isinstance(args, dict):
        raise TypeError(f"build_app takes a dict of options, got {type(args).__name__}")
    engine_names = {f.name for f in engine_fields()} | {"tensor_parallel"}
    unknown = sorted(set(args) - engine_names - set(_SCALING_OPTIONS) - set(_SERVER_OPTIONS))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))} (supported: "
                        f"{', '.join(sorted(engine_names | set(_SCALING_OPTIONS) | set(_SERVER_OPTIONS)))})")
    engine = _engine_options({k: v for k, v in args.items() if k in engine_names})
    options = _server_options(args, engine)
    deployment = _deployment_options({k: args[k] for k in _SCALING_OPTIONS if k in args}, engine)
    ingress = serve.ingress()(FastGenServer)
    return serve.deployment(ingress, name="FastGenDeployment", **deployment).bind(options)


def _engine_options(raw: dict[str, Any]) -> dict[str, Any]:
    """Typed engine keywords, checked by EngineConfig; strings are parsed as the launcher's flags."""
    strings = {k: v for k, v in raw.items() if isinstance(v, str)}
    typed = {k: v for k, v in raw.items() if not isinstance(v, str)}
    if strings:
        typed.update(_parse_flags(strings))
    EngineConfig.from_kwargs(None, **typed)  # every value checked before Ray starts a replica
    return typed


def _parse_flags(strings: dict[str, str]) -> dict[str, Any]:
    """`{"num_kv_blocks": "64", "enable_prefix_caching": "false", "buckets": "1,2,4"}` -> typed values,
    through the launcher's own parser (so `serve run` and `scripts/serve.py` read a value alike)."""
    parser = build_parser()
    actions: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        actions.setdefault(action.dest, []).append(action)
    argv: list[str] = []
    for name, text in strings.items():
        flags = actions[name]
        if flags[0].nargs == 0:  # a bool: --name / --no-name
            want = _bool(name, text)
            match = [a for a in flags if a.const == want]
            if match:
                argv.append(match[0].option_strings[0])
            continue  # the field's default already is `want`
        argv += [flags[0].option_strings[0], text]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parsed = parser.parse_args(argv)
    except SystemExit:
        message = errors.getvalue().strip().splitlines()
        raise ValueError(message[-1] if message else f"bad engine options {strings}") from None
    return {name: getattr(parsed, name) for name in strings if getattr(parsed, name) is not None}


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.lower() in ("true", "1", "yes", "on")
    raise ValueError(f"{name} must be a bool (true or false), got {value!r}")


def _number(name: str, value: Any, kind: type, low: float) -> Any:
    if isinstance(value, str):
        try:
            value = kind(value)
        except ValueError:
            raise ValueError(f"{name} must be {'an int' if kind is int else 'a number'}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise TypeError(f"{name} must be {'an int' if kind is int else 'a number'}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _mapping(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{name} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict (or its JSON), got {type(value).__name__}")
    return value


def _server_options(args: dict[str, Any], engine: dict[str, Any]) -> ServerOptions:
    bounds = {}
    for name in ("max_pending_requests", "max_prompts_per_request", "max_n", "max_body_bytes"):
        if args.get(name) is not None:
            bounds[name] = _number(name, args[name], int, 1)
    api_key = args.get("api_key")
    limits = ServingLimits(api_keys=api_keys_from_env(api_key), **bounds)
    for name in ("model", "deployment_name", "served_model_name"):
        value = args.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if "/" in args.get("deployment_name", ""):
        raise ValueError(f"deployment_name must not contain '/', got {args['deployment_name']!r}")
    flags = {name: _bool(name, args[name]) for name in ("strict_params", "protect_metrics") if name in args}
    for name, known in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
        if args.get(name) is not None and args[name] not in known:
            raise ValueError(f"{name} must be one of {', '.join(sorted(known))}, got {args[name]!r}")
    names = {k: args[k] for k in ("deployment_name", "served_model_name", "tool_call_parser", "reasoning_parser")
             if args.get(k) is not None}
    lora_modules = _lora_modules(args.get("lora_modules"), engine)
    interval = {}
    if args.get("stream_interval_ms") is not None:
        interval["stream_interval_ms"] = _number("stream_interval_ms", args["stream_interval_ms"], float, 0)
    return ServerOptions(engine=engine, model=args.get("model"), limits=limits, lora_modules=lora_modules,
                         **names, **flags, **interval)


def _lora_modules(value: Any, engine: dict[str, Any]) -> tuple[LoRAModule, ...]:
    """`lora_modules`: `--lora-modules`' entries as a list (`name=path` strings or `{"name", "path"}`
    dicts) or one string of space-separated entries (from `serve run`); ValueError naming the field."""
    if value is None:
        return ()
    entries = value.split() if isinstance(value, str) else value
    if not isinstance(entries, (list, tuple)):
        raise TypeError(f"lora_modules must be a list of name=path entries, got {type(value).__name__}")
    modules = []
    for entry in entries:
        if not isinstance(entry, (str, dict)):
            raise TypeError(f"lora_modules entries are name=path strings or dicts, got {type(entry).__name__}")
        try:
            modules.append(parse_lora_module(json.dumps(entry) if isinstance(entry, dict) else entry))
        except ValueError as exc:
            raise ValueError(f"lora_modules: {exc}") from None
    if modules and not engine.get("enable_lora"):
        raise ValueError("lora_modules needs enable_lora")
    return tuple(modules)


def _deployment_options(raw: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """Ray Serve's `serve.deployment` keywords from build_app's scaling options."""
    options: dict[str, Any] = {}
    if "num_replicas" in raw and "autoscaling_config" in raw:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    if "num_replicas" in raw:
        replicas = raw["num_replicas"]
        options["num_replicas"] = "auto" if replicas == "auto" else _number("num_replicas", replicas, int, 1)
    if "autoscaling_config" in raw:
        options["autoscaling_config"] = _mapping("autoscaling_config", raw["autoscaling_config"])
    options["max_ongoing_requests"] = _number("max_ongoing_requests",
                                              raw.get("max_ongoing_requests", DEFAULT_MAX_ONGOING_REQUESTS), int, 1)
    for name in ("health_check_period_s", "health_check_timeout_s"):
        if name in raw:
            options[name] = _number(name, raw[name], float, 0.1)
    options["graceful_shutdown_timeout_s"] = _number("drain_timeout", raw.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT_S),
                                                     float, 0)
    actor = _mapping("ray_actor_options", raw.get("ray_actor_options", {}))
    if not actor.keys() & {"num_cpus", "num_gpus", "resources"}:
        actor = {**actor, **default_actor_resources(engine.get("device"), cluster_has_gpus)}
    tensor_parallel = engine.get("tensor_parallel") or 1
    if tensor_parallel > 1:
        # One bundle per rank on one node; the replica (rank 0) takes the first, its ranks the rest.
        bundle = {"CPU": float(actor.get("num_cpus", 0) or 0), "GPU": float(actor.get("num_gpus", 0) or 0),
                  **actor.get("resources", {})}
        bundle = {k: v for k, v in bundle.items() if v}
        if not bundle:
            raise ValueError("tensor_parallel > 1 needs ray_actor_options with num_cpus or num_gpus per rank")
        options["placement_group_bundles"] = [dict(bundle) for _ in range(tensor_parallel)]
        options["placement_group_strategy"] = "STRICT_PACK"
    options["ray_actor_options"] = actor
    return options

"""`fastgen.serve(...)`: start a persistent deployment in its own process and return a client.

MII's options are accepted with MII's names and defaults; every EngineConfig field is accepted
too. The deployment runs `python -m fastgen.serving.launcher` in a new session (it outlives this
script, as MII's did, until `client.terminate_server()`), writes its output to
`<registry dir>/<name>.log`, and records itself in the registry once it serves. Start-up
failures are raised here with the cause: a taken port before anything starts, a model that fails
to load or a process that dies with the tail of its log, and a timeout.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Any

from fastgen.config import EngineConfig
from fastgen.serving import registry
from fastgen.serving.client import Client
from fastgen.serving.launcher import DEFAULT_PORT, DEFAULT_REST_PORT, default_deployment_name, engine_argv
from fastgen.serving.processes import check_port_free, connect_host, stop_process

SERVE_OPTIONS = {
    # MII's names (max_length is an EngineConfig field, handled with the engine options).
    "deployment_name": None, "tensor_parallel": None, "replica_num": None, "port_number": DEFAULT_PORT,
    "enable_restful_api": False, "restful_api_host": None, "restful_api_port": DEFAULT_REST_PORT, "device_map": None,
    # fastgen's own.
    "host": "0.0.0.0", "api_key": None, "startup_timeout": 600.0,
}
"""Deployment options of `serve` (besides EngineConfig fields) and their defaults."""


class DeploymentError(RuntimeError):
    """A deployment could not be started (port taken, model failed to load, process died, timeout)."""


def _log_tail(path: str, max_chars: int = 4000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no log)"
    return text[-max_chars:].strip() or "(empty log)"


def _int_option(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def _split_options(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(deployment options with defaults filled in, engine options); unknown names are a TypeError."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"} - set(SERVE_OPTIONS)
    unknown = sorted(set(config) - set(SERVE_OPTIONS) - engine_fields)
    if unknown:
        raise TypeError(f"unknown serve option(s) {', '.join(map(repr, unknown))} (supported: "
                        f"{', '.join(sorted(set(SERVE_OPTIONS) | engine_fields))})")
    options = {**SERVE_OPTIONS, **{k: v for k, v in config.items() if k in SERVE_OPTIONS}}
    return options, {k: v for k, v in config.items() if k in engine_fields}


def _launcher_argv(model: str | None, name: str, options: dict[str, Any], engine: dict[str, Any]) -> list[str]:
    argv = [sys.executable, "-m", "fastgen.serving.launcher", "--host", options["host"],
            "--port", str(options["port_number"]), "--deployment-name", name,
            "--startup-timeout", str(options["startup_timeout"])]
    for name in ("tensor_parallel", "replica_num"):
        if options[name] is not None:
            argv += ["--" + name.replace("_", "-"), str(options[name])]
    if model is not None:
        argv += ["--model", model]
    if options["enable_restful_api"]:
        argv += ["--enable-restful-api", "--restful-api-port", str(options["restful_api_port"])]
        if options["restful_api_host"] is not None:
            argv += ["--restful-api-host", options["restful_api_host"]]
        if options["api_key"] is not None:
            argv += ["--api-key", options["api_key"]]
    return argv + engine_argv(engine)


def serve(model_name_or_path: str | None = None, **config: Any) -> Client:
    """Start a deployment of `model_name_or_path` (None = the bundled demo model); return its client.

    Options: MII's `deployment_name` (default `<model basename>-mii-deployment`), `tensor_parallel`
    (ranks per replica; each replica starts its other ranks itself), `replica_num` (both default to
    the policy's choice, see `fastgen.plan_deployment`), `max_length`, `port_number` (50050),
    `enable_restful_api`, `restful_api_host`, `restful_api_port` (51080), `device_map` ("auto" or None); fastgen's
    `host` (gRPC listen address, default all interfaces), `api_key` (REST bearer key),
    `startup_timeout` (seconds, default 600); and every `EngineConfig` field (`dtype`, `device`,
    `token_budget`, `num_kv_blocks`, ...). Unknown options raise TypeError, bad values
    ValueError/TypeError, all before anything starts.
    """
    options, engine = _split_options(config)
    for name in ("tensor_parallel", "replica_num"):
        if options[name] is not None:  # None: the policy chooses (fastgen.plan_deployment says how)
            _int_option(name, options[name], 1)
    if options["device_map"] not in (None, "auto"):
        raise NotImplementedError(f"device_map={options['device_map']!r}: only 'auto' (or None) is supported; "
                                  "choose the device with device='cuda:1' and so on")
    port = _int_option("port_number", options["port_number"], 1, 65535)
    _int_option("restful_api_port", options["restful_api_port"], 1, 65535)
    timeout = options["startup_timeout"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"startup_timeout must be a positive number of seconds, got {timeout!r}")
    EngineConfig.from_kwargs(model_name_or_path, **engine)  # every engine option checked before starting
    name = registry.check_name(options["deployment_name"] or default_deployment_name(model_name_or_path))
    running = registry.live_record(name)
    if running is not None:
        raise DeploymentError(f"deployment {name!r} is already running at {running['host']}:{running['port']} "
                              f"(pid {running['pid']}): connect with fastgen.client({name!r}) or terminate it first")
    host = options["host"]
    try:
        check_port_free(host, port)
        if options["enable_restful_api"]:
            check_port_free(options["restful_api_host"] or host, options["restful_api_port"])
    except OSError as exc:
        raise DeploymentError(str(exc)) from None

    log_path = registry.log_path(name)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_launcher_argv(model_name_or_path, name, options, engine), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise DeploymentError(f"deployment {name!r} exited with code {proc.returncode} before serving; "
                                  f"the end of its log ({log_path}):\n{_log_tail(log_path)}")
        record = registry.live_record(name)
        if record is not None and record.get("pid") == proc.pid:
            break
        if time.monotonic() > deadline:
            stop_process(proc)
            raise DeploymentError(f"deployment {name!r} did not start serving within {timeout} s; "
                                  f"the end of its log ({log_path}):\n{_log_tail(log_path)}")
        time.sleep(0.1)
    return Client(f"{connect_host(host)}:{record['port']}", deployment_name=name, process=proc)

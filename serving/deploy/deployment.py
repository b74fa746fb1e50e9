"""`fastgen.serve(...)`: start a persistent deployment in its own process and return a client.

MII's options are accepted with MII's names and defaults, as keywords or in MII's `model_config={...}`
and `mii_config={...}` (`fastgen.mii_options` maps each onto ours, or refuses it saying why);
every EngineConfig field is accepted too. The deployment runs `python -m fastgen.serving.deploy.launcher` in a new session (it outlives this
script, as MII's did, until `client.terminate_server()`), writes its output to
`<registry dir>/<name>.log`, and records itself in the registry once it serves. Start-up
failures are raised here with the cause: a taken port before anything starts, a model that fails
to load or a process that dies with the tail of its log, and a timeout.

The API keys reach the deployment through its environment (`FASTGEN_API_KEY`), never its command
line, which every user of the machine can read. A reaper thread waits for the process, so however
it ends (this client's `terminate_server`, another client's, a signal) it leaves no zombie.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Any

from fastgen.mii_options import mii_options
from fastgen.config import EngineConfig
from fastgen.serving.deploy import registry
from fastgen.serving.cli import DEFAULT_PORT, DEFAULT_REST_PORT, default_deployment_name, engine_argv, limits_argv
from fastgen.serving.client import Client
from fastgen.serving.grpc.guard import server_credentials
from fastgen.serving.limits import (API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS_PER_REQUEST,
                                    ServingLimits, api_keys_from_env)
from fastgen.serving.deploy.processes import check_port_free, connect_host, reap_in_background, stop_process

SERVE_OPTIONS = {
    # MII's names (max_length is an EngineConfig field, handled with the engine options).
    "deployment_name": None, "tensor_parallel": None, "replica_num": None, "port_number": DEFAULT_PORT,
    "enable_restful_api": False, "restful_api_host": None, "restful_api_port": DEFAULT_REST_PORT,
    # fastgen's own.
    "host": "127.0.0.1", "api_key": None, "tls_cert": None, "tls_key": None, "max_pending_requests": None,
    "max_prompts_per_request": DEFAULT_MAX_PROMPTS_PER_REQUEST, "max_n": DEFAULT_MAX_N,
    "max_body_bytes": DEFAULT_MAX_BODY_BYTES, "startup_timeout": 600.0,
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


def _limits(options: dict[str, Any]) -> ServingLimits:
    """The deployment's keys and bounds from serve()'s options (ValueError naming the option)."""
    api_key = options["api_key"]
    if api_key is not None and not isinstance(api_key, (str, list, tuple)):
        raise TypeError(f"api_key must be a str, a list of str or None, got {type(api_key).__name__}")
    return ServingLimits(api_keys=api_keys_from_env(api_key), max_body_bytes=options["max_body_bytes"],
                         max_pending_requests=options["max_pending_requests"],
                         max_prompts_per_request=options["max_prompts_per_request"], max_n=options["max_n"])


def _launcher_argv(model: str | None, name: str, options: dict[str, Any], engine: dict[str, Any],
                   limits: ServingLimits) -> list[str]:
    argv = [sys.executable, "-m", "fastgen.serving.deploy.launcher", "--host", options["host"],
            "--port", str(options["port_number"]), "--deployment-name", name,
            "--startup-timeout", str(options["startup_timeout"]), *limits_argv(limits)]
    if options["tls_cert"] is not None:
        argv += ["--tls-cert", os.path.abspath(options["tls_cert"]), "--tls-key", os.path.abspath(options["tls_key"])]
    for name in ("tensor_parallel", "replica_num"):
        if options[name] is not None:
            argv += ["--" + name.replace("_", "-"), str(options[name])]
    if model is not None:
        argv += ["--model", model]
    if options["enable_restful_api"]:
        argv += ["--enable-restful-api", "--restful-api-port", str(options["restful_api_port"])]
        if options["restful_api_host"] is not None:
            argv += ["--restful-api-host", options["restful_api_host"]]
    return argv + engine_argv(engine)


def serve(model_name_or_path: str | None = None, model_config: dict[str, Any] | None = None,
          mii_config: dict[str, Any] | None = None, **config: Any) -> Client:
    """Start a deployment of `model_name_or_path` (None = the bundled demo model); return its client.

    Options: MII's `deployment_name` (default `<model basename>-mii-deployment`), `tensor_parallel`
    (ranks per replica; each replica starts its other ranks itself), `replica_num` (both default to
    the policy's choice, see `fastgen.plan_deployment`), `max_length`, `port_number` (50050),
    `enable_restful_api`, `restful_api_host`, `restful_api_port` (51080), `device_map` (MII's forms,
    where they match fastgen's placement), the rest of MII's ModelConfig/MIIConfig fields (as keywords
    or in `model_config`/`mii_config`; see `fastgen.mii_options`); fastgen's
    `host` (listen address, default 127.0.0.1: this machine only; "0.0.0.0" exposes it), `api_key`
    (a key or a list of keys every gRPC method and REST route but health requires; default
    `FASTGEN_API_KEY`; none = open), `tls_cert`/`tls_key` (PEM files: TLS for gRPC and REST; the
    returned client verifies against `tls_cert`), `max_pending_requests` (sequences in flight;
    default unbounded), `max_prompts_per_request` (256), `max_n` (64), `max_body_bytes` (8 MiB),
    `startup_timeout` (seconds, default 600); and every `EngineConfig` field (`dtype`, `device`,
    `token_budget`, `num_kv_blocks`, ...). Unknown options raise TypeError, bad values
    ValueError/TypeError, all before anything starts.
    """
    model_name_or_path, config = mii_options(model_name_or_path, model_config, mii_config, config, serving=True,
                                             native=SERVE_OPTIONS)
    options, engine = _split_options(config)
    for name in ("tensor_parallel", "replica_num"):
        if options[name] is not None:  # None: the policy chooses (fastgen.plan_deployment says how)
            _int_option(name, options[name], 1)
    port = _int_option("port_number", options["port_number"], 1, 65535)
    _int_option("restful_api_port", options["restful_api_port"], 1, 65535)
    timeout = options["startup_timeout"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"startup_timeout must be a positive number of seconds, got {timeout!r}")
    EngineConfig.from_kwargs(model_name_or_path, **engine)  # every engine option checked before starting
    limits = _limits(options)
    server_credentials(options["tls_cert"], options["tls_key"])  # both or neither, readable PEM files
    if not isinstance(options["host"], str) or not options["host"]:
        raise ValueError(f"host must be a listen address such as '127.0.0.1', got {options['host']!r}")
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

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(API_KEY_ENV, None)
    if limits.api_keys:
        env[API_KEY_ENV] = ",".join(limits.api_keys)
    log_path = registry.log_path(name)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_launcher_argv(model_name_or_path, name, options, engine, limits), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
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
    # Whoever stops the deployment (maybe another client, another process), we are its parent:
    # only our wait() removes its zombie.
    reap_in_background(proc, name)
    return Client(f"{connect_host(host)}:{record['port']}", deployment_name=name, process=proc,
                  api_key=limits.api_keys[0] if limits.api_keys else None, tls_root_cert=options["tls_cert"])

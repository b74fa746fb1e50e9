"""The deployment process: `python scripts/serve.py ...` or `python -m fastgen.serving.deploy.launcher ...`.

Order of start-up, so that every failure is early and clear: parse and validate the options,
bind the gRPC port (a taken port fails before any model is loaded; health says NOT_SERVING while
loading), load the engine (or start the replicas), turn health to SERVING, start the REST gateway
if asked, record the deployment, print `listening on host:port`. SIGTERM drains it: admission stops
(new requests get gRPC UNAVAILABLE / HTTP 503, health turns NOT_SERVING and `/health` 503) while the
requests already admitted finish, for up to `--drain-timeout` seconds; then it stops as for SIGINT,
a Terminate call or REST's /terminate, which stop it at once (as does a second SIGTERM): the
record is removed, the servers stop, the engine loop and its tensor-parallel workers (or every
replica) shut down and are reaped, and the process exits 0.
The flags are in `fastgen.serving.cli`; the keys and bounds they set (one `ServingLimits`) apply
to the gRPC server and the REST gateway alike.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
from transformers import AutoTokenizer

import fastgen
from fastgen.config import EngineConfig
from fastgen.api import torchrun_env
from fastgen.engine import DEMO_MODEL_DIR, Engine
from fastgen.engine import EngineLoop
from fastgen.serving.deploy import registry
from fastgen.serving.backend import Backend, LocalBackend
from fastgen.serving.cli import (DEFAULT_PORT, DEFAULT_REST_PORT, build_parser, default_deployment_name, engine_argv,
                                 engine_fields, limits_argv, served_model_name, validate)
from fastgen.serving.grpc.server import GrpcServer
from fastgen.serving.limits import ServingLimits
from fastgen.serving.lora import load_lora_modules
from fastgen.serving.deploy.processes import check_port_free, connect_host, stop_process, write_json_atomic
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.deploy.replicas import ReplicaRouter, start_replicas

REST_GRACE_AFTER_TERMINATE_S = 1.0
"""Seconds the REST gateway stays up after a gRPC Terminate (MII's client calls REST's /terminate next)."""

logger = logging.getLogger("fastgen.serving")

__all__ = ["DEFAULT_PORT", "DEFAULT_REST_PORT", "build_parser", "default_deployment_name", "engine_argv", "main"]


class _Interrupted(Exception):
    """A signal arrived while the model was loading."""


def _rest_module() -> Any:
    """`fastgen.serving.http.app`, or SystemExit saying why the REST gateway is not available."""
    try:
        return importlib.import_module("fastgen.serving.http.app")
    except ModuleNotFoundError as exc:
        if exc.name in ("fastgen.serving.http.app", "fastgen.serving.http", "fastgen.serving"):
            raise SystemExit("--enable-restful-api: this fastgen has no REST gateway "
                             "(fastgen.serving.http.app is missing)") from None
        raise SystemExit(f"--enable-restful-api needs {exc.name!r}: pip install 'fastgen[serving]'") from None


def _rest_app(rest: Any, args: argparse.Namespace, backend: Backend, stop: threading.Event,
              server: GrpcServer) -> Any:
    """The gateway's app over the same backend, limits and admission budget as the gRPC `server`
    (so `--max-pending-requests` bounds both protocols together); `GET /terminate` stops the
    deployment as Terminate does."""
    from fastgen.serving.metrics import ServingMetrics  # only a REST gateway needs prometheus_client

    return rest.create_app(backend, deployment_name=args.deployment_name, tokenizer=backend.tokenizer,
                           model_name=served_model_name(args), limits=server.limits,
                           max_model_len=backend.model_info().max_length, metrics=ServingMetrics(backend.stats),
                           on_terminate=stop.set, strict_params=args.strict_params,
                           protect_metrics=args.protect_metrics, budget=server.budget,
                           tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)


class _RestThread:
    """The REST gateway: uvicorn in a thread of this process, over the same backend (HTTPS with `tls`:
    the (cert, key) files)."""

    def __init__(self, app: Any, host: str, port: int, tls: tuple[str, str] | None = None) -> None:
        import uvicorn

        ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **ssl))
        self._thread = threading.Thread(target=self._server.run, name="fastgen-rest", daemon=True)
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            time.sleep(0.05)
        if not self._server.started:
            raise SystemExit(f"the REST gateway could not listen on {host}:{port}")

    def stop(self) -> None:
        """Let uvicorn finish its open requests and exit, then join its thread."""
        self._server.should_exit = True
        self._thread.join(10)


def _planned_replicas(args: argparse.Namespace, config: EngineConfig) -> int:
    """`--replica-num`, else the policy's count; 1 for a replica itself and for a torchrun launch (its
    ranks are its GPUs). Several replicas are planned here, once, so that an engine option the policy
    refuses (the LoRA bounds among them) stops the deployment before it starts processes that would
    each refuse it; ValueError naming it."""
    if args.replica_of is not None or torchrun_env() is not None or args.replica_num == 1:
        return 1
    overrides = {k: v for k, v in config.plan_overrides().items() if k != "replica_num"}
    plan = fastgen.plan_deployment(config.model or DEMO_MODEL_DIR, config.device, offline=config.offline,
                                   **overrides)
    if args.replica_num is not None:
        return args.replica_num
    if plan.replica_num > 1:
        logger.info("replicas: %d (%s)", plan.replica_num, plan.reasons["replica_num"])
    return plan.replica_num


def _load_lora_modules(engine: Engine, args: argparse.Namespace) -> None:
    """Load `--lora-modules` into `engine`; SystemExit naming the entry (the engine shut down) for a bad one."""
    try:
        load_lora_modules(engine, args.lora_modules, "--lora-modules")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.lora_modules:
        logger.info("LoRA adapters: %s", ", ".join(f"{m.name} ({m.path})" for m in args.lora_modules))


def _load_backend(args: argparse.Namespace, config: EngineConfig, server: GrpcServer,
                  stop: threading.Event, limits: ServingLimits) -> Backend:
    if args.replica_num == 1:
        # Stepped by `main`'s own thread (see `EngineLoop.run`).
        engine = Engine.from_config(config)
        _load_lora_modules(engine, args)
        loop = EngineLoop(engine, thread=False)
        return LocalBackend(loop, args.deployment_name)
    options = {f.name: getattr(config, f.name) for f in engine_fields()}
    devices: list[str | None] = [config.device] * args.replica_num
    tp = args.tensor_parallel or 1
    if config.device is None:
        gpus = torch.cuda.device_count()
        if gpus > 1:
            # Replica i's ranks take GPUs i*tp .. i*tp+tp-1 (its rank r uses its first GPU + r).
            devices = [f"cuda:{(i * tp) % gpus}" for i in range(args.replica_num)]
    launcher_args = ["--model", config.model or DEMO_MODEL_DIR, *engine_argv(
        {k: v for k, v in options.items() if k != "device"})]
    if args.tensor_parallel is not None:
        launcher_args += ["--tensor-parallel", str(args.tensor_parallel)]
    if args.lora_modules:
        # Every replica loads them (the engine options above carry --enable-lora and its bounds).
        launcher_args += ["--lora-modules", *(module.spec() for module in args.lora_modules)]
    # The front end counts pending sequences for the whole deployment; replicas check the other bounds
    # again (so one admitted here is admitted there) and require the same keys.
    launcher_args += limits_argv(limits, pending=False)
    replicas = start_replicas(args.replica_num, launcher_args, args.deployment_name, devices=devices,
                              timeout=args.startup_timeout, should_stop=stop.is_set, api_keys=limits.api_keys)
    try:
        info = replicas[0].stub.ModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=replicas[0].metadata)
        return ReplicaRouter(replicas, AutoTokenizer.from_pretrained(info.model_dir), report=server.set_health,
                             on_all_down=stop.set)
    except BaseException:
        for replica in replicas:  # no router owns them yet to stop them
            stop_process(replica.process)
        raise


def main(argv: list[str] | None = None) -> int:
    """Run a deployment until SIGINT/SIGTERM/Terminate; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if fastgen.serve_torchrun_rank(args.device):
        return 0  # a torchrun rank > 0: it served rank 0's engine, which owns the gRPC server
    if args.deployment_name is None:
        args.deployment_name = default_deployment_name(args.model)
    config, limits = validate(parser, args)
    try:
        args.replica_num = _planned_replicas(args, config)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    role = f"replica of pid {args.replica_of}" if args.replica_of is not None else "deployment"
    logger.info("fastgen %s %s %r: %s", fastgen.__version__, role, args.deployment_name, config)
    if args.replica_of is None:
        existing = registry.live_record(args.deployment_name)
        if existing is not None:
            raise SystemExit(f"deployment {args.deployment_name!r} is already running at {existing['host']}:"
                             f"{existing['port']} (pid {existing['pid']}); terminate it or pick another "
                             "--deployment-name")
    rest_host = args.restful_api_host or args.host
    rest = _rest_module() if args.enable_restful_api else None
    if rest is not None:
        try:
            check_port_free(rest_host, args.restful_api_port)
        except OSError as exc:
            raise SystemExit(f"REST gateway: {exc}") from None

    stop = threading.Event()
    terminated_over_grpc = threading.Event()

    def on_grpc_terminate() -> None:
        terminated_over_grpc.set()
        stop.set()

    try:
        server = GrpcServer(args.host, args.port, deployment_name=args.deployment_name, max_workers=args.grpc_workers,
                            on_terminate=on_grpc_terminate, limits=limits, tls_cert=args.tls_cert, tls_key=args.tls_key)
        server.start()
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    if not limits.requires_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s without an API key: every method (Terminate included) is open to "
                       "anyone who can reach the port; pass --api-key", args.host)

    loading = True
    draining = threading.Event()

    def drain() -> None:
        server.drain()  # the REST gateway shares its budget: it refuses and fails /health too
        logger.info("draining: admitting nothing new, %d sequences in flight, waiting up to %g s",
                    server.budget.pending, args.drain_timeout)
        if server.budget.wait_idle(args.drain_timeout):
            logger.info("drained: every admitted request finished")
        else:
            logger.warning("--drain-timeout (%g s) passed with %d sequences in flight: they are aborted",
                           args.drain_timeout, server.budget.pending)
        stop.set()

    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and not loading and args.drain_timeout > 0 and not draining.is_set():
            draining.set()
            logger.info("SIGTERM received; draining (another SIGTERM stops at once)")
            threading.Thread(target=drain, name="fastgen-drain", daemon=True).start()
            return
        logger.info("%s received; stopping", signal.Signals(signum).name)
        stop.set()
        if loading and args.replica_num == 1:
            # Break out of the model load (replicas starting up poll `stop` instead). Library code
            # may wrap the exception; any failure while `stop` is set counts as this interruption.
            raise _Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    # A replica shares the terminal's process group: Ctrl-C is its front end's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN if args.replica_of is not None else on_signal)
    backend = gateway = None
    try:
        backend = _load_backend(args, config, server, stop, limits)
        loading = False
        server.set_backend(backend)
        if rest is not None:
            tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
            gateway = _RestThread(_rest_app(rest, args, backend, stop, server), rest_host, args.restful_api_port, tls)
        _announce(args, server, rest_host)

        def should_stop() -> bool:
            if args.replica_of is not None and os.getppid() != args.replica_of:
                logger.error("the front end (pid %d) is gone; stopping", args.replica_of)
                return True
            return stop.is_set()

        if isinstance(backend, LocalBackend):
            backend.loop.run(should_stop)
            if backend.loop.fatal_error is not None:
                logger.error("the engine failed for good (%s); stopping", backend.loop.fatal_error)
                return 1
            return 0
        while not should_stop():
            stop.wait(0.2)
        return 1 if backend.all_dead else 0
    except Exception:
        if stop.is_set() and loading:
            logger.info("interrupted while loading")
            return 0
        logger.exception("the deployment failed")
        return 1
    finally:
        loading = False
        if args.replica_of is None:
            registry.remove_record(args.deployment_name, os.getpid())
        if gateway is not None:
            if terminated_over_grpc.is_set():
                # MII's client follows a gRPC Terminate with GET /terminate: answer it, as MII did.
                time.sleep(REST_GRACE_AFTER_TERMINATE_S)
            gateway.stop()
        server.stop()
        if backend is not None:
            backend.close()
            if isinstance(backend, LocalBackend):
                # Stops and reaps the tensor-parallel workers now rather than leaving them to notice we exited.
                try:
                    backend.engine.shutdown()
                except Exception:
                    logger.exception("the engine's shutdown failed")
        logger.info("stopped")


def _announce(args: argparse.Namespace, server: GrpcServer, rest_host: str) -> None:
    """Tell whoever waits for us: the ready file (replicas), the registry record, stdout."""
    if args.ready_file is not None:
        write_json_atomic(args.ready_file, {"port": server.port, "pid": os.getpid()})
    if args.replica_of is None:
        registry.write_record(args.deployment_name, {
            "name": args.deployment_name, "host": args.host, "port": server.port, "pid": os.getpid(),
            "model": args.model or DEMO_MODEL_DIR, "replica_num": args.replica_num,
            "rest": f"{connect_host(rest_host)}:{args.restful_api_port}" if args.enable_restful_api else None,
            "tls_cert": os.path.abspath(args.tls_cert) if args.tls_cert else None,
        })
    if args.enable_restful_api:
        logger.info("REST gateway on %s:%d", rest_host, args.restful_api_port)
    print(f"listening on {args.host}:{server.port}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

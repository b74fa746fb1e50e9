"""The deployment process: `python scripts/serve.py ...` or `python -m fastgen.serving.launcher ...`.

Order of start-up, so that every failure is early and clear: parse and validate the options,
bind the gRPC port (a taken port fails before any model is loaded; health says NOT_SERVING while
loading), load the engine (or start the replicas), turn health to SERVING, start the REST gateway
if asked, record the deployment, print `listening on host:port`. SIGINT, SIGTERM or a Terminate
call stop it: the record is removed, the server stops, the engine loop (or every replica) shuts
down, and the process exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from fastgen.distributed import torchrun_env
from fastgen.engine import DEMO_MODEL_DIR, Engine
from fastgen.engine_loop import EngineLoop
from fastgen.serving import registry
from fastgen.serving.backend import Backend, LocalBackend
from fastgen.serving.grpc_server import GrpcServer
from fastgen.serving.processes import check_port_free, connect_host, write_json_atomic
from fastgen.serving.proto import fastgen_v1_pb2 as pb
from fastgen.serving.replicas import ReplicaRouter, start_replicas

logger = logging.getLogger("fastgen.serving")

DEFAULT_PORT = 50050
DEFAULT_REST_PORT = 51080
_SEPARATE = {"model", "tensor_parallel", "replica_num"}  # engine fields that are deployment options here


class _Interrupted(Exception):
    """A signal arrived while the model was loading."""


def _engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in _SEPARATE]


def _kind(field: dataclasses.Field) -> str:
    """How a field is spelled on the command line: "bool", "ints" (a list), "number", "int" or "str"."""
    kind = str(field.type)
    if kind.startswith(("tuple[", "list[")):
        return "ints"
    for name in ("bool", "float", "int"):
        if name in kind:
            return "number" if name == "float" else name
    return "str"


def _flag(field: dataclasses.Field, value: bool = True) -> str:
    """The CLI flag that sets an EngineConfig field (to `value`, for a bool).

    `--no-<name>` sets a bool False (`enable_` dropped: --no-prefix-caching); `--<name>` sets it True.
    """
    name = field.name.replace("_", "-")
    if _kind(field) == "bool" and not value:
        return "--no-" + name.removeprefix("enable-")
    return "--" + name


def _number(text: str) -> int | float:
    """An int if it looks like one (bytes), else a float (a fraction)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options (EngineConfig fields; unset = the engine's default or the "
                                      "policy's choice, see fastgen.explain)")
    for field in _engine_fields():
        kind = _kind(field)
        if kind == "bool":
            # A bool that defaults to True only needs turning off; one that defaults to None (the
            # policy decides) or False can be set either way.
            for value in (True, False):
                if value != field.default:
                    group.add_argument(_flag(field, value), dest=field.name, action="store_const", const=value,
                                       default=None, help=f"EngineConfig.{field.name} = {value}")
            continue
        convert = {"ints": int, "number": _number, "int": int, "str": str}[kind]
        default = "" if field.default is None else f" (default: {field.default})"
        group.add_argument(_flag(field), dest=field.name, type=convert, default=None,
                           nargs="+" if kind == "ints" else None, help=f"EngineConfig.{field.name}{default}")


def engine_argv(options: dict[str, Any]) -> list[str]:
    """EngineConfig keywords -> the launcher flags that set them (inverse of the parser)."""
    fields = {f.name: f for f in _engine_fields()}
    argv: list[str] = []
    for name, value in options.items():
        if name not in fields:
            raise TypeError(f"unknown engine option {name!r}")
        if value is None:
            continue
        field = fields[name]
        kind = _kind(field)
        if kind == "bool":
            if value != field.default:
                argv.append(_flag(field, value))
        elif kind == "ints":
            argv += [_flag(field), *(str(v) for v in value)]
        else:
            argv += [_flag(field), str(value).removeprefix("torch.")]
    return argv


def build_parser() -> argparse.ArgumentParser:
    """The launcher's command line."""
    parser = argparse.ArgumentParser(
        prog="serve.py", description="Serve a model over gRPC (fastgen.v1 and MII's modelresponse), optionally REST.")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or cached hub id (default: the bundled demo model)")
    parser.add_argument("--host", default="0.0.0.0", help="gRPC listen address (default: all interfaces)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default: {DEFAULT_PORT})")
    parser.add_argument("--deployment-name", default=None,
                        help="name clients use (default: <model basename>-mii-deployment)")
    parser.add_argument("--tensor-parallel", type=int, default=None,
                        help="ranks per replica, one GPU each (default: the policy's choice; WORLD_SIZE under torchrun)")
    parser.add_argument("--replica-num", type=int, default=None,
                        help="engine processes behind a load balancer (default: the policy's choice, "
                             "one per tensor_parallel GPUs; 1 on a CPU)")
    parser.add_argument("--enable-restful-api", action="store_true", help="also serve REST (/mii/, OpenAI API)")
    parser.add_argument("--restful-api-host", default=None, help="REST listen address (default: --host)")
    parser.add_argument("--restful-api-port", type=int, default=DEFAULT_REST_PORT,
                        help=f"REST port (default: {DEFAULT_REST_PORT})")
    parser.add_argument("--api-key", default=None, help="bearer key the REST API requires")
    parser.add_argument("--grpc-workers", type=int, default=128, help="concurrent gRPC calls (threads)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds replicas may take to start")
    parser.add_argument("--replica-of", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    _add_engine_flags(parser)
    return parser


def default_deployment_name(model: str | None) -> str:
    """MII's default name: `<model basename>-mii-deployment`."""
    return f"{os.path.basename(os.path.normpath(model or DEMO_MODEL_DIR))}-mii-deployment"


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        parser.error(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.replica_num is not None and args.replica_num < 1:
        parser.error(f"--replica-num must be >= 1, got {args.replica_num}")
    if args.replica_of is not None and args.replica_num not in (None, 1):
        parser.error("a replica cannot have replicas")
    if not 0 <= args.port <= 65535 or not 0 <= args.restful_api_port <= 65535:
        parser.error("ports must be in [0, 65535]")
    try:
        registry.check_name(args.deployment_name)
        options = {f.name: getattr(args, f.name) for f in _engine_fields() if getattr(args, f.name) is not None}
        return EngineConfig.from_kwargs(args.model, tensor_parallel=args.tensor_parallel, **options)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def _rest_module() -> Any:
    """`fastgen.serving.rest`, or SystemExit saying why the REST gateway is not available."""
    try:
        return importlib.import_module("fastgen.serving.rest")
    except ModuleNotFoundError as exc:
        if exc.name in ("fastgen.serving.rest", "fastgen.serving"):
            raise SystemExit("--enable-restful-api: this fastgen has no REST gateway "
                             "(fastgen.serving.rest is missing)") from None
        raise SystemExit(f"--enable-restful-api needs {exc.name!r}: pip install 'fastgen[serving]'") from None


def _rest_app(rest: Any, args: argparse.Namespace, backend: Backend, stop: threading.Event) -> Any:
    """The gateway's app over the same backend; `GET /terminate` stops the deployment as Terminate does."""
    metrics = None
    if isinstance(backend, LocalBackend):
        from fastgen.serving.metrics import ServingMetrics

        metrics = ServingMetrics(backend.engine.stats)
    return rest.create_app(backend, deployment_name=args.deployment_name, tokenizer=backend.tokenizer,
                           model_name=args.model or os.path.basename(DEMO_MODEL_DIR), api_key=args.api_key,
                           max_model_len=backend.model_info().max_length, metrics=metrics, on_terminate=stop.set)


class _RestThread:
    """The REST gateway: uvicorn in a thread of this process, over the same backend."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
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
    """The policy's replica count; 1 for a replica itself and for a torchrun launch (its ranks are its GPUs)."""
    if args.replica_of is not None or torchrun_env() is not None:
        return 1
    overrides = {k: v for k, v in config.plan_overrides().items() if k != "replica_num"}
    plan = fastgen.plan_deployment(config.model or DEMO_MODEL_DIR, config.device, **overrides)
    if plan.replica_num > 1:
        logger.info("replicas: %d (%s)", plan.replica_num, plan.reasons["replica_num"])
    return plan.replica_num


def _load_backend(args: argparse.Namespace, config: EngineConfig, server: GrpcServer,
                  stop: threading.Event) -> Backend:
    if args.replica_num == 1:
        loop = EngineLoop(Engine(config))
        return LocalBackend(loop, args.deployment_name)
    options = {f.name: getattr(config, f.name) for f in _engine_fields()}
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
    replicas = start_replicas(args.replica_num, launcher_args, args.deployment_name, devices=devices,
                              timeout=args.startup_timeout, should_stop=stop.is_set)
    info = replicas[0].stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
    return ReplicaRouter(replicas, AutoTokenizer.from_pretrained(info.model_dir), report=server.set_health,
                         on_all_down=stop.set)


def main(argv: list[str] | None = None) -> int:
    """Run a deployment until SIGINT/SIGTERM/Terminate; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if fastgen.serve_torchrun_rank(args.device):
        return 0  # a torchrun rank > 0: it served rank 0's engine, which owns the gRPC server
    if args.deployment_name is None:
        args.deployment_name = default_deployment_name(args.model)
    config = _validate(parser, args)
    if args.replica_num is None:
        args.replica_num = _planned_replicas(args, config)
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
    server = GrpcServer(args.host, args.port, deployment_name=args.deployment_name, max_workers=args.grpc_workers,
                        on_terminate=stop.set)
    try:
        server.start()
    except OSError as exc:
        raise SystemExit(str(exc)) from None

    loading = True

    def on_signal(signum: int, frame: Any) -> None:
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
        backend = _load_backend(args, config, server, stop)
        loading = False
        server.set_backend(backend)
        if rest is not None:
            gateway = _RestThread(_rest_app(rest, args, backend, stop), rest_host, args.restful_api_port)
        _announce(args, server, rest_host)
        while not stop.wait(0.2):
            if args.replica_of is not None and os.getppid() != args.replica_of:
                logger.error("the front end (pid %d) is gone; stopping", args.replica_of)
                break
            if isinstance(backend, LocalBackend) and backend.loop.fatal_error is not None:
                logger.error("the engine failed for good (%s); stopping", backend.loop.fatal_error)
                return 1
        return 1 if isinstance(backend, ReplicaRouter) and backend.all_dead else 0
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
            gateway.stop()
        server.stop()
        if backend is not None:
            backend.close()
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
        })
    if args.enable_restful_api:
        logger.info("REST gateway on %s:%d", rest_host, args.restful_api_port)
    print(f"listening on {args.host}:{server.port}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""The launcher's command line: deployment, security and engine options, and their validation.

Every EngineConfig field is a flag (`--num-kv-blocks 64`, `--no-prefix-caching`). A plan field's
value is read by the field's own parser, the one `python -m fastgen.planning` uses, so both take
the same spelling (`--buckets 1,8,64`, `--cuda-graphs no`, `--speculative-config '{...}'`); `engine_argv`
turns keywords back into flags, so `fastgen.serve` and the replica front end launch processes
with the same spelling the parser reads. The key and bounds flags become one `ServingLimits`
shared by the gRPC server and the REST gateway.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from fastgen.config import EngineConfig, argument_type
from fastgen.engine import DEMO_MODEL_DIR
from fastgen.serving.deploy import registry
from fastgen.serving.http.chat.reasoning import REASONING_PARSERS
from fastgen.serving.http.chat.tool_parsers import TOOL_CALL_PARSERS
from fastgen.serving.limits import (API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS_PER_REQUEST,
                                    ServingLimits, api_keys_from_env)
from fastgen.serving.lora import LoRAModule, parse_lora_module

DEFAULT_PORT = 50050
DEFAULT_REST_PORT = 51080
DEFAULT_DRAIN_TIMEOUT_S = 30.0
"""Seconds a deployment given SIGTERM lets its requests in flight finish before it exits."""
_SEPARATE = {"model", "tensor_parallel", "replica_num"}  # engine fields that are deployment options here

SECURITY_HELP = (
    "Without --api-key (or FASTGEN_API_KEY) every method is open to anyone who can reach the port: the default "
    "--host 127.0.0.1 accepts this machine only, --host 0.0.0.0 exposes the server on every interface. With a "
    "key, every method of fastgen.v1.FastGen and modelresponse.ModelResponse (Terminate included) and every REST "
    "route but /health, /healthz, /ping, /version and /metrics (unless --protect-metrics) needs "
    "'authorization: Bearer KEY'; the gRPC health service "
    "(grpc.health.v1.Health, for load balancers) and reflection stay open.")
"""What --help says the key protects and what stays open."""


def engine_fields() -> list[dataclasses.Field]:
    """The EngineConfig fields that are engine flags (the rest are deployment options)."""
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in _SEPARATE]


def _is_plan_field(field: dataclasses.Field) -> bool:
    """Whether the field is one of the plan's (declared with its own command-line parser)."""
    return "parse" in field.metadata


def _kind(field: dataclasses.Field) -> str:
    """How a field is spelled on the command line: "bool" (a switch), "plan" (read by the plan
    field's own parser), "int" or "str"."""
    kind = str(field.type)
    if "bool" in kind:
        return "bool"
    if _is_plan_field(field):
        return "plan"
    return "int" if "int" in kind else "str"


def _flag(field: dataclasses.Field, value: bool = True) -> str:
    """The CLI flag that sets an EngineConfig field (to `value`, for a bool).

    `--no-<name>` sets a bool False (`enable_` dropped: --no-prefix-caching); `--<name>` sets it True.
    """
    name = field.name.replace("_", "-")
    if _kind(field) == "bool" and not value:
        return "--no-" + name.removeprefix("enable-")
    return "--" + name


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options (EngineConfig fields; unset = the engine's default or the "
                                      "policy's choice, see python -m fastgen.planning)")
    for field in engine_fields():
        kind = _kind(field)
        if kind == "bool":
            # A bool that defaults to True only needs turning off; one that defaults to None (the
            # policy decides) or False can be set either way. A plan switch also takes a value
            # (`--cuda-graphs no`), as `python -m fastgen.planning` does.
            for value in (True, False):
                if value == field.default:
                    continue
                if value and _is_plan_field(field):
                    group.add_argument(_flag(field, value), dest=field.name, type=argument_type(field.name),
                                       nargs="?", const=True, default=None,
                                       help=f"EngineConfig.{field.name} = true (or the value given)")
                else:
                    group.add_argument(_flag(field, value), dest=field.name, action="store_const", const=value,
                                       default=None, help=f"EngineConfig.{field.name} = {value}")
            continue
        convert = argument_type(field.name) if kind == "plan" else {"int": int, "str": str}[kind]
        default = "" if field.default is None else f" (default: {field.default})"
        group.add_argument(_flag(field), dest=field.name, type=convert, default=None,
                           help=f"EngineConfig.{field.name}{default}")


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security and limits (gRPC and REST alike)", SECURITY_HELP)
    group.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help=f"a bearer key clients must present; repeat for several (default: ${API_KEY_ENV}, "
                            "comma-separated; neither = no authentication)")
    group.add_argument("--tls-cert", default=None, metavar="FILE",
                       help="PEM certificate (chain) to serve gRPC and REST over TLS; needs --tls-key")
    group.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    group.add_argument("--max-pending-requests", type=int, default=None, metavar="N",
                       help="most sequences (prompts x n) in flight; beyond it calls get RESOURCE_EXHAUSTED "
                            "(HTTP 429) with a retry hint (default: unbounded)")
    group.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST, metavar="N",
                       help=f"most prompts in one request (default: {DEFAULT_MAX_PROMPTS_PER_REQUEST})")
    group.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, metavar="N",
                       help=f"most completions (n) per prompt (default: {DEFAULT_MAX_N})")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                       help=f"largest gRPC message / HTTP body accepted (default: {DEFAULT_MAX_BODY_BYTES}, 8 MiB)")


def engine_argv(options: dict[str, Any]) -> list[str]:
    """EngineConfig keywords -> the launcher flags that set them (inverse of the parser)."""
    fields = {f.name: f for f in engine_fields()}
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
        else:
            argv += [_flag(field), _flag_value(value)]
    return argv


def _flag_value(value: Any) -> str:
    """`value` as the text its flag's parser reads back (ints comma-separated, a dict as JSON)."""
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value).removeprefix("torch.")


def limits_argv(limits: ServingLimits, pending: bool = True) -> list[str]:
    """The flags that set `limits`' bounds (keys travel in the environment, never on a command line;
    `pending=False` leaves the pending bound out, for replicas behind a front end that enforces it)."""
    argv = ["--max-prompts-per-request", str(limits.max_prompts_per_request), "--max-n", str(limits.max_n),
            "--max-body-bytes", str(limits.max_body_bytes)]
    if pending and limits.max_pending_requests is not None:
        argv += ["--max-pending-requests", str(limits.max_pending_requests)]
    return argv


def build_parser() -> argparse.ArgumentParser:
    """The launcher's command line."""
    parser = argparse.ArgumentParser(
        prog="serve.py", description="Serve a model over gRPC (fastgen.v1 and MII's modelresponse), optionally REST. "
                                     "Without --api-key every method is open: see 'security and limits' below.")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or cached hub id (default: the bundled demo model)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="gRPC listen address (default: 127.0.0.1, this machine only; 0.0.0.0 exposes it on "
                             "every interface: set --api-key then)")
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
    parser.add_argument("--strict-params", action="store_true",
                        help="REST: refuse OpenAI request fields this server does not implement with a 400 "
                             "(default: accept and ignore them with a warning and an X-Ignored-Fields header, as vLLM)")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                        help="REST: parse tool calls out of chat replies in this format, for tool_choice auto "
                             "(hermes: <tool_call>{...}</tool_call>, as Qwen and Hermes write; llama3_json: bare JSON "
                             "calls). Without it, tool_choice auto is refused; required and named choices need none")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="REST: split a reasoning model's <think>...</think> into reasoning_content, and start "
                             "structured outputs and tool constraints after it (deepseek_r1: the reply starts "
                             "thinking; qwen3: it thinks when it opens with <think>)")
    parser.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) to load at start-up, each selected by requests whose "
                             "model is NAME; also vLLM's JSON form '{\"name\": ..., \"path\": ...}'. Needs "
                             "--enable-lora; every replica loads them; more load (on every replica) at run time with "
                             "POST /v1/load_lora_adapter")
    parser.add_argument("--protect-metrics", action="store_true",
                        help="REST: /metrics needs the API key too (default: open, for Prometheus scrapers)")
    parser.add_argument("--grpc-workers", type=int, default=128, help="concurrent gRPC calls (threads)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds replicas may take to start")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="SECONDS",
                        help="on SIGTERM, stop admitting (new requests get 503 / UNAVAILABLE, health fails) and let "
                             "the requests in flight finish for up to SECONDS before exiting; 0 stops at once, "
                             f"aborting them (default: {DEFAULT_DRAIN_TIMEOUT_S:g})")
    parser.add_argument("--replica-of", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    _add_security_flags(parser)
    _add_engine_flags(parser)
    return parser


def _lora_module(spec: str) -> LoRAModule:
    """argparse's reader of one `--lora-modules` entry (its error names the flag)."""
    try:
        return parse_lora_module(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def served_model_name(args: argparse.Namespace) -> str:
    """The name OpenAI clients send as `model` for the base model."""
    return args.model or os.path.basename(DEMO_MODEL_DIR)


def default_deployment_name(model: str | None) -> str:
    """MII's default name: `<model basename>-mii-deployment`."""
    return f"{os.path.basename(os.path.normpath(model or DEMO_MODEL_DIR))}-mii-deployment"


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[EngineConfig, ServingLimits]:
    """The engine configuration and serving limits the options ask for; `parser.error` (exit 2) naming
    the flag for a bad one."""
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        parser.error(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.replica_num is not None and args.replica_num < 1:
        parser.error(f"--replica-num must be >= 1, got {args.replica_num}")
    if args.replica_of is not None and args.replica_num not in (None, 1):
        parser.error("a replica cannot have replicas")
    if not args.drain_timeout >= 0:
        parser.error(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if not 0 <= args.port <= 65535 or not 0 <= args.restful_api_port <= 65535:
        parser.error("ports must be in [0, 65535]")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together: give both (or neither, for plain TCP)")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not os.path.isfile(path):
            parser.error(f"{flag}: no such file: {path}")
    limits = _limits(parser, args)
    names = [module.name for module in args.lora_modules]
    if len(set(names)) != len(names):
        parser.error(f"--lora-modules: an adapter name is given twice ({', '.join(names)})")
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    for module in args.lora_modules:
        if module.name == served_model_name(args):
            parser.error(f"--lora-modules {module.name}={module.path}: it is the base model's name, which selects "
                         "no adapter")
    try:
        registry.check_name(args.deployment_name)
        options = {f.name: getattr(args, f.name) for f in engine_fields() if getattr(args, f.name) is not None}
        return EngineConfig.from_kwargs(args.model, tensor_parallel=args.tensor_parallel, **options), limits
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def _limits(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServingLimits:
    try:
        keys = api_keys_from_env(args.api_key)
    except ValueError as exc:
        parser.error(f"--api-key / ${API_KEY_ENV}: {exc}")
    try:
        return ServingLimits(api_keys=keys, max_body_bytes=args.max_body_bytes,
                             max_pending_requests=args.max_pending_requests,
                             max_prompts_per_request=args.max_prompts_per_request, max_n=args.max_n)
    except ValueError as exc:
        # ServingLimits names the field (max_n); the user typed the flag (--max-n).
        name, _, rest = str(exc).partition(" ")
        parser.error(f"--{name.replace('_', '-')} {rest}")

"""MII's options, onto fastgen's keywords: `mii_options` for `pipeline` and `serve`.

MII 0.3.3 takes its configuration as keywords or as `model_config={...}` (`mii.config.ModelConfig`)
and, for `serve`, `mii_config={...}` (`mii.config.MIIConfig`, which may nest `model_config`), and
DeepSpeed's `inference_engine_config={...}` inside the model config. `mii_options` flattens all of
them onto fastgen's keywords. Every MII field is mapped, refused with the reason, or accepted with a
warning saying why it has no effect here; none is dropped silently. The README's MII section lists them.
"""

from __future__ import annotations

import dataclasses
import socket
import warnings
from collections.abc import Collection
from types import MappingProxyType
from typing import Any

from fastgen.config import EngineConfig


class MIICompatibilityWarning(UserWarning):
    """An MII option was accepted but does nothing in fastgen; the message says why and what to use."""


MII_MODEL_CONFIG_FIELDS = ("model_name_or_path", "tokenizer", "task", "tensor_parallel", "quantization_mode",
                           "inference_engine_config", "torch_dist_port", "zmq_port_number", "replica_num",
                           "replica_configs", "device_map", "max_length", "sync_debug", "profile_model_time")
"""The fields of MII 0.3.3's `ModelConfig`."""
MII_CONFIG_FIELDS = ("deployment_name", "deployment_type", "model_config", "port_number", "enable_restful_api",
                     "restful_api_host", "restful_api_port", "restful_processes", "hostfile", "version",
                     "instance_type")
"""The fields of MII 0.3.3's `MIIConfig` (deployment options: `serve` only)."""
MII_STATE_MANAGER_FIELDS = ("max_tracked_sequences", "max_ragged_batch_size", "max_ragged_sequence_count",
                            "max_context", "memory_config", "offload")
"""DeepSpeed's `inference_engine_config["state_manager"]` fields."""

_RENAMED = MappingProxyType({"max_ragged_batch_size": "token_budget", "max_ragged_sequence_count": "max_seqs"})
"""DeepSpeed-FastGen's names of our fields (also accepted as keywords and in model_config)."""

_NO_EFFECT = MappingProxyType({
    "torch_dist_port": (29500, "fastgen's tensor-parallel ranks meet through a TCP store on a free port it picks "
                               "(MASTER_PORT under torchrun)"),
    "zmq_port_number": (25555, "fastgen uses no ZMQ: rank 0 drives the other ranks through torch.distributed"),
    "sync_debug": (False, "fastgen has no synchronising debug mode; CUDA_LAUNCH_BLOCKING=1 synchronises every "
                          "kernel launch"),
    "profile_model_time": (False, "fastgen logs no per-step timings; Engine.stats(), the REST /metrics route and "
                                  "the MII replies' model_time_taken report them"),
    "restful_processes": (32, "fastgen's REST gateway is one asyncio server in the deployment process"),
    "hostfile": ("/job/hostfile", "fastgen deploys on this machine only (no DeepSpeed launcher, no other hosts)"),
    "version": (1, "it is for Azure ML deployments, which fastgen does not generate"),
    "instance_type": ("Standard_NC12s_v3", "it is for Azure ML deployments, which fastgen does not generate"),
    "max_tracked_sequences": (2048, "fastgen tracks any number of sequences (waiting ones hold no KV blocks); "
                                    "bound the sequences in flight with serve(max_pending_requests=N)"),
})
"""MII option -> (MII's default, why another value has no effect here)."""

_LOCAL_HOSTS = ("localhost", "127.0.0.1")


def _same(a: Any, b: Any) -> bool:
    # True == 1 in Python, but tensor_parallel=True is not tensor_parallel=1.
    return type(a) is type(b) and a == b


class _Options:
    """fastgen keywords gathered from several places, each remembering where it came from so a
    contradiction names both."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}

    def put(self, name: str, value: Any, source: str) -> None:
        if name in self.values and not _same(self.values[name], value):
            raise ValueError(f"{name}: {self.sources[name]} = {self.values[name]!r} contradicts {source} = "
                             f"{value!r}; give it once (or the same value)")
        self.values.setdefault(name, value)
        self.sources.setdefault(name, source)


def _where(source: str, key: str) -> str:
    return key if source == "keyword" else f"{source}[{key!r}]"


def _positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a positive int, got {value!r}")
    return value


def _no_effect(where: str, name: str, value: Any) -> None:
    default, reason = _NO_EFFECT[name]
    if not _same(value, default):
        warnings.warn(f"{where}={value!r} has no effect in fastgen: {reason}", MIICompatibilityWarning, stacklevel=2)


def _mii_dict(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{where} must be a dict, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise TypeError(f"{where} keys must be strings, got {key!r}")
    return value


def _engine_config_options(cfg: Any, where: str, out: _Options) -> None:
    """DeepSpeed's `inference_engine_config` (RaggedInferenceEngineConfig, as a dict) -> our keywords."""
    cfg = _mii_dict(where, cfg)
    sections = {"tensor_parallel": "tensor_parallel", "tp": "tensor_parallel", "state_manager": "state_manager",
                "manager": "state_manager", "quantization": "quantization"}
    for key, section in cfg.items():
        if key not in sections:
            raise TypeError(f"{where}: unknown field {key!r} (DeepSpeed's RaggedInferenceEngineConfig has "
                            "tensor_parallel, state_manager and quantization)")
        sub = _mii_dict(f"{where}[{key!r}]", section)
        at = f"{where}[{key!r}]"
        if sections[key] == "tensor_parallel":
            for name, value in sub.items():
                if name != "tp_size":
                    raise TypeError(f"{at}: unknown field {name!r} (DeepSpeed's DeepSpeedTPConfig has tp_size)")
                out.put("tensor_parallel", _positive_int(f"{at}['tp_size']", value), f"{at}['tp_size']")
        elif sections[key] == "quantization":
            for name, value in sub.items():
                if name != "quantization_mode":
                    raise TypeError(f"{at}: unknown field {name!r} (DeepSpeed's QuantizationConfig has "
                                    "quantization_mode)")
                _refuse_quantization(f"{at}['quantization_mode']", value)
        else:
            _state_manager_options(sub, at, out)


def _state_manager_options(sub: dict[str, Any], at: str, out: _Options) -> None:
    for name, value in sub.items():
        where = f"{at}[{name!r}]"
        if name in _RENAMED:
            out.put(_RENAMED[name], _positive_int(where, value), where)
        elif name == "max_context":
            out.put("max_length", _positive_int(where, value), where)
        elif name == "max_tracked_sequences":
            _no_effect(where, name, _positive_int(where, value))
        elif name == "offload":
            if value is not False:
                raise ValueError(f"{where}={value!r}: KV-cache offloading to host memory is not supported "
                                 "(DeepSpeed does not implement it either)")
        elif name == "memory_config":
            memory = _mii_dict(where, value)
            unknown = sorted(set(memory) - {"mode", "size"})
            if unknown:
                raise TypeError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} (DeepSpeed's "
                                "MemoryConfig has mode and size)")
            mode = getattr(memory.get("mode", "reserve"), "value", memory.get("mode", "reserve"))
            size = memory.get("size", 1_000_000_000)
            if mode == "allocate":
                out.put("num_kv_blocks", _positive_int(f"{where}['size']", size), f"{where}['size'] (mode 'allocate')")
            elif mode != "reserve":
                raise ValueError(f"{where}['mode'] must be 'reserve' or 'allocate', got {mode!r}")
            elif not _same(size, 1_000_000_000):
                raise ValueError(f"{where}: mode 'reserve' with size={size!r} (bytes left free after the KV cache) "
                                 "has no fastgen equivalent; size the cache with kv_cache_memory= (bytes, or a "
                                 "fraction of the memory left after the weights) or num_kv_blocks=")
        else:
            raise TypeError(f"{at}: unknown field {name!r} (DeepSpeed's DSStateManagerConfig has "
                            f"{', '.join(MII_STATE_MANAGER_FIELDS)})")


def _refuse_quantization(where: str, value: Any) -> None:
    if value is not None:
        raise ValueError(f"{where}={value!r}: fastgen has no FP6 kernels (MII's 'wf6af16' is FP6 weights); "
                         "use quantization='int8' or 'int4' (weight-only) instead")


def _device_map_options(device_map: Any, where: str, out: _Options, serving: bool) -> None:
    """MII's `device_map` -> `device` (and the tensor_parallel / replica_num it implies).

    fastgen gives a replica's ranks consecutive GPUs from its `device` on, and (serving, no device
    given) replica i the GPUs i*tp .. i*tp+tp-1: a map that says the same is mapped, another refused.
    """
    if device_map in ("auto", None):
        return
    # MII's own shorthands (ModelConfig.make_device_map_dict): 3, [0, 1], [[0], [1]].
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        device_map = {"localhost": [[device_map]]}
    elif isinstance(device_map, list) and device_map and all(isinstance(d, int) for d in device_map):
        device_map = {"localhost": [device_map]}
    elif isinstance(device_map, list):
        device_map = {"localhost": device_map}
    if not isinstance(device_map, dict):
        raise ValueError(f"{where} must be 'auto', a GPU index, a list of GPU indices, a list of such lists or "
                         f"{{host: [[GPU indices], ...]}} (MII's forms), got {device_map!r}")
    hosts = sorted(set(device_map) - {*_LOCAL_HOSTS, socket.gethostname()}, key=str)
    if hosts:
        raise ValueError(f"{where} places replicas on {', '.join(map(repr, hosts))}: fastgen deploys on this "
                         "machine only (use 'localhost')")
    slots = [slot for slots in device_map.values() for slot in slots]
    if not slots or not all(isinstance(s, list) and s and all(isinstance(g, int) and not isinstance(g, bool)
                                                             and g >= 0 for g in s) for s in slots):
        raise ValueError(f"{where}: every replica needs a non-empty list of GPU indices, got {device_map!r}")
    tp = len(slots[0])
    if any(len(s) != tp for s in slots):
        raise ValueError(f"{where}: every replica needs tensor_parallel GPUs, got lists of lengths "
                         f"{[len(s) for s in slots]}")
    out.put("tensor_parallel", tp, f"{where} ({tp} GPUs per replica)")
    if serving:
        out.put("replica_num", len(slots), f"{where} ({len(slots)} replicas)")
    elif len(slots) > 1:
        raise ValueError(f"{where} lists {len(slots)} replicas: a pipeline is one engine (replicas are a "
                         "fastgen.serve option)")
    for slot in slots:
        if slot != list(range(slot[0], slot[0] + tp)):
            raise ValueError(f"{where}: GPUs {slot} are not consecutive; fastgen gives a replica's ranks the GPUs "
                             "device, device+1, ... (renumber them with CUDA_VISIBLE_DEVICES)")
    if len(slots) == 1:
        out.put("device", f"cuda:{slots[0][0]}", f"{where} (GPU {slots[0][0]} on)")
    elif slots != [list(range(i * tp, (i + 1) * tp)) for i in range(len(slots))]:
        raise ValueError(f"{where}: fastgen places replica i on GPUs i*tensor_parallel .. and cannot place them "
                         f"as {slots}; renumber the GPUs with CUDA_VISIBLE_DEVICES")


def mii_options(model_name_or_path: str | None, model_config: dict[str, Any] | None,
                mii_config: dict[str, Any] | None, kwargs: dict[str, Any], *, serving: bool,
                native: Collection[str] = ()) -> tuple[str | None, dict[str, Any]]:
    """MII's ways of configuring `pipeline`/`serve` -> (model, fastgen keywords).

    `kwargs` are the call's keywords: fastgen's own pass through unchanged (`EngineConfig` and, for
    `serve`, its deployment options `native`, which check them), MII's are translated. `model_config`
    and `mii_config` may hold either kind; a name given twice with different values is a ValueError
    naming both places, an unknown name in a dict a TypeError. `serving` False (a pipeline) refuses
    MIIConfig's deployment fields, as MII's pipeline does.
    """
    out = _Options()
    allowed = {f.name for f in dataclasses.fields(EngineConfig)} | set(native)
    kwargs = dict(kwargs)
    if "mii_config" in kwargs and not serving:
        raise TypeError("mii_config is an MII serve() option (MIIConfig): MII's pipeline takes model_config only")
    if "all_rank_output" in kwargs:
        raise TypeError("all_rank_output is a pipeline() option (MII's serve does not take it either): a deployment "
                        "returns each answer to the client that asked")
    sources: list[tuple[str, dict[str, Any]]] = [("keyword", kwargs)]
    nested_model = None
    if mii_config is not None:
        mii_config = dict(_mii_dict("mii_config", mii_config))
        nested_model = mii_config.pop("model_config", None)
    if model_config is not None:
        sources.append(("model_config", _mii_dict("model_config", model_config)))
    if nested_model is not None:
        if model_config is not None and nested_model != model_config:
            raise ValueError("model_config and mii_config['model_config'] differ: give the model's options once")
        if model_config is None:
            sources.append(("mii_config['model_config']", _mii_dict("mii_config['model_config']", nested_model)))
    if mii_config is not None:
        sources.append(("mii_config", mii_config))

    model = model_name_or_path or None  # MII's default is "", ours None: both mean "not given here"
    if model is not None:
        out.put("model", model, "model_name_or_path")
    device_maps: list[tuple[str, Any]] = []
    tokenizers: list[tuple[str, Any]] = []
    for source, options in sources:
        for key, value in options.items():
            where = _where(source, key)
            if not serving and key in MII_CONFIG_FIELDS:
                raise TypeError(f"{where}: {key} is an MII serve() option (MIIConfig), not a pipeline option")
            if key == "model_name_or_path":
                if value:
                    out.put("model", value, where)
            elif key in ("model_config", "mii_config", "all_rank_output"):
                raise TypeError(f"{where}: {key} does not belong inside {source}")
            elif key in _RENAMED:
                out.put(_RENAMED[key], _positive_int(where, value), where)
            elif key in _NO_EFFECT:
                _no_effect(where, key, value)
            elif key == "inference_engine_config":
                _engine_config_options(value, where, out)
            elif key == "device_map":
                device_maps.append((where, value))  # after the loop: it depends on tensor_parallel and replica_num
            elif key == "tokenizer":
                tokenizers.append((where, value))  # after the loop: compared with the model, wherever it is given
            elif key == "quantization_mode":
                _refuse_quantization(where, value)
            elif key == "task":
                if value not in (None, "text-generation"):
                    raise ValueError(f"{where}={value!r}: fastgen serves text-generation only (as MII 0.3.3 does)")
            elif key == "replica_configs":
                if value not in (None, []):
                    raise ValueError(f"{where}: fastgen places replicas and picks their ports itself (replica i on "
                                     "GPUs i*tensor_parallel ..); choose GPUs with device_map or device")
            elif key == "deployment_type":
                kind = getattr(value, "value", value)
                if kind != "local":
                    raise ValueError(f"{where}={kind!r}: fastgen runs local deployments only" + (
                        " (it generates no Azure ML assets)" if kind == "aml" else
                        "; for a non-persistent model use fastgen.pipeline(...)" if kind == "non-persistent" else ""))
            elif source != "keyword" and key not in allowed | set(MII_MODEL_CONFIG_FIELDS) | set(MII_CONFIG_FIELDS):
                raise TypeError(f"{where}: unknown field {key!r} (MII's ModelConfig fields: "
                                f"{', '.join(MII_MODEL_CONFIG_FIELDS)}; MIIConfig's: {', '.join(MII_CONFIG_FIELDS)}; "
                                f"fastgen's: {', '.join(sorted(allowed - {'model'}))})")
            else:
                out.put(key, value, where)  # fastgen's own name (or MII's, where it is ours too)
    for where, tokenizer in tokenizers:
        if tokenizer is not None and tokenizer != out.values.get("model"):
            raise ValueError(f"{where}={tokenizer!r}: fastgen loads the tokenizer saved with the checkpoint; save "
                             "the one you want into the model directory")
    for where, device_map in device_maps:
        _device_map_options(device_map, where, out, serving)
    options = dict(out.values)
    return options.pop("model", None), options

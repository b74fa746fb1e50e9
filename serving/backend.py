"""What a server serves from: one local engine loop, or the replica router, behind one interface.

A backend has EngineLoop's request interface (`submit`, `submit_async`, `abort`; deltas without
the prompt text, delivered to a `RequestGroup` sink) plus what the services need besides
generation: the tokenizer, a model summary, the engine's stats (for /metrics), its LoRA adapters
(`ServedAdapters`, which both protocols' load/unload/list calls drive) and `close`. `submit_group`
(from `fastgen.engine`) runs the several prompts of one blocking call as one `RequestGroup`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import fastgen
from fastgen.engine import EngineLoop, Member, Sink
from fastgen.sampling_params import SamplingParams

Prompt = str | list[int]
"""One engine request's prompt: text or token ids."""


class BackendUnavailable(RuntimeError):
    """The backend cannot take or finish a request now (loading, shut down, replica gone)."""


class LoRAStateError(ValueError):
    """An adapter cannot be unloaded now: unfinished requests use it (HTTP 409, gRPC FAILED_PRECONDITION)."""


NO_LORA = "this server serves no LoRA adapters: start it with --enable-lora"
"""Why a deployment without LoRA refuses to load an adapter."""
LORA_STATS = ("lora_running", "lora_waiting", "lora_max_loras")
"""The keys of `Engine.stats()` that describe LoRA use (what vllm:lora_requests_info shows)."""


class ServedAdapters(abc.ABC):
    """The LoRA adapters a backend serves: which names select one, and loading and unloading them.

    The calls block (the REST routes run them on a worker thread). A load is all or nothing: a bad
    adapter raises ValueError naming the problem and leaves nothing loaded anywhere.
    """

    @abc.abstractmethod
    def paths(self) -> dict[str, str]:
        """The loaded adapters: name -> PEFT directory."""

    def __contains__(self, name: object) -> bool:
        """Whether requests naming `name` run under an adapter (what the routes check a `model` against)."""
        return isinstance(name, str) and name in self.paths()

    @abc.abstractmethod
    def load(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name`; ValueError naming the problem (nothing loaded)."""

    @abc.abstractmethod
    def unload(self, name: str) -> None:
        """Unload adapter `name`; `UnknownLoRAError` when none is loaded, `LoRAStateError` while requests use it."""

    @abc.abstractmethod
    def usage(self) -> dict[str, Any]:
        """`LORA_STATS`: the adapters running and waiting requests use, and `max_loras`; empty without LoRA."""


class EngineAdapters(ServedAdapters):
    """The adapters of the engine an `EngineLoop` steps. Only the loop's thread may change the engine,
    so loads and unloads run there between steps (`EngineLoop.call`); a request naming an adapter is
    checked again when the loop queues it, so one unloaded meanwhile is refused cleanly, never half-run.
    Without a loop, or for an engine built without `enable_lora`, it serves none and refuses loads."""

    def __init__(self, loop: EngineLoop | None) -> None:
        self._loop = loop if loop is not None and loop.engine.lora is not None else None

    def paths(self) -> dict[str, str]:
        """The loaded adapters: name -> directory."""
        # dict() copies under the GIL in one step, so a load on the loop thread cannot break it midway.
        return {} if self._loop is None else {n: a.path for n, a in dict(self._loop.engine.lora.adapters).items()}

    def _engine_call(self, function: Callable[[Any], Any]) -> None:
        """Run `function(engine)` on the loop's thread and wait for it (its exception raised here)."""
        if self._loop is None:
            raise ValueError(NO_LORA)
        self._loop.call(function).result()

    def load(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name`; ValueError naming the problem (nothing loaded)."""
        self._engine_call(lambda engine: engine.load_lora(name, path))

    def unload(self, name: str) -> None:
        """Unload adapter `name`; `UnknownLoRAError` when none is loaded, `LoRAStateError` while requests use it."""

        def unload(engine: Any) -> None:
            engine.lora_id(name)  # UnknownLoRAError first: the only ValueError left below is "in use"
            try:
                engine.unload_lora(name)
            except ValueError as exc:
                raise LoRAStateError(str(exc)) from None

        self._engine_call(unload)

    def usage(self) -> dict[str, Any]:
        """`LORA_STATS` from the engine's stats; empty without LoRA."""
        if self._loop is None:
            return {}
        stats = self._loop.engine.stats()
        return {key: stats[key] for key in LORA_STATS}


@dataclasses.dataclass
class ReplicaInfo:
    """One replica behind the replica router, as `ModelInfo` lists it."""

    index: int
    address: str
    healthy: bool
    in_flight: int
    num_requests: int
    pid: int
    status: str


@dataclasses.dataclass
class ModelInfo:
    """What a backend serves: the model, the engine's plan and configuration, and its replicas (each
    protocol renders it its own way: gRPC's `ModelInfoResponse`)."""

    deployment_name: str
    model_dir: str
    model_type: str
    max_length: int
    """Longest prompt + output a request may have."""
    vocab_size: int
    dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    token_budget: int
    max_seqs: int
    enable_prefix_caching: bool
    engine_config: dict[str, str]
    """Every EngineConfig field, as text."""
    plan: dict[str, str]
    """The policy's plan: field -> value."""
    plan_reasons: dict[str, str]
    """Field -> why the plan has that value."""
    version: str
    in_flight: int
    """Requests being generated now."""
    replicas: list[ReplicaInfo] = dataclasses.field(default_factory=list)
    """Empty for a single engine; one entry per replica behind the router."""


class Backend(Protocol):
    """The interface the gRPC services (and the REST gateway) drive."""

    tokenizer: Any

    def submit(self, prompt: Prompt, params: SamplingParams | None, deliver: Sink,
               lora: str | None = None) -> Member: ...

    async def submit_async(self, prompt: Prompt, params: SamplingParams | None, deliver: Sink,
                           lora: str | None = None) -> Member: ...

    def abort(self, request_id: str) -> None: ...

    def model_info(self) -> ModelInfo: ...

    def stats(self) -> Mapping[str, Any]: ...

    adapters: ServedAdapters

    def close(self) -> None: ...


class LocalBackend:
    """One engine in this process, stepped by an `EngineLoop`."""

    def __init__(self, loop: EngineLoop, deployment_name: str = "") -> None:
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        self.deployment_name = deployment_name
        self.submit = loop.submit
        self.submit_async = loop.submit_async
        self.abort = loop.abort
        self.stats = loop.engine.stats
        self.adapters = EngineAdapters(loop)

    def model_info(self) -> ModelInfo:
        """The served model, the engine's plan and its configuration."""
        engine = self.engine
        plan = engine.plan
        config = engine.config
        return ModelInfo(
            deployment_name=self.deployment_name, model_dir=str(engine.model_dir),
            model_type=engine.model_config.model_type, max_length=engine.max_model_len,
            vocab_size=engine.vocab_size, dtype=_text(engine.dtype), device=str(engine.device),
            block_size=engine.block_size, num_kv_blocks=engine.block_manager.num_blocks,
            token_budget=plan.token_budget, max_seqs=plan.max_seqs,
            enable_prefix_caching=config.enable_prefix_caching,
            engine_config={f.name: _text(getattr(config, f.name)) for f in dataclasses.fields(config)},
            plan={name: _text(value) for name, value in plan.engine_kwargs().items()},
            plan_reasons=dict(plan.reasons),
            version=fastgen.__version__, in_flight=len(engine.requests),
        )

    def close(self) -> None:
        """Abort everything and stop the engine loop."""
        self.loop.shutdown()


def served_adapters(backend: Any) -> ServedAdapters:
    """The adapters of `backend`: a backend's own (`LocalBackend`, the replica router), an `EngineLoop`'s,
    or none for anything else (None included)."""
    adapters = getattr(backend, "adapters", None)
    if isinstance(adapters, ServedAdapters):
        return adapters
    return EngineAdapters(backend if isinstance(backend, EngineLoop) else None)


def _text(value: Any) -> str:
    """A config or plan value as ModelInfo shows it (dtypes without the `torch.` prefix)."""
    return str(value).removeprefix("torch.")

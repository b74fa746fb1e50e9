"""What a server serves from: one local engine loop, or the replica router, behind one interface.

A backend has EngineLoop's request interface (`submit`, `submit_async`, `abort`; deltas without
the prompt text, delivered to a `RequestGroup` sink) plus what the services need besides
generation: the tokenizer, a model summary and `close`. `submit_group` (from `fastgen.engine`) runs
the several prompts of one blocking call as one `RequestGroup`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import fastgen
from fastgen.engine import EngineLoop, Member, Sink
from fastgen.sampling_params import SamplingParams

Prompt = str | list[int]
"""One engine request's prompt: text or token ids."""


class BackendUnavailable(RuntimeError):
    """The backend cannot take or finish a request now (loading, shut down, replica gone)."""


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


def _text(value: Any) -> str:
    """A config or plan value as ModelInfo shows it (dtypes without the `torch.` prefix)."""
    return str(value).removeprefix("torch.")

"""The LoRA adapters a deployment serves: `--lora-modules` specs, and loading, unloading and listing
adapters on a running engine from the servers' threads.

Only the engine loop's thread may change the engine, so loads and unloads run there between steps
(`EngineLoop.call`); a request naming an adapter is checked again when the loop queues it, so one
unloaded meanwhile is refused cleanly, never half-run.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from fastgen.engine import EngineLoop


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One `--lora-modules` entry: an adapter's served name and its PEFT directory."""

    name: str
    path: str


def parse_lora_module(spec: str) -> LoRAModule:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}` (its
    `base_model_name` is accepted and unused: the adapter's parent is the served model); ValueError
    naming the problem."""
    text = spec.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{spec!r} is not valid JSON: {exc}") from None
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"{spec!r}: unknown key(s) {', '.join(unknown)} (expected name, path, base_model_name)")
        name, path = entry.get("name"), entry.get("path")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{spec!r} is neither name=path nor a JSON object")
    for key, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{spec!r}: the adapter's {key} must be a non-empty string")
    return LoRAModule(name.strip(), path.strip())


class LoRAStateError(ValueError):
    """An adapter cannot be unloaded now: running requests use it (HTTP 409)."""


class ServedAdapters:
    """The adapters of the engine behind `backend`, for the routes: which model names select one, and
    loading or unloading them on the engine loop's thread. A backend without a local engine with LoRA
    (a replica router, `enable_lora` off) serves none and refuses loads."""

    def __init__(self, backend: Any) -> None:
        """Adapters of `backend`: an `EngineLoop`, or a backend with one (`LocalBackend.loop`)."""
        loop = backend if isinstance(backend, EngineLoop) else getattr(backend, "loop", None)
        self._loop = loop if loop is not None and getattr(loop.engine, "lora", None) is not None else None

    def paths(self) -> dict[str, str]:
        """The loaded adapters: name -> directory."""
        # dict() copies under the GIL in one step, so a load on the loop thread cannot break it midway.
        return {} if self._loop is None else {n: a.path for n, a in dict(self._loop.engine.lora.adapters).items()}

    def __contains__(self, name: object) -> bool:
        return self._loop is not None and name in self._loop.engine.lora.adapters

    def _refuse_unless_enabled(self) -> None:
        if self._loop is None:
            raise ValueError("this server serves no LoRA adapters: start it with --enable-lora (and --replica-num 1)")

    async def load(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name`; ValueError naming the problem (nothing loaded)."""
        self._refuse_unless_enabled()
        await asyncio.wrap_future(self._loop.call(lambda engine: engine.load_lora(name, path)))

    async def unload(self, name: str) -> None:
        """Unload adapter `name`; `UnknownLoRAError` when none is loaded, `LoRAStateError` while requests use it."""
        self._refuse_unless_enabled()

        def unload(engine: Any) -> None:
            engine.lora_id(name)  # UnknownLoRAError first: the only ValueError left below is "in use"
            try:
                engine.unload_lora(name)
            except ValueError as exc:
                raise LoRAStateError(str(exc)) from None

        await asyncio.wrap_future(self._loop.call(unload))

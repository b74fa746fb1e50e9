"""The LoRA adapters a deployment starts with: `--lora-modules` specs (and the Ray app's `lora_modules`).

Loading, unloading and listing adapters at run time is the backend's (`fastgen.serving.backend`'s
`ServedAdapters`: one engine loop's, or the replica router's over every replica), which the gRPC and
REST services share.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from fastgen.engine import Engine


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One `--lora-modules` entry: an adapter's served name and its PEFT directory."""

    name: str
    path: str

    def spec(self) -> str:
        """The entry as `--lora-modules` reads it back (vLLM's JSON form: any name or path survives)."""
        return json.dumps({"name": self.name, "path": self.path})


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


def load_lora_modules(engine: Engine, modules: Iterable[LoRAModule], option: str) -> None:
    """Load each of `modules` into `engine` at start-up; for one that fails, shut the engine down and
    raise ValueError naming the entry as the `option` that gave it (`--lora-modules`, `lora_modules`)."""
    for module in modules:
        try:
            engine.load_lora(module.name, module.path)
        except ValueError as exc:
            engine.shutdown()
            raise ValueError(f"{option} {module.name}={module.path}: {exc}") from None

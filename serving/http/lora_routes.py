"""vLLM's dynamic LoRA routes: `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`) and
`POST /v1/unload_lora_adapter` (`{"lora_name"}`), behind the API key like every other route.

Success is a 200 with a one-line text, as vLLM answers. A bad adapter (missing, corrupt, rank over
`max_lora_rank`, a name already loaded) is a 400 naming the problem, and nothing is loaded; unloading
a name not loaded is a 404, unloading one that unfinished requests use a 409 (they are never broken).
Behind the replica router a load or unload reaches every replica, or none (`ReplicaAdapters`); a
replica that cannot be reached is a 503.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from fastgen.engine import UnknownLoRAError
from fastgen.serving.backend import BackendUnavailable, LoRAStateError, ServedAdapters
from fastgen.serving.http.guard import ApiError, Offload, read_json_object

__all__ = ["add_lora_routes", "adapter_cards"]


def adapter_cards(adapters: ServedAdapters, model_name: str) -> list[dict[str, Any]]:
    """`/v1/models` cards of the loaded adapters: `root` their directory, `parent` the base model (as vLLM)."""
    return [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "fastgen", "root": path,
             "parent": model_name} for name, path in sorted(adapters.paths().items())]


def _field(body: dict[str, Any], name: str) -> str:
    """The body's non-empty string field `name`, or a 400 naming it."""
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{name} must be a non-empty string, got {value!r}", param=name)
    return value


def _unavailable(exc: BackendUnavailable) -> ApiError:
    """The 503 for a load or unload the engine (or a replica) could not take now."""
    return ApiError(503, f"the engine is not available: {exc}", code="engine_unavailable")


def add_lora_routes(router: APIRouter, adapters: ServedAdapters, offload: Offload, model_name: str) -> None:
    """Add the load and unload routes over `adapters` to `router` (no adapter may take the base's `model_name`)."""

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json_object(request, offload)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if name == model_name:
            raise ApiError(400, f"lora_name {name!r} is the base model's name: requests naming it could not "
                                "select the adapter", param="lora_name")
        try:
            await asyncio.to_thread(adapters.load, name, path)
        except BackendUnavailable as exc:
            raise _unavailable(exc) from None
        except ValueError as exc:
            raise ApiError(400, f"cannot load LoRA adapter {name!r}: {exc}", param="lora_path",
                           code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json_object(request, offload)
        name = _field(body, "lora_name")
        try:
            await asyncio.to_thread(adapters.unload, name)
        except BackendUnavailable as exc:
            raise _unavailable(exc) from None
        except UnknownLoRAError as exc:
            raise ApiError(404, str(exc), param="lora_name", code="lora_adapter_not_found") from None
        except LoRAStateError as exc:
            raise ApiError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

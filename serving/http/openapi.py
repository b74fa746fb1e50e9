"""The gateway's OpenAPI document: FastAPI's own, with the request bodies from their pydantic models.

Routes read their bodies themselves (bounded in size, parsed safely off the event loop, then
validated as their `request_models` model), so FastAPI cannot see the body parameters;
`install_openapi` puts each model's JSON schema in as its route's request body, adds the bearer-key
scheme and the OpenAI error shape for every error status. The models carry this server's own
bounds (the served model, `n`, prompts per request, the context), so a client or a fuzzer aimed at
the schema meets the rules the routes enforce.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from fastgen.serving.http.request_models import REF_TEMPLATE, RequestModels
from fastgen.serving.limits import ServingLimits

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERROR_STATUSES = {"400": "Invalid request: the message names the field", "401": "Missing or wrong API key",
                   "403": "A browser's cross-site request to /terminate",
                   "404": "Unknown model, deployment or route", "413": "Body over the server's max_body_bytes",
                   "429": "Server at its limit of pending sequences (see Retry-After)",
                   "500": "The engine failed this request", "503": "The engine is not running"}


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    components.update(schema.pop("$defs", {}))
    return schema


def install_openapi(app: FastAPI, models: RequestModels, *, deployment_name: str, limits: ServingLimits,
                    public_paths: frozenset[str] = frozenset({"/health", "/healthz"})) -> None:
    """Make `app.openapi()` (served at `/openapi.json`) describe the request bodies (from `models`)
    and errors; `public_paths` need no key."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {})
        defined = components.setdefault("schemas", {})
        defined["Error"] = copy.deepcopy(_ERROR)
        bodies = {
            "/v1/completions": _schema(models.completion, defined),
            "/v1/chat/completions": _schema(models.chat, defined),
            "/mii/{name}": _schema(models.mii, defined),
            "/tokenize": {"oneOf": [_schema(models.tokenize, defined), _schema(models.tokenize_chat, defined)]},
            "/detokenize": _schema(models.detokenize, defined),
        }
        error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
        if limits.requires_key:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in schema.get("paths", {}).items():
            for method, operation in item.items():
                operation.get("responses", {}).pop("422", None)  # FastAPI's own validation never runs here
                if path == "/mii/{name}":
                    for parameter in operation.get("parameters", ()):
                        if parameter.get("name") == "name":
                            parameter["schema"] = {"type": "string", "enum": [deployment_name]}
                if path in bodies and method == "post":
                    operation["requestBody"] = {"required": True,
                                                "content": {"application/json": {"schema": bodies[path]}}}
                if path in public_paths:
                    continue
                if limits.requires_key:
                    operation["security"] = [{"bearer": []}]
                for status, description in _ERROR_STATUSES.items():
                    operation.setdefault("responses", {}).setdefault(
                        status, {"description": description, "content": error_ref})
        components["schemas"].pop("HTTPValidationError", None)
        components["schemas"].pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

"""The gateway's OpenAPI document: FastAPI's own, plus the request bodies the routes parse by hand.

Routes read their bodies themselves (so every bad field gets an OpenAI-shaped 400 naming it), so
FastAPI cannot infer them; `install_openapi` adds a JSON schema per body, the bearer-key scheme,
and the OpenAI error shape for every error status. The schemas state this server's own bounds
(the served model, `n`, prompts per request, the context), so a client or a fuzzer aimed at them
meets the same rules the routes enforce.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from fastgen.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams
from fastgen.serving.limits import ServingLimits

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERROR_STATUSES = {"400": "Invalid request: the message names the field", "401": "Missing or wrong API key",
                   "404": "Unknown model, deployment or route", "413": "Body over the server's max_body_bytes",
                   "429": "Server at its limit of pending sequences (see Retry-After)",
                   "500": "The engine failed this request", "503": "The engine is not running"}


def _int(low: int, high: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "minimum": low}
    if high is not None:
        schema["maximum"] = high
    return schema


def _sampling(limits: ServingLimits) -> dict[str, Any]:
    """The sampling fields the OpenAI routes share with SamplingParams."""
    stop_text = {"type": "string", "minLength": 1}
    token_ids = {"type": "array", "items": _int(0)}
    return {
        "n": _int(1, limits.max_n),
        "stop": {"anyOf": [stop_text, {"type": "array", "items": stop_text}]},
        "seed": _int(0, MAX_SEED),
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "top_k": _int(0),
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
        "ignore_eos": {"type": "boolean"},
        "stop_token_ids": token_ids,
        "min_tokens": _int(0),
        "user": {"type": "string"},
        "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "allowed_token_ids": {**token_ids, "minItems": 1},
        "bad_words": {"type": "array", "items": stop_text},
        "skip_special_tokens": {"type": "boolean"},
        "spaces_between_special_tokens": {"type": "boolean"},
        "include_stop_str_in_output": {"type": "boolean"},
        "truncate_prompt_tokens": {"anyOf": [_int(1), {"const": -1}]},
        "prompt_logprobs": _int(0, MAX_LOGPROBS),
        "priority": _int(-2**31, 2**31 - 1),
        "request_id": {"type": "string", "minLength": 1, "maxLength": 256},
        "return_tokens_as_token_ids": {"type": "boolean"},
        "add_special_tokens": {"type": "boolean"},
        "echo": {"type": "boolean"},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "additionalProperties": False,
                           "properties": {"include_usage": {"type": "boolean"},
                                          "continuous_usage_stats": {"type": "boolean"}}},
        "use_beam_search": {"type": "boolean", "enum": [False]},
    }


def _prompt_schema(limits: ServingLimits, max_prompt_chars: int | None, token_ids: bool) -> dict[str, Any]:
    text: dict[str, Any] = {"type": "string", "minLength": 1}
    if max_prompt_chars is not None:
        text["maxLength"] = max_prompt_chars
    ids = {"type": "array", "minItems": 1, "items": _int(0)}
    forms: list[dict[str, Any]] = [text, {"type": "array", "minItems": 1, "maxItems": limits.max_prompts_per_request,
                                          "items": text}]
    if token_ids:
        forms += [ids, {"type": "array", "minItems": 1, "maxItems": limits.max_prompts_per_request, "items": ids}]
    return {"anyOf": forms}


def completion_body(model_name: str, limits: ServingLimits, max_model_len: int | None,
                    max_prompt_chars: int | None, strict_params: bool = True) -> dict[str, Any]:
    """JSON schema of a `/v1/completions` body (`strict_params`: no fields beyond these)."""
    return {
        "type": "object", "required": ["model", "prompt"], "additionalProperties": not strict_params,
        "properties": {
            "model": {"type": "string", "enum": [model_name]},
            "prompt": _prompt_schema(limits, max_prompt_chars, token_ids=True),
            # 0 only with echo: the prompt alone comes back (with its logprobs).
            "max_tokens": _int(0, max_model_len), **_sampling(limits),
            "logprobs": _int(0, MAX_LOGPROBS), "best_of": _int(1, limits.max_n),
            "suffix": {"type": "string", "maxLength": 0},
        },
    }


def _messages() -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"],
               "properties": {"role": {"type": "string", "minLength": 1},
                              "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]},
                              "name": {"type": "string"}}}
    return {"type": "array", "minItems": 1, "items": message}


_CHAT_TEMPLATE_OPTIONS = {"add_generation_prompt": {"type": "boolean"}, "continue_final_message": {"type": "boolean"},
                          "chat_template_kwargs": {"type": "object"}}


def chat_body(model_name: str, limits: ServingLimits, max_model_len: int | None,
              strict_params: bool = True) -> dict[str, Any]:
    """JSON schema of a `/v1/chat/completions` body (`strict_params`: no fields beyond these)."""
    return {
        "type": "object", "required": ["model", "messages"], "additionalProperties": not strict_params,
        "properties": {
            "model": {"type": "string", "enum": [model_name]},
            "messages": _messages(),
            "max_tokens": _int(1, max_model_len), "max_completion_tokens": _int(1, max_model_len),
            **_sampling(limits), **_CHAT_TEMPLATE_OPTIONS,
            "logprobs": {"type": "boolean"}, "top_logprobs": _int(0, MAX_LOGPROBS),
            "tools": {"type": "array", "maxItems": 0}, "functions": {"type": "array", "maxItems": 0},
            "tool_choice": {"type": "string", "enum": ["none", "auto"]},
            "response_format": {"type": "object", "required": ["type"], "additionalProperties": False,
                                "properties": {"type": {"type": "string", "enum": ["text"]}}},
            "parallel_tool_calls": {"type": "boolean"}, "store": {"type": "boolean"},
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            "service_tier": {"type": "string"},
        },
    }


def tokenize_body(model_name: str, max_prompt_chars: int | None) -> dict[str, Any]:
    """JSON schema of a `/tokenize` body: vLLM's completion form (`prompt`) or chat form (`messages`)."""
    text: dict[str, Any] = {"type": "string"}
    if max_prompt_chars is not None:
        text["maxLength"] = max_prompt_chars
    common = {"model": {"type": "string", "enum": [model_name]}, "add_special_tokens": {"type": "boolean"},
              "return_token_strs": {"type": "boolean"}}
    return {"oneOf": [
        {"type": "object", "required": ["prompt"], "properties": {**common, "prompt": text}},
        {"type": "object", "required": ["messages"],
         "properties": {**common, "messages": _messages(), **_CHAT_TEMPLATE_OPTIONS}},
    ]}


def detokenize_body(model_name: str) -> dict[str, Any]:
    """JSON schema of a `/detokenize` body."""
    return {"type": "object", "required": ["tokens"],
            "properties": {"model": {"type": "string", "enum": [model_name]},
                           "tokens": {"type": "array", "items": _int(0)}}}


def mii_body(limits: ServingLimits, max_model_len: int | None, max_prompt_chars: int | None) -> dict[str, Any]:
    """JSON schema of a `/mii/{deployment}` body: `prompts` plus SamplingParams' fields by name (MII's)."""
    sampling = _sampling(limits)
    typed = {
        "max_length": _int(1, max_model_len), "max_new_tokens": _int(1, max_model_len), "min_new_tokens": _int(0),
        "do_sample": {"type": "boolean"}, "return_full_text": {"type": "boolean"}, "logprobs": _int(0, MAX_LOGPROBS),
        **{k: sampling[k] for k in ("n", "stop", "seed", "temperature", "top_p", "presence_penalty",
                                    "frequency_penalty", "top_k", "repetition_penalty", "ignore_eos",
                                    "stop_token_ids")},
    }
    # A field SamplingParams gained later is still documented, by name, until it is typed here.
    fields = {name: typed.get(name, {}) for name in SamplingParams.field_names()}
    return {"type": "object", "required": ["prompts"], "additionalProperties": False,
            "properties": {"prompts": _prompt_schema(limits, max_prompt_chars, token_ids=False), **fields}}


def install_openapi(app: FastAPI, *, model_name: str, deployment_name: str, limits: ServingLimits,
                    max_model_len: int | None, max_prompt_chars: int | None,
                    public_paths: frozenset[str] = frozenset({"/health", "/healthz"}),
                    strict_params: bool = True) -> None:
    """Make `app.openapi()` (served at `/openapi.json`) describe the hand-parsed bodies and errors;
    `public_paths` need no key, and `strict_params` says whether OpenAI bodies refuse unknown fields."""
    bodies = {
        "/v1/completions": completion_body(model_name, limits, max_model_len, max_prompt_chars, strict_params),
        "/v1/chat/completions": chat_body(model_name, limits, max_model_len, strict_params),
        "/mii/{name}": mii_body(limits, max_model_len, max_prompt_chars),
        "/tokenize": tokenize_body(model_name, max_prompt_chars),
        "/detokenize": detokenize_body(model_name),
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {})
        components.setdefault("schemas", {})["Error"] = copy.deepcopy(_ERROR)
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

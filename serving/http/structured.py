"""The OpenAI and vLLM ways of asking for structured output, as one `structured_outputs` spec.

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `strict`), vLLM's
`structured_outputs` extra and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` fields all become the dict `SamplingParams.structured_outputs` takes; the engine's
grammar backend then validates the constraint itself when the request is prepared (an invalid schema,
regex or grammar is a 400 naming the field and the compiler's message, before anything is queued).
"""

from __future__ import annotations

from typing import Any

from fastgen.serving.http.guard import ApiError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
"""vLLM's older per-kind fields -> the `structured_outputs` key each sets."""


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                       param="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object with name and schema",
                       param="response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "response_format.json_schema.name must be a non-empty string", param="response_format")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object", param="response_format")
    if spec.get("strict") not in (None, True, False):
        raise ApiError(400, "response_format.json_schema.strict must be a boolean", param="response_format")
    # strict or not, the output is constrained to the schema: a grammar cannot follow it "loosely".
    return {"json": schema}


def structured_outputs_of(request: Any) -> dict[str, Any] | None:
    """The request's constraint as `SamplingParams.structured_outputs` takes it, or None. Asking for
    it two ways at once is a 400 naming the second."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    extra = getattr(request, "structured_outputs", None)
    if extra is not None:
        if not isinstance(extra, dict):
            raise ApiError(400, "structured_outputs must be an object (vLLM's keys: json, regex, choice, grammar, "
                                "json_object, ...)", param="structured_outputs")
        found.append(("structured_outputs", dict(extra)))
    guided = {key: getattr(request, field) for field, key in GUIDED_FIELDS.items()
              if getattr(request, field, None) is not None}
    if guided:
        found.append((next(f for f, k in GUIDED_FIELDS.items() if k in guided), guided))
    if len(found) > 1:
        raise ApiError(400, f"{found[1][0]} and {found[0][0]} both ask for structured output: use one",
                       param=found[1][0])
    return found[0][1] if found else None

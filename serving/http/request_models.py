"""The REST request bodies as pydantic models: what each field may hold, for validation and for `/openapi.json`.

`RequestModels.build` makes them per app, since their bounds are the deployment's own (the served
model's name, `n` up to `ServingLimits.max_n`, prompts per request, the longest prompt text). Every
sampling field's type and range is derived from its one declaration on `SamplingParams`
(`sampling_field`), which gRPC requests meet too when their `SamplingParams` is built.

Types are strict where JSON clients differ from Python: a bool is never a number, a string never
a number or a bool, a whole float (`50.0`) is an int, and NaN/Infinity are refused. A field this
server does not know is kept aside (`model_extra`) to be ignored with a warning, or refused with a
400 under `--strict-params`; a known feature this server lacks (beam search, the deprecated
`functions`, ...) is accepted only at its "off" value. Structured-output and tool fields are typed
loosely here and checked by `structured.structured_outputs_of`, `tools.tool_plan` and the engine's
grammar backend. `prompt` and `messages` are described here but
checked by `fastgen.api.normalise_prompts` and `chat.chat_conversation`, whose errors name the
offending prompt or message. `validate` turns the first error into an OpenAI-shaped 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StringConstraints, TypeAdapter, \
    ValidationError, WithJsonSchema, create_model, model_validator

from fastgen.sampling_params import Bounds, SamplingParams, field_bounds, field_kind
from fastgen.serving.http.guard import ApiError
from fastgen.serving.limits import ServingLimits

MAX_REQUEST_ID = 256
"""Longest `request_id` a caller may name its request with."""

REF_TEMPLATE = "#/components/schemas/{model}"
"""Where the OpenAPI document keeps the schemas the request bodies refer to."""


def _describe(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _whole(value: Any) -> Any:
    # bool is an int subclass, but `top_k: true` is a caller's mistake; JSON clients send whole numbers as floats.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be an integer, got {_describe(value)}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"must be an integer, got {value!r} (not a whole number)")
        return int(value)
    return value


def _real(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {_describe(value)}")
    return value


Text = Annotated[str, StringConstraints(min_length=1)]


def bounded(kind: type, bounds: Bounds | None, high: float | None = None) -> Any:
    """An int or float annotation limited to `bounds` (and to `high`, a server's own tighter bound)."""
    # annotated_types' constraints (not Field's) hold wherever the annotation is nested: in a union, a list.
    constraints: list[Any] = []
    if bounds is not None and bounds.low is not None:
        constraints.append(annotated_types.Gt(bounds.low) if bounds.low_open else annotated_types.Ge(bounds.low))
    top = bounds.high if bounds is not None else None
    if high is not None:
        top = high if top is None else min(high, top)
    if top is not None:
        constraints.append(annotated_types.Le(top))
    # The constraints go on the plain type, inside the strictness check, so the schema shows them as bounds.
    return Annotated[kind, *constraints, BeforeValidator(_whole if kind is int else _real)]


_ID_OR_WHOLE = Annotated[int, annotated_types.Ge(-1), BeforeValidator(_whole)]
"""`truncate_prompt_tokens` on OpenAI's routes: -1 is vLLM's "the whole context"."""


def sampling_annotation(name: str, limits: ServingLimits) -> Any:
    """The annotation of `SamplingParams` field `name` on the wire, from its declaration."""
    kind = field_kind(name)
    if kind is bool:
        return StrictBool
    if kind is not None:
        return bounded(kind, field_bounds(name), limits.max_n if name == "n" else None)
    hint = typing.get_type_hints(SamplingParams)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    origin, inner = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict:  # logit_bias: JSON keys are strings of digits
        return dict[Annotated[str, StringConstraints(pattern=r"^[0-9]+$")],
                    bounded(float, field_bounds(name, items=True))]
    if origin is tuple and inner and inner[0] is str:  # words: one or a list
        return Text | list[Text]
    if origin is tuple and inner and inner[0] is int:  # token ids
        return list[bounded(int, field_bounds(name, items=True))]
    return Any  # a field of another shape: SamplingParams checks it (a 400 naming it), the schema says nothing


def _nothing(what: str) -> tuple[Any, str]:
    return None, what


_OFF_ONLY: dict[str, tuple[Any, str]] = {
    "use_beam_search": (Literal[False], "no beam search"),
    "logits_processors": (Annotated[list[Any], annotated_types.MaxLen(0)], "no custom logits processors"),
    "prompt_embeds": _nothing("prompts are text or token ids"),
    "logprob_token_ids": _nothing("logprobs are of the top tokens (logprobs / top_logprobs)"),
}
_COMPLETION_OFF_ONLY = {"suffix": (Annotated[str, annotated_types.MaxLen(0)],
                                    "no insertion (fill-in-the-middle) support")}
_CHAT_OFF_ONLY = {
    "functions": (Annotated[list[Any], annotated_types.MaxLen(0)], "the deprecated functions; use tools"),
    "function_call": (Literal["none", "auto"], "the deprecated function_call; use tool_choice"),
    "chat_template": _nothing("the checkpoint's own chat template is used (a request's template is not trusted)"),
}
NOT_SUPPORTED = {name: what for name, (_, what) in {**_OFF_ONLY, **_COMPLETION_OFF_ONLY, **_CHAT_OFF_ONLY}.items()}
"""Field -> what this server lacks, for the 400 refusing any value of it but "off"."""

STRUCTURED_FIELDS: dict[str, Any] = {
    "response_format": dict[str, Any], "structured_outputs": dict[str, Any], "guided_json": dict[str, Any] | str,
    "guided_regex": Text, "guided_choice": list[Text], "guided_grammar": Text,
}
"""The ways of asking for structured output (`serving/http/structured.py` turns them into one spec)."""

TOOL_FIELDS: dict[str, Any] = {"tools": list[Any], "tool_choice": str | dict[str, Any],
                               "parallel_tool_calls": StrictBool}
"""Tool calling on chat (`serving/http/chat/tools.py` checks them into a plan)."""

OPENAI_SAMPLING_FIELDS = ("n", "stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                          "repetition_penalty", "ignore_eos", "stop_token_ids", "min_p", "logit_bias", "bad_words",
                          "allowed_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
                          "include_stop_str_in_output", "priority")
"""Body fields of the OpenAI routes passed to SamplingParams under the same name."""


def _optional(annotation: Any) -> tuple[Any, Any]:
    """A field that may be left out; null counts as left out (`_drop_nulls`)."""
    return annotation, None


def _nullable(annotation: Any) -> tuple[Any, Any]:
    """A field whose null is passed on (MII's: null means SamplingParams' own default, or is refused there)."""
    return annotation | None, None


def _drop_nulls(cls: type[BaseModel], data: Any) -> Any:
    # OpenAI clients send null for "not given": such a field takes its default, as if left out.
    if isinstance(data, dict):
        return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
    return data


_VALIDATORS = {"drop_nulls": model_validator(mode="before")(_drop_nulls)}


def _inlined(node: Any, defs: dict[str, Any]) -> Any:
    # The documented types are not recursive: each reference is replaced by what it names.
    if isinstance(node, dict):
        if "$ref" in node:
            return _inlined(defs[node["$ref"].rsplit("/", 1)[1]], defs)
        return {key: _inlined(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_inlined(item, defs) for item in node]
    return node


def _described(schema_type: Any) -> Any:
    """A field checked after the model (by the code whose errors name the prompt or message at fault),
    documented in the schema as `schema_type`."""
    schema = TypeAdapter(schema_type).json_schema()
    return Annotated[Any, WithJsonSchema(_inlined(schema, schema.pop("$defs", {})))]


def _prompt_forms(limits: ServingLimits, max_prompt_chars: int | None, token_ids: bool) -> Any:
    text = Annotated[str, StringConstraints(min_length=1, max_length=max_prompt_chars)]
    texts = Annotated[list[text], annotated_types.Len(1, limits.max_prompts_per_request)]
    if not token_ids:
        return text | texts
    ids = Annotated[list[Annotated[int, annotated_types.Ge(0)]], annotated_types.MinLen(1)]
    return text | texts | ids | Annotated[list[ids], annotated_types.Len(1, limits.max_prompts_per_request)]


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    role: Annotated[str, StringConstraints(min_length=1)]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


_MESSAGES = Annotated[list[_Message], annotated_types.MinLen(1)]


def _config(strict: bool) -> ConfigDict:
    return ConfigDict(extra="forbid" if strict else "allow", allow_inf_nan=False)


@dataclasses.dataclass(frozen=True)
class RequestModels:
    """The request models of one app: OpenAI's completions and chat, MII's generate, vLLM's tokenize
    (completion and chat forms) and detokenize."""

    completion: type[BaseModel]
    chat: type[BaseModel]
    mii: type[BaseModel]
    tokenize: type[BaseModel]
    tokenize_chat: type[BaseModel]
    detokenize: type[BaseModel]

    @classmethod
    def build(cls, model_name: str, limits: ServingLimits, max_prompt_chars: int | None,
              strict_params: bool = False) -> RequestModels:
        """The models for an app serving `model_name` within `limits`; `strict_params` refuses unknown fields."""
        config = _config(strict_params)

        def make(name: str, **fields: Any) -> type[BaseModel]:
            return create_model(name, __config__=config, __validators__=_VALIDATORS, **fields)

        model = (Annotated[str, Field(json_schema_extra={"enum": [model_name]})], ...)
        optional_model = (model[0], None)
        stream_options = make("StreamOptions", include_usage=_optional(StrictBool),
                              continuous_usage_stats=_optional(StrictBool))
        logprobs = bounded(int, field_bounds("logprobs"))
        max_new_tokens = field_bounds("max_new_tokens")
        common = {
            "model": model, "stream": _optional(StrictBool), "stream_options": _optional(stream_options),
            "min_tokens": _optional(bounded(int, field_bounds("min_new_tokens"))), "user": _optional(str),
            "echo": _optional(StrictBool), "truncate_prompt_tokens": _optional(_ID_OR_WHOLE),
            "request_id": _optional(Annotated[str, StringConstraints(min_length=1, max_length=MAX_REQUEST_ID)]),
            "return_tokens_as_token_ids": _optional(StrictBool), "add_special_tokens": _optional(StrictBool),
            "prompt_logprobs": _optional(sampling_annotation("prompt_logprobs", limits)),
            **{name: _optional(sampling_annotation(name, limits)) for name in OPENAI_SAMPLING_FIELDS},
            **{name: _optional(annotation) for name, (annotation, _) in _OFF_ONLY.items()},
            **{name: _optional(annotation) for name, annotation in STRUCTURED_FIELDS.items()},
        }
        completion = make(
            "CompletionRequest", **common,
            prompt=(_described(_prompt_forms(limits, max_prompt_chars, token_ids=True)), ...),
            # 0 only with echo: the prompt alone comes back (with its logprobs).
            max_tokens=_optional(bounded(int, dataclasses.replace(max_new_tokens, low=0))),
            logprobs=_optional(logprobs), best_of=_optional(sampling_annotation("n", limits)),
            **{name: _optional(annotation) for name, (annotation, _) in _COMPLETION_OFF_ONLY.items()})
        template = {"add_generation_prompt": _optional(StrictBool), "continue_final_message": _optional(StrictBool),
                    "chat_template_kwargs": _optional(dict[str, Any])}
        chat = make(
            "ChatCompletionRequest", **common, **template, messages=(_described(_MESSAGES), ...),
            max_tokens=_optional(bounded(int, max_new_tokens)),
            max_completion_tokens=_optional(bounded(int, max_new_tokens)), logprobs=_optional(StrictBool),
            top_logprobs=_optional(logprobs), store=_optional(StrictBool),
            **{name: _optional(annotation) for name, annotation in TOOL_FIELDS.items()},
            metadata=_optional(dict[str, str]), service_tier=_optional(str),
            **{name: _optional(annotation) for name, (annotation, _) in _CHAT_OFF_ONLY.items()})
        # MII's body is its client's generate(**body): prompts and SamplingParams' fields by name, nothing else.
        mii = create_model(
            "MiiGenerateRequest", __config__=_config(True),
            prompts=(_described(_prompt_forms(limits, max_prompt_chars, token_ids=False)), ...),
            stream=_nullable(StrictBool),
            **{name: _nullable(sampling_annotation(name, limits)) for name in SamplingParams.field_names()})
        text = Annotated[str, StringConstraints(max_length=max_prompt_chars)]
        flags = {"add_special_tokens": _optional(StrictBool), "return_token_strs": _optional(StrictBool)}
        tokenize = make("TokenizeRequest", model=optional_model, prompt=(text, ...), **flags)
        tokenize_chat = make("TokenizeChatRequest", model=optional_model, messages=(_described(_MESSAGES), ...),
                             **template, **flags)
        detokenize = make("DetokenizeRequest", model=optional_model, tokens=(list[bounded(int, Bounds(0))], ...))
        return cls(completion, chat, mii, tokenize, tokenize_chat, detokenize)


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "list", "dict") or "[" in str(part) or "-" in str(part):
            continue  # a union member's tag, not a field
        else:
            out += f".{part}" if out else str(part)
    return out


_COMPARISONS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _message(error: dict, accepted: list[str]) -> str:
    loc, kind = error["loc"], error["type"]
    path = _path(loc)
    if kind == "extra_forbidden":
        return f"unknown field {path[:80]!r} (accepted: {', '.join(accepted)})"
    if loc and loc[0] in NOT_SUPPORTED and len(loc) >= 1:
        return f"{loc[0]} is not supported: {NOT_SUPPORTED[loc[0]]}"
    if kind in _COMPARISONS:
        bound = next(iter(error["ctx"].values()))
        return f"{path} must be {_COMPARISONS[kind]} {bound}, got {error['input']!r}"
    if kind == "value_error":
        return f"{path} {error['ctx']['error']}"
    if kind == "missing":
        return f"{path} is required"
    return f"{path}: {error['msg']}"


def validate(model: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    """`body` as `model`, or a 400 naming the first field at fault (its top-level name as `param`)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = str(error["loc"][0])[:80] if error["loc"] else None
        raise ApiError(400, _message(error, sorted(model.model_fields)), param=param) from None

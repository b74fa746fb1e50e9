"""OpenAI request bodies, validated: `/v1/completions` and `/v1/chat/completions` -> prompts and params.

Each body is first validated as its pydantic model (`request_models`: types, bounds, unknown and
unsupported fields, a 400 naming the field); what is left here are the rules between fields and
OpenAI's defaults, which are not MII's: temperature 1, top_p 1 (MII samples with top_p 0.9),
`max_tokens` 16 for completions and "up to the context" for chat; temperature 0 is greedy. A field
this server does not know is, as in vLLM, accepted and ignored (named in `Parsed.ignored`, which the
route logs and returns in an `X-Ignored-Fields` header), or refused with a 400 in strict mode.
Nothing here calls the tokenizer: rendering a chat (`chat.render_chat`) runs on a worker thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from fastgen.api import normalise_prompts
from fastgen.sampling_params import FieldError, SamplingParams
from fastgen.serving.http.chat.messages import ChatPrompt, chat_prompt
from fastgen.serving.http.chat.reasoning import END as REASONING_END
from fastgen.serving.http.chat.reasoning import REASONING_PARSERS, ReasoningFormat
from fastgen.serving.http.chat.tools import ToolPlan, tool_plan
from fastgen.serving.http.guard import ApiError
from fastgen.serving.http.request_models import OPENAI_SAMPLING_FIELDS, RequestModels, validate
from fastgen.serving.http.structured import structured_outputs_of

_MAX_SHOWN_NAMES = 20
_MAX_SHOWN_NAME = 80

logger = logging.getLogger("fastgen")


def describe(value: Any) -> str:
    """A short description of a JSON value for an error message, however large the value is."""
    if isinstance(value, str):
        return json.dumps(value[:40] + ("..." if len(value) > 40 else ""))
    if isinstance(value, list):
        if not value:
            return "an empty array"
        first = value[0]
        shown = "an array" if isinstance(first, list) else "an object" if isinstance(first, dict) else describe(first)
        return f"an array of {len(value)} (the first is {shown})"
    if isinstance(value, dict):
        return f"an object with {len(value)} fields"
    return json.dumps(value)


def prompts_param(value: Any, param: str, *, flat_ids: bool = True) -> list[str | list[int]]:
    """`fastgen.api.normalise_prompts` of a body's prompts field, its refusal a 400 naming `param`."""
    try:
        return normalise_prompts(value, param, flat_ids=flat_ids, describe=describe)
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None


def sampling_params(kwargs: Mapping[str, Any]) -> SamplingParams:
    """`SamplingParams.from_kwargs(**kwargs)`, a refusal a 400 naming the bad field (none for a
    contradiction between two fields)."""
    try:
        return SamplingParams.from_kwargs(**kwargs)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "field", None)) from None


@dataclass(slots=True)
class Parsed:
    """A validated completions or chat request."""

    prompts: list[str | list[int] | ChatPrompt]
    """One engine request per prompt (chat has one)."""
    params: SamplingParams
    """Generation parameters shared by every prompt."""
    stream: bool
    """Answer with server-sent events."""
    include_usage: bool
    """Streaming: end with a chunk carrying `usage` (`stream_options.include_usage`)."""
    top_logprobs: int | None
    """None = no logprobs; else how many alternatives per token."""
    max_tokens_param: str | None
    """The field that set `max_new_tokens` explicitly (`max_tokens` / `max_completion_tokens`), which
    must then fit the context with the prompt; None when the default was taken."""
    echo: bool = False
    """Completions: prefix each choice with its prompt (and its logprobs with the prompt's);
    chat: with the final message's content when the reply continues it."""
    continuous_usage: bool = False
    """Streaming: `usage` in every chunk (`stream_options.continuous_usage_stats`)."""
    prompt_logprobs: int | None = None
    """The `prompt_logprobs` field (returned as vLLM's `prompt_logprobs`); None when not asked."""
    echo_only: bool = False
    """`max_tokens: 0` with `echo`: the one token generated is dropped and the prompt alone returned."""
    token_ids_as_text: bool = False
    """`return_tokens_as_token_ids`: logprob tokens spelled `token_id:N`."""
    request_id: str | None = None
    """The caller's `request_id`, which names the response (`cmpl-<id>`); None = a random one."""
    add_special_tokens: bool = True
    """Let the tokenizer add its special tokens (BOS) to a text prompt."""
    ignored: tuple[str, ...] = ()
    """Fields of the body this server does not know, accepted and ignored."""
    tools: ToolPlan | None = None
    """Chat: how the request's tools are used (None without tools)."""
    reasoning: ReasoningFormat | None = None
    """Chat: the server's `--reasoning-parser` format, which splits `reasoning_content` off."""
    lora: str | None = None
    """The LoRA adapter the request's `model` names (None: the base model)."""

    def response_id(self, prefix: str, random_id: str) -> str:
        """The response's `id`: `<prefix>-<request_id>`, or `<prefix>-<random_id>` without one."""
        return f"{prefix}-{self.request_id if self.request_id is not None else random_id}"


def _ignored(request: BaseModel) -> list[str]:
    """The fields of `request` (and of its `stream_options`) this server does not know (strict models refuse them)."""
    ignored = sorted(request.model_extra or ())
    options = getattr(request, "stream_options", None)
    return ignored + [f"stream_options.{name}" for name in sorted((options.model_extra or ()) if options else ())]


def _parse_common(request: BaseModel, model_name: str, adapters: Container[str]) -> tuple[dict, Parsed]:
    """The sampling kwargs and the stream/usage/id options both routes share (prompts and params still
    unset); `model` is the base `model_name` or one of the LoRA `adapters`."""
    if request.model != model_name and request.model not in adapters:
        raise model_not_found(request.model)
    kwargs: dict[str, Any] = {name: getattr(request, name) for name in OPENAI_SAMPLING_FIELDS
                              if getattr(request, name) is not None}
    kwargs.setdefault("temperature", 1.0)
    kwargs.setdefault("top_p", 1.0)
    if request.min_tokens is not None:
        kwargs["min_new_tokens"] = request.min_tokens
    constraint = structured_outputs_of(request)
    if constraint is not None:
        kwargs["structured_outputs"] = constraint
    truncate = request.truncate_prompt_tokens
    if truncate == 0:
        raise ApiError(400, "truncate_prompt_tokens must be >= 1 (or -1 for the whole context), got 0",
                       param="truncate_prompt_tokens")
    if truncate is not None and truncate > 0:  # -1 is vLLM's "the whole context", i.e. no truncation
        kwargs["truncate_prompt_tokens"] = truncate
    stream = bool(request.stream)
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is not None:
        if stream:
            raise ApiError(400, "prompt_logprobs is not available with stream: true (as in vLLM; streamed "
                                "completions get the prompt's logprobs with echo and logprobs)", param="prompt_logprobs")
        kwargs["prompt_logprobs"] = prompt_logprobs
    options = request.stream_options
    include_usage = continuous = False
    if options is not None and (options.model_fields_set or options.model_extra):
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        include_usage = bool(options.include_usage)
        # vLLM's rule: usage in every chunk only when the final usage chunk is asked for too.
        continuous = include_usage and bool(options.continuous_usage_stats)
    parsed = Parsed([], SamplingParams(), stream, include_usage, None, None, continuous_usage=continuous,
                    prompt_logprobs=prompt_logprobs, request_id=request.request_id,
                    token_ids_as_text=bool(request.return_tokens_as_token_ids),
                    add_special_tokens=request.add_special_tokens is not False, ignored=tuple(_ignored(request)),
                    lora=None if request.model == model_name else request.model)
    return kwargs, parsed


def _set_max_tokens(kwargs: dict, max_tokens: int | None, param: str = "max_tokens") -> None:
    if max_tokens is None:
        return
    kwargs["max_new_tokens"] = max_tokens
    if kwargs.get("min_new_tokens", 0) > max_tokens:
        raise ApiError(400, f"min_tokens ({kwargs['min_new_tokens']}) must be <= {param} ({max_tokens})",
                       param="min_tokens")


def parse_completion(body: dict[str, Any], models: RequestModels, model_name: str,
                     adapters: Container[str] = ()) -> Parsed:
    """Validate a `/v1/completions` body (as `models.completion`, which refuses unknown fields when strict)
    for the base `model_name` or one of the LoRA `adapters`."""
    request = validate(models.completion, body)
    kwargs, parsed = _parse_common(request, model_name, adapters)
    if request.prompt is None:
        raise ApiError(400, "prompt is required", param="prompt")
    parsed.prompts = prompts_param(request.prompt, "prompt")
    if request.best_of is not None and request.best_of != kwargs.get("n", 1):
        raise ApiError(400, "best_of must equal n (ranking extra samples is not supported)", param="best_of")
    parsed.echo = bool(request.echo)
    max_tokens = request.max_tokens
    if max_tokens == 0:
        if not parsed.echo:
            raise ApiError(400, "max_tokens must be >= 1, got 0 (0 is allowed only with echo: true, which returns "
                                "the prompt alone)", param="max_tokens")
        _set_max_tokens(kwargs, 0)  # min_tokens > 0 contradicts it
        # vLLM's way to score a prompt without generating: one token is generated and dropped.
        parsed.echo_only = True
        kwargs["max_new_tokens"] = 1
    else:
        _set_max_tokens(kwargs, max_tokens or 16)
    parsed.max_tokens_param = "max_tokens" if max_tokens is not None else None
    top = request.logprobs
    if top is not None:
        kwargs["logprobs"] = top
        if parsed.echo and parsed.prompt_logprobs is None:
            kwargs["prompt_logprobs"] = top  # the echoed prompt's tokens get logprobs too, as in vLLM
    parsed.top_logprobs = top
    parsed.params = sampling_params(kwargs)
    return parsed


def parse_chat(body: dict[str, Any], models: RequestModels, model_name: str, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None, adapters: Container[str] = ()) -> Parsed:
    """Validate a `/v1/chat/completions` body (its prompt is rendered later, off the event loop) for the
    base `model_name` or one of the LoRA `adapters`; `tool_call_parser` and `reasoning_parser` are the
    server's formats (`--tool-call-parser`, ...)."""
    request = validate(models.chat, body)
    kwargs, parsed = _parse_common(request, model_name, adapters)
    plan = tool_plan(request, tool_call_parser)
    if plan is not None and plan.constraint is not None:
        if "structured_outputs" in kwargs:
            what = "strict tools under tool_choice auto constrain the reply's calls" if plan.choice == "auto" else \
                f"tool_choice {plan.choice} constrains the reply to tool calls"
            raise ApiError(400, f"{what}: it cannot be combined with response_format or structured_outputs",
                           param="tool_choice")
        kwargs["structured_outputs"] = plan.constraint
    if reasoning_parser is not None:
        parsed.reasoning = REASONING_PARSERS[reasoning_parser]
        if "structured_outputs" in kwargs:
            # The model thinks freely first; the route drops this when the prompt already closed the thinking.
            kwargs["structured_outputs"] = {"reasoning_end": REASONING_END, **kwargs["structured_outputs"]}
    parsed.tools = plan
    parsed.prompts = [chat_prompt(request, plan.tools if plan is not None else None)]
    max_completion_tokens, max_tokens = request.max_completion_tokens, request.max_tokens
    parsed.max_tokens_param = "max_completion_tokens" if max_completion_tokens is not None else (
        "max_tokens" if max_tokens is not None else None)
    _set_max_tokens(kwargs, max_completion_tokens if max_completion_tokens is not None else max_tokens,
                    parsed.max_tokens_param or "max_tokens")
    want_logprobs = bool(request.logprobs)
    top = request.top_logprobs
    if top is not None and not want_logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    parsed.top_logprobs = (top or 0) if want_logprobs else None
    if parsed.top_logprobs is not None:
        kwargs["logprobs"] = parsed.top_logprobs
    parsed.echo = bool(request.echo)
    parsed.params = sampling_params(kwargs)
    return parsed


def _header_safe(name: str) -> str:
    # Field names are arbitrary JSON strings; a header value must be printable Latin-1, and commas separate names.
    return "".join(c if " " <= c <= "~" and c != "," else f"\\u{ord(c):04x}" for c in name[:_MAX_SHOWN_NAME])


def ignored_notice(method: str, path: str, ignored: tuple[str, ...]) -> dict[str, str]:
    """Log one warning naming the `ignored` fields of a request and return the `X-Ignored-Fields`
    header that tells the caller too (no header, no log when nothing was ignored)."""
    if not ignored:
        return {}
    shown = [_header_safe(name) for name in ignored[:_MAX_SHOWN_NAMES]]
    if len(ignored) > _MAX_SHOWN_NAMES:
        shown.append(f"... ({len(ignored) - _MAX_SHOWN_NAMES} more)")
    logger.warning("%s %s: ignored fields this server does not implement: %s", method, path, ", ".join(shown))
    return {"X-Ignored-Fields": ",".join(shown)}


def model_not_found(model: str) -> ApiError:
    """The 404 for a model this server does not serve."""
    shown = model if len(model) <= 100 else model[:100] + "..."
    return ApiError(404, f"The model `{shown}` does not exist on this server (see GET /v1/models)",
                    param="model", code="model_not_found")

"""Validation of OpenAI request bodies: `/v1/completions` and `/v1/chat/completions` -> prompts and params.

Bodies are parsed by hand rather than by pydantic models so that every bad field gets an
OpenAI-shaped 400 naming that field, with the engine's own validation message where the names
agree. Defaults are OpenAI's, not MII's: temperature 1, top_p 1 (MII samples with top_p 0.9),
`max_tokens` 16 for completions and "up to the context" for chat; temperature 0 is greedy.

The fields are OpenAI's plus vLLM's extra parameters. A field this server does not know is, as in
vLLM, accepted and ignored (named in `Parsed.ignored`, which the route logs and returns in an
`X-Ignored-Fields` header), or refused with a 400 in strict mode. A known feature this server does
not have (tools, guided decoding, beam search, ...) is accepted only at its "off" value, since
ignoring it would silently return something else than what was asked for.
Nothing here calls the tokenizer: rendering a chat (`openai_chat.render_chat`) runs on a worker thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastgen.api import normalise_prompts
from fastgen.sampling_params import MAX_LOGPROBS, FieldError, SamplingParams
from fastgen.serving.http.guard import ApiError
from fastgen.serving.http.chat import ChatPrompt, chat_prompt

# Body fields passed to SamplingParams under the same name.
_SAMPLING_FIELDS = ("n", "stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                    "repetition_penalty", "ignore_eos", "stop_token_ids", "min_p", "logit_bias", "bad_words",
                    "allowed_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
                    "include_stop_str_in_output", "priority")
# field -> (values besides null that mean "off", what this server lacks)
_OFF_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "no beam search"),
    "response_format": (({"type": "text"},), "only plain text responses"),
    "guided_json": ((), "no guided decoding"), "guided_regex": ((), "no guided decoding"),
    "guided_choice": ((), "no guided decoding"), "guided_grammar": ((), "no guided decoding"),
    "structured_outputs": ((), "no structured outputs"), "logits_processors": (([],), "no custom logits processors"),
    "prompt_embeds": ((), "prompts are text or token ids"),
    "logprob_token_ids": ((), "logprobs are of the top tokens (logprobs / top_logprobs)"),
}
_COMPLETION_OFF_ONLY = {"suffix": (("",), "no insertion (fill-in-the-middle) support")}
_CHAT_OFF_ONLY = {
    "tools": (([],), "no tool calling"), "functions": (([],), "no function calling"),
    "function_call": (("none", "auto"), "no function calling"), "tool_choice": (("none", "auto"), "no tool calling"),
    "chat_template": ((), "the checkpoint's own chat template is used (a request's template is not trusted)"),
}
_COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "max_tokens", "min_tokens", "user", "logprobs", "echo",
                            "prompt_logprobs", "truncate_prompt_tokens", "request_id", "return_tokens_as_token_ids",
                            "add_special_tokens", *_SAMPLING_FIELDS, *_OFF_ONLY})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "best_of", *_COMPLETION_OFF_ONLY}
"""Every field `/v1/completions` knows (some only at their "off" value)."""
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "top_logprobs", "max_completion_tokens", "parallel_tool_calls", "store",
                                "metadata", "service_tier", "add_generation_prompt", "continue_final_message",
                                "chat_template_kwargs", *_CHAT_OFF_ONLY}
"""Every field `/v1/chat/completions` knows (some only at their "off" value)."""
_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
_MAX_REQUEST_ID = 256
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


def _int(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ApiError(400, f"{name} must be an integer, got {describe(value)}", param=name)
    value = int(value)
    if value < low or (high is not None and value > high):
        raise ApiError(400, f"{name} must be in [{low}, {'inf' if high is None else high}], got {value}", param=name)
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{param + '.' if param else ''}{name} must be a boolean, got {describe(value)}",
                       param=param or name)
    return value


def _check_off_only(body: Mapping[str, Any], table: Mapping[str, tuple[tuple[Any, ...], str]]) -> None:
    for name, (off, what) in table.items():
        if body.get(name) is not None and body[name] not in off:
            raise ApiError(400, f"{name} is not supported: {what}", param=name)


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

    def response_id(self, prefix: str, random_id: str) -> str:
        """The response's `id`: `<prefix>-<request_id>`, or `<prefix>-<random_id>` without one."""
        return f"{prefix}-{self.request_id if self.request_id is not None else random_id}"


def _unknown(body: Mapping[str, Any], known: frozenset[str], strict: bool, prefix: str = "") -> list[str]:
    unknown = sorted(k for k in body if k not in known)
    if unknown and strict:
        name = unknown[0][:80]
        raise ApiError(400, f"unknown field {prefix + name!r} (accepted: {', '.join(sorted(known))})",
                       param=(prefix.rstrip(".") or name))
    return [prefix + name for name in unknown]


def _parse_common(body: Mapping[str, Any], known: frozenset[str], model_name: str, strict: bool) -> tuple[dict, Parsed]:
    """The sampling kwargs and the stream/usage/id options both routes share (prompts and params still unset)."""
    ignored = _unknown(body, known, strict)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: a string naming the served model (see GET /v1/models)", param="model")
    if model != model_name:
        raise model_not_found(model)
    _check_off_only(body, _OFF_ONLY)
    kwargs: dict[str, Any] = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    kwargs.setdefault("temperature", 1.0)
    kwargs.setdefault("top_p", 1.0)
    min_tokens = _int(body, "min_tokens", 0)
    if min_tokens is not None:
        kwargs["min_new_tokens"] = min_tokens
    truncate = _int(body, "truncate_prompt_tokens", -1)
    if truncate == 0:
        raise ApiError(400, "truncate_prompt_tokens must be >= 1 (or -1 for the whole context), got 0",
                       param="truncate_prompt_tokens")
    if truncate is not None and truncate > 0:  # -1 is vLLM's "the whole context", i.e. no truncation
        kwargs["truncate_prompt_tokens"] = truncate
    stream = _bool(body, "stream", False)
    prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt_logprobs is not None:
        if stream:
            raise ApiError(400, "prompt_logprobs is not available with stream: true (as in vLLM; streamed "
                                "completions get the prompt's logprobs with echo and logprobs)", param="prompt_logprobs")
        kwargs["prompt_logprobs"] = prompt_logprobs
    request_id = body.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= _MAX_REQUEST_ID):
        raise ApiError(400, f"request_id must be a string of 1 to {_MAX_REQUEST_ID} characters, got "
                            f"{describe(request_id)}", param="request_id")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options:
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict):
            raise ApiError(400, 'stream_options must be an object like {"include_usage": true}', param="stream_options")
        ignored += _unknown(options, _STREAM_OPTIONS, strict, prefix="stream_options.")
        include_usage = _bool(options, "include_usage", False, param="stream_options")
        # vLLM's rule: usage in every chunk only when the final usage chunk is asked for too.
        continuous = include_usage and _bool(options, "continuous_usage_stats", False, param="stream_options")
    parsed = Parsed([], SamplingParams(), stream, include_usage, None, None, continuous_usage=continuous,
                    prompt_logprobs=prompt_logprobs, request_id=request_id,
                    token_ids_as_text=_bool(body, "return_tokens_as_token_ids", False),
                    add_special_tokens=_bool(body, "add_special_tokens", True), ignored=tuple(ignored))
    return kwargs, parsed


def _set_max_tokens(kwargs: dict, max_tokens: int | None, param: str = "max_tokens") -> None:
    if max_tokens is None:
        return
    kwargs["max_new_tokens"] = max_tokens
    if kwargs.get("min_new_tokens", 0) > max_tokens:
        raise ApiError(400, f"min_tokens ({kwargs['min_new_tokens']}) must be <= {param} ({max_tokens})",
                       param="min_tokens")


def parse_completion(body: Mapping[str, Any], model_name: str, strict: bool = False) -> Parsed:
    """Validate a `/v1/completions` body; `strict` refuses unknown fields instead of ignoring them."""
    kwargs, parsed = _parse_common(body, COMPLETION_FIELDS, model_name, strict)
    if body.get("prompt") is None:
        raise ApiError(400, "prompt is required", param="prompt")
    parsed.prompts = prompts_param(body["prompt"], "prompt")
    _check_off_only(body, _COMPLETION_OFF_ONLY)
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != kwargs.get("n", 1):
        raise ApiError(400, "best_of must equal n (ranking extra samples is not supported)", param="best_of")
    parsed.echo = _bool(body, "echo", False)
    max_tokens = _int(body, "max_tokens", 0)
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
    top = _int(body, "logprobs", 0, MAX_LOGPROBS)
    if top is not None:
        kwargs["logprobs"] = top
        if parsed.echo and parsed.prompt_logprobs is None:
            kwargs["prompt_logprobs"] = top  # the echoed prompt's tokens get logprobs too, as in vLLM
    parsed.top_logprobs = top
    parsed.params = sampling_params(kwargs)
    return parsed


def parse_chat(body: Mapping[str, Any], model_name: str, strict: bool = False) -> Parsed:
    """Validate a `/v1/chat/completions` body (its prompt is rendered later, off the event loop);
    `strict` refuses unknown fields instead of ignoring them."""
    kwargs, parsed = _parse_common(body, CHAT_FIELDS, model_name, strict)
    _check_off_only(body, _CHAT_OFF_ONLY)
    parsed.prompts = [chat_prompt(body)]
    max_completion_tokens, max_tokens = _int(body, "max_completion_tokens", 1), _int(body, "max_tokens", 1)
    parsed.max_tokens_param = "max_completion_tokens" if max_completion_tokens is not None else (
        "max_tokens" if max_tokens is not None else None)
    _set_max_tokens(kwargs, max_completion_tokens if max_completion_tokens is not None else max_tokens,
                    parsed.max_tokens_param or "max_tokens")
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    parsed.top_logprobs = (top or 0) if want_logprobs else None
    if parsed.top_logprobs is not None:
        kwargs["logprobs"] = parsed.top_logprobs
    parsed.echo = _bool(body, "echo", False)
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

"""Validation of OpenAI request bodies: `/v1/completions` and `/v1/chat/completions` -> prompts and params.

Bodies are parsed by hand rather than by pydantic models so that every bad field gets an
OpenAI-shaped 400 naming that field, with the engine's own validation message where the names
agree. Defaults are OpenAI's, not MII's: temperature 1, top_p 1 (MII samples with top_p 0.9),
`max_tokens` 16 for completions and "up to the context" for chat; temperature 0 is greedy.
Nothing here calls the tokenizer: rendering a chat (`render_chat`) runs on a worker thread.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastgen.sampling_params import MAX_LOGPROBS, SamplingParams
from fastgen.serving.http_guard import ApiError

_SAMPLING_FIELDS = ("n", "stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                    "top_k", "repetition_penalty", "ignore_eos", "stop_token_ids")
_COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "max_tokens", "min_tokens", "user", "logit_bias",
                            *_SAMPLING_FIELDS})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
"""Every field `/v1/completions` accepts (some only at their "off" value)."""
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "functions",
                                "tool_choice", "response_format", "parallel_tool_calls", "store", "metadata",
                                "service_tier"}
"""Every field `/v1/chat/completions` accepts (some only at their "off" value)."""


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


def _all_text(items: list) -> bool:
    return all(isinstance(p, str) for p in items)


def _all_ids(items: Any) -> bool:
    # sum() is an int only over ints (and bools, which the engine's own check refuses): one
    # C-speed pass instead of a Python-level test per id of a half-million-id prompt.
    if not isinstance(items, list) or not items:
        return False
    try:
        return type(sum(items)) is int
    except TypeError:
        return False


def normalize_prompts(value: Any, param: str, *, flat_ids: bool = True) -> list[str | list[int]]:
    """A str, list of str, token-id list (if `flat_ids`) or list of token-id lists -> list of prompts."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if _all_text(value):
            return list(value)
        if flat_ids and _all_ids(value):
            return [list(value)]
        if all(_all_ids(p) for p in value):
            return [list(p) for p in value]
    kinds = "a string, a non-empty list of strings" + (", a list of token ids" if flat_ids else "")
    raise ApiError(400, f"{param} must be {kinds} or a list of token-id lists, got {describe(value)}", param=param)


def sampling_params(kwargs: Mapping[str, Any]) -> SamplingParams:
    """`SamplingParams(**kwargs)`, checking one field at a time so a 400 names the bad field."""
    for key, value in kwargs.items():
        try:
            SamplingParams(**{key: value})
        except (TypeError, ValueError, OverflowError) as exc:
            raise ApiError(400, str(exc), param=key) from None
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ApiError(400, str(exc)) from None


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


def _off_only(body: Mapping[str, Any], name: str, off: tuple[Any, ...], what: str) -> None:
    if body.get(name) not in (None, *off):
        raise ApiError(400, f"{name} is not supported: {what}", param=name)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A validated conversation, rendered with the chat template (on a worker) just before submission."""

    conversation: list[dict[str, str]]
    """`{role, content[, name]}` per message, content parts joined into text."""


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
    """Completions: prefix each choice with its prompt."""


def _parse_common(body: Mapping[str, Any], allowed: frozenset[str], model_name: str) -> tuple[dict, bool, bool]:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        name = unknown[0][:80]
        raise ApiError(400, f"unknown field {name!r} (accepted: {', '.join(sorted(allowed))})", param=name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: a string naming the served model (see GET /v1/models)", param="model")
    if model != model_name:
        raise model_not_found(model)
    _off_only(body, "logit_bias", ({},), "this server does not bias logits")
    kwargs: dict[str, Any] = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    kwargs.setdefault("temperature", 1.0)
    kwargs.setdefault("top_p", 1.0)
    min_tokens = _int(body, "min_tokens", 0)
    if min_tokens is not None:
        kwargs["min_new_tokens"] = min_tokens
    stream = _bool(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ApiError(400, 'stream_options must be an object like {"include_usage": true}', param="stream_options")
        include_usage = _bool(options, "include_usage", False, param="stream_options")
    return kwargs, stream, include_usage


def _set_max_tokens(kwargs: dict, max_tokens: int | None) -> None:
    if max_tokens is None:
        return
    kwargs["max_new_tokens"] = max_tokens
    if kwargs.get("min_new_tokens", 0) > max_tokens:
        raise ApiError(400, f"min_tokens ({kwargs['min_new_tokens']}) must be <= max_tokens ({max_tokens})",
                       param="min_tokens")


def parse_completion(body: Mapping[str, Any], model_name: str) -> Parsed:
    """Validate a `/v1/completions` body."""
    kwargs, stream, include_usage = _parse_common(body, COMPLETION_FIELDS, model_name)
    if body.get("prompt") is None:
        raise ApiError(400, "prompt is required", param="prompt")
    prompts: list[Any] = normalize_prompts(body["prompt"], "prompt")
    _off_only(body, "suffix", ("",), "no insertion (fill-in-the-middle) support")
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != kwargs.get("n", 1):
        raise ApiError(400, "best_of must equal n (ranking extra samples is not supported)", param="best_of")
    max_tokens = _int(body, "max_tokens", 1)
    _set_max_tokens(kwargs, max_tokens or 16)
    top = _int(body, "logprobs", 0, MAX_LOGPROBS)
    echo = _bool(body, "echo", False)
    if echo and top is not None:
        raise ApiError(400, "echo together with logprobs is not supported (no prompt logprobs)", param="echo")
    if top is not None:
        kwargs["logprobs"] = top
    return Parsed(prompts, sampling_params(kwargs), stream, include_usage, top,
                  "max_tokens" if max_tokens is not None else None, echo)


def _message_text(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}",
                               param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")


def chat_conversation(messages: Any) -> ChatPrompt:
    """Validate `messages` into the conversation the chat template renders."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object with role and content", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}].role must be a non-empty string", param="messages")
        entry = {"role": role, "content": _message_text(i, message.get("content"))}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        conversation.append(entry)
    return ChatPrompt(conversation)


def render_chat(tokenizer: Any, chat: ChatPrompt, max_chars: int | None) -> list[int]:
    """The conversation's prompt token ids, rendered with the checkpoint's chat template.

    Blocking (jinja and the tokenizer): run it on a worker. A rendering longer than `max_chars`
    cannot fit the context in tokens, so it is refused without being tokenized.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(chat.conversation, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2 raises its own errors (e.g. roles that must alternate)
        raise ApiError(400, f"messages could not be rendered with the chat template: {exc}", param="messages") from None
    if max_chars is not None and len(text) > max_chars:
        raise ApiError(400, f"messages render to {len(text)} characters: more than this model's context can hold "
                            f"in tokens (at most {max_chars} characters)", param="messages")
    # The template already holds any BOS it wants; encoding must not add another.
    return tokenizer.encode(text, add_special_tokens=False)


def parse_chat(body: Mapping[str, Any], model_name: str) -> Parsed:
    """Validate a `/v1/chat/completions` body (its prompt is rendered later, off the event loop)."""
    kwargs, stream, include_usage = _parse_common(body, CHAT_FIELDS, model_name)
    if body.get("messages") is None:
        raise ApiError(400, "messages is required", param="messages")
    _off_only(body, "tools", ([],), "no tool calling")
    _off_only(body, "functions", ([],), "no function calling")
    _off_only(body, "tool_choice", ("none", "auto"), "no tool calling")
    _off_only(body, "response_format", ({"type": "text"},), "only plain text responses")
    max_completion_tokens, max_tokens = _int(body, "max_completion_tokens", 1), _int(body, "max_tokens", 1)
    limit_param = "max_completion_tokens" if max_completion_tokens is not None else (
        "max_tokens" if max_tokens is not None else None)
    _set_max_tokens(kwargs, max_completion_tokens if max_completion_tokens is not None else max_tokens)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    top = (top or 0) if want_logprobs else None
    if top is not None:
        kwargs["logprobs"] = top
    params = sampling_params(kwargs)
    return Parsed([chat_conversation(body["messages"])], params, stream, include_usage, top, limit_param)


def model_not_found(model: str) -> ApiError:
    """The 404 for a model this server does not serve."""
    shown = model if len(model) <= 100 else model[:100] + "..."
    return ApiError(404, f"The model `{shown}` does not exist on this server (see GET /v1/models)",
                    param="model", code="model_not_found")

"""The OpenAI-compatible API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Bodies are parsed by hand rather than by pydantic models so that every bad field gets an
OpenAI-shaped 400 naming that field, with the engine's own validation message where the names
agree. Defaults are OpenAI's, not MII's: temperature 1, top_p 1 (MII samples with top_p 0.9),
`max_tokens` 16 for completions and "up to the context" for chat; temperature 0 is greedy.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from fastgen.outputs import Response
from fastgen.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from fastgen.serving.rest import Gateway, Generation

logger = logging.getLogger("fastgen")

_SAMPLING_FIELDS = ("n", "stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                    "top_k", "repetition_penalty", "ignore_eos", "stop_token_ids")
_COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "max_tokens", "min_tokens", "user", "logit_bias",
                            *_SAMPLING_FIELDS})
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
# Accepted only at their "off" value; anything else is a 400 naming the field.
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "functions",
                                 "tool_choice", "response_format", "parallel_tool_calls", "store", "metadata",
                                 "service_tier"}
_ERROR_TYPES = {429: "rate_limit_error", 499: "client_closed_request", 501: "not_implemented_error"}


class ApiError(Exception):
    """An error answered with an OpenAI-shaped body: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_prompts(value: Any, param: str, *, flat_ids: bool = True) -> list[str | list[int]]:
    """A str, list of str, token-id list (if `flat_ids`) or list of token-id lists -> list of prompts."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if flat_ids and all(_is_token_id(t) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return [list(p) for p in value]
    kinds = "a string, a non-empty list of strings" + (", a list of token ids" if flat_ids else "")
    raise ApiError(400, f"{param} must be {kinds} or a list of token-id lists, got {json.dumps(value)[:80]}",
                   param=param)


def sampling_params(kwargs: Mapping[str, Any]) -> SamplingParams:
    """`SamplingParams(**kwargs)`, checking one field at a time so a 400 names the bad field."""
    for key, value in kwargs.items():
        try:
            SamplingParams(**{key: value})
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc), param=key) from None
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc)) from None


def _int(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
        raise ApiError(400, f"{name} must be an integer, got {json.dumps(value)}", param=name)
    value = int(value)
    if value < low or (high is not None and value > high):
        raise ApiError(400, f"{name} must be in [{low}, {'inf' if high is None else high}], got {value}", param=name)
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{param + '.' if param else ''}{name} must be a boolean, got {json.dumps(value)}",
                       param=param or name)
    return value


def _off_only(body: Mapping[str, Any], name: str, off: tuple[Any, ...], what: str) -> None:
    if body.get(name) not in (None, *off):
        raise ApiError(400, f"{name} is not supported: {what}", param=name)


@dataclass(slots=True)
class _Parsed:
    """A validated completions or chat request."""

    prompts: list[str | list[int]]
    """One engine request per prompt (chat has one)."""
    params: SamplingParams
    """Generation parameters shared by every prompt."""
    stream: bool
    """Answer with server-sent events."""
    include_usage: bool
    """Streaming: end with a chunk carrying `usage` (`stream_options.include_usage`)."""
    top_logprobs: int | None
    """None = no logprobs; else how many alternatives per token."""
    echo: bool = False
    """Completions: prefix each choice with its prompt."""


def _parse_common(body: Mapping[str, Any], allowed: frozenset[str], model_name: str) -> tuple[dict, bool, bool]:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r} (accepted: {', '.join(sorted(allowed))})", param=unknown[0])
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


def parse_completion(body: Mapping[str, Any], model_name: str) -> _Parsed:
    """Validate a `/v1/completions` body."""
    kwargs, stream, include_usage = _parse_common(body, _COMPLETION_FIELDS, model_name)
    if body.get("prompt") is None:
        raise ApiError(400, "prompt is required", param="prompt")
    prompts = normalize_prompts(body["prompt"], "prompt")
    _off_only(body, "suffix", ("",), "no insertion (fill-in-the-middle) support")
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != kwargs.get("n", 1):
        raise ApiError(400, "best_of must equal n (ranking extra samples is not supported)", param="best_of")
    _set_max_tokens(kwargs, _int(body, "max_tokens", 1) or 16)
    top = _int(body, "logprobs", 0, MAX_LOGPROBS)
    echo = _bool(body, "echo", False)
    if echo and top is not None:
        raise ApiError(400, "echo together with logprobs is not supported (no prompt logprobs)", param="echo")
    if top is not None:
        kwargs["logprobs"] = top
    return _Parsed(prompts, sampling_params(kwargs), stream, include_usage, top, echo)


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


def chat_prompt(tokenizer: Any, messages: Any) -> list[int]:
    """Render `messages` with the checkpoint's chat template; returns the prompt's token ids."""
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
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2 raises its own errors (e.g. roles that must alternate)
        raise ApiError(400, f"messages could not be rendered with the chat template: {exc}", param="messages") from None
    # The template already holds any BOS it wants; encoding must not add another.
    return tokenizer.encode(text, add_special_tokens=False)


def parse_chat(body: Mapping[str, Any], model_name: str, tokenizer: Any) -> _Parsed:
    """Validate a `/v1/chat/completions` body and render its prompt."""
    kwargs, stream, include_usage = _parse_common(body, _CHAT_FIELDS, model_name)
    if body.get("messages") is None:
        raise ApiError(400, "messages is required", param="messages")
    _off_only(body, "tools", ([],), "no tool calling")
    _off_only(body, "functions", ([],), "no function calling")
    _off_only(body, "tool_choice", ("none", "auto"), "no tool calling")
    _off_only(body, "response_format", ({"type": "text"},), "only plain text responses")
    max_completion_tokens, max_tokens = _int(body, "max_completion_tokens", 1), _int(body, "max_tokens", 1)
    _set_max_tokens(kwargs, max_completion_tokens if max_completion_tokens is not None else max_tokens)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    top = (top or 0) if want_logprobs else None
    if top is not None:
        kwargs["logprobs"] = top
    params = sampling_params(kwargs)
    return _Parsed([chat_prompt(tokenizer, body["messages"])], params, stream, include_usage, top)


def model_not_found(model: str) -> ApiError:
    """The 404 for a model this server does not serve."""
    return ApiError(404, f"The model `{model}` does not exist on this server (see GET /v1/models)",
                    param="model", code="model_not_found")


class _Usage:
    """Token counts of one request: prompts once each (as OpenAI counts with n > 1), every choice."""

    def __init__(self) -> None:
        self._prompt: dict[int, int] = {}
        self._generated: dict[tuple[int, int], int] = {}

    def add(self, response: Response) -> None:
        self._prompt[response.prompt_index] = response.prompt_length
        self._generated[(response.prompt_index, response.index)] = response.generated_length

    def as_dict(self) -> dict[str, int]:
        prompt, completion = sum(self._prompt.values()), sum(self._generated.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _top(entry: Mapping[int, float], k: int) -> list[tuple[int, float]]:
    # The engine's entry holds the chosen token first, then the top-k; a chosen token that is
    # itself in the top-k appears once, so sorting recovers the top-k either way.
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def _completion_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]], top_n: int,
                         offset: int) -> tuple[dict[str, Any], int]:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = tokenizer.decode([token_id])
        out["tokens"].append(text)
        out["token_logprobs"].append(entry[token_id])
        out["top_logprobs"].append({tokenizer.decode([i]): lp for i, lp in _top(entry, top_n)})
        out["text_offset"].append(offset)
        offset += len(text)
    if not top_n:
        out["top_logprobs"] = None
    return out, offset


def _chat_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]], top_n: int) -> list[dict]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**item(t, entry[t]), "top_logprobs": [item(i, lp) for i, lp in _top(entry, top_n)]}
            for t, entry in zip(token_ids, entries)]


def _sse_response(generation: Generation, events: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except ApiError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception as exc:
            logger.exception("streamed generation failed")
            yield f"data: {json.dumps(ApiError(500, f'generation failed: {exc}').body())}\n\n"
        yield "data: [DONE]\n\n"

    async def release() -> None:
        # Also runs when the client went away mid-stream: aborts what is unfinished.
        generation.close()

    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(release),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def add_openai_routes(router: APIRouter, gateway: Gateway, model_name: str, max_model_len: int | None) -> None:
    """Add `/v1/models`, `/v1/completions` and `/v1/chat/completions` to `router`."""
    tokenizer = gateway.tokenizer
    card: dict[str, Any] = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "fastgen"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len

    @router.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card]})

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        if model_id != model_name:
            raise model_not_found(model_id)
        return JSONResponse(card)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = parse_completion(await read_json_object(request), model_name)
        echoes = [gateway.prompt_text(p) for p in req.prompts] if req.echo else None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        generation = await gateway.start(req.prompts, req.params, "prompt")
        n = req.params.n
        if req.stream:
            return _sse_response(generation, _completion_events(generation, req, head, echoes, tokenizer))
        usage, choices = _Usage(), []
        for r in await gateway.collect(request, generation):
            usage.add(r)
            logprobs = None
            if req.top_logprobs is not None and r.logprobs:
                logprobs, _ = _completion_logprobs(tokenizer, r.token_ids, r.logprobs, req.top_logprobs,
                                                   len(echoes[r.prompt_index]) if echoes else 0)
            text = (echoes[r.prompt_index] if echoes else "") + r.generated_text
            choices.append({"index": r.prompt_index * n + r.index, "text": text, "logprobs": logprobs,
                            "finish_reason": r.finish_reason})
        return JSONResponse({**head, "choices": choices, "usage": usage.as_dict()})

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = parse_chat(await read_json_object(request), model_name, tokenizer)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        generation = await gateway.start(req.prompts, req.params, "messages")
        if req.stream:
            return _sse_response(generation, _chat_events(generation, req, head, tokenizer))
        usage, choices = _Usage(), []
        for r in await gateway.collect(request, generation):
            usage.add(r)
            logprobs = None
            if req.top_logprobs is not None and r.logprobs:
                logprobs = {"content": _chat_logprobs(tokenizer, r.token_ids, r.logprobs, req.top_logprobs)}
            choices.append({"index": r.index, "message": {"role": "assistant", "content": r.generated_text},
                            "logprobs": logprobs, "finish_reason": r.finish_reason})
        return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage.as_dict()})


async def _completion_events(generation: Generation, req: _Parsed, head: dict, echoes: list[str] | None,
                             tokenizer: Any) -> AsyncIterator[dict]:
    usage, offsets = _Usage(), {}
    tail = {"usage": None} if req.include_usage else {}
    async for d in generation:
        usage.add(d)
        key = (d.prompt_index, d.index)
        text = d.generated_text
        if echoes is not None and key not in offsets:
            text = echoes[d.prompt_index] + text
        offset = offsets.setdefault(key, len(echoes[d.prompt_index]) if echoes else 0)
        final = d.finish_reason != "none"
        logprobs = None
        if req.top_logprobs is not None and d.token_ids and d.logprobs:
            logprobs, offsets[key] = _completion_logprobs(tokenizer, d.token_ids, d.logprobs, req.top_logprobs, offset)
        if text or final or logprobs:
            choice = {"index": d.prompt_index * req.params.n + d.index, "text": text, "logprobs": logprobs,
                      "finish_reason": d.finish_reason if final else None}
            yield {**head, "choices": [choice], **tail}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}


async def _chat_events(generation: Generation, req: _Parsed, head: dict, tokenizer: Any) -> AsyncIterator[dict]:
    head = {**head, "object": "chat.completion.chunk"}
    tail = {"usage": None} if req.include_usage else {}
    for index in range(req.params.n):
        yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}], **tail}
    usage = _Usage()
    async for d in generation:
        usage.add(d)
        final = d.finish_reason != "none"
        logprobs = None
        if req.top_logprobs is not None and d.token_ids and d.logprobs:
            logprobs = {"content": _chat_logprobs(tokenizer, d.token_ids, d.logprobs, req.top_logprobs)}
        delta = {"content": d.generated_text} if d.generated_text else {}
        if delta or final or logprobs:
            yield {**head, "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": d.finish_reason if final else None}], **tail}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}

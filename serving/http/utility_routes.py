"""vLLM's utility routes: `/tokenize`, `/detokenize`, `/version` and `/ping`, with vLLM's shapes.

`POST /tokenize` takes a completion-style body (`prompt`, `add_special_tokens` default true) or a
chat-style one (`messages` and the chat-template options, `add_special_tokens` default false) and
answers `{count, max_model_len, tokens, token_strs}`; `POST /detokenize` turns `{tokens}` back into
`{prompt}`. Both run the tokenizer on a worker thread. `/ping` (GET or POST) answers an empty 200
while the server is up, as vLLM's does for SageMaker-style probes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response as HTTPResponse

from fastgen import __version__
from fastgen.serving.http.guard import ApiError, read_json_object
from fastgen.serving.http.chat import ChatPrompt, chat_prompt, render_chat
from fastgen.serving.http.openai_params import describe, ignored_notice, model_not_found

if TYPE_CHECKING:
    from fastgen.serving.http.gateway import Gateway

__all__ = ["add_utility_routes"]

_COMPLETION_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                          "chat_template_kwargs", "return_token_strs"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _check_body(body: Mapping[str, Any], known: frozenset[str], model_name: str, strict: bool) -> tuple[str, ...]:
    """The body's unknown fields (a 400 for the first in strict mode); a `model` must be the served one."""
    unknown = tuple(sorted(k for k in body if k not in known))
    if unknown and strict:
        raise ApiError(400, f"unknown field {unknown[0][:80]!r} (accepted: {', '.join(sorted(known))})",
                       param=unknown[0][:80])
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise ApiError(400, f"model must be a string, got {describe(model)}", param="model")
        if model != model_name:
            raise model_not_found(model)
    return unknown


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {describe(value)}", param=name)
    return value


def _parse_tokenize(body: Mapping[str, Any], model_name: str, strict: bool,
                    max_chars: int | None) -> tuple[str | ChatPrompt, bool, bool, tuple[str, ...]]:
    """(text or chat, add_special_tokens, return_token_strs, ignored fields) of a `/tokenize` body."""
    if "messages" in body:
        ignored = _check_body(body, _CHAT_FIELDS, model_name, strict)
        chat = chat_prompt(body)
        return chat, chat.add_special_tokens, _flag(body, "return_token_strs", False), ignored
    ignored = _check_body(body, _COMPLETION_FIELDS, model_name, strict)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, f"prompt is required: a string (or send messages), got {describe(prompt)}", param="prompt")
    if max_chars is not None and len(prompt) > max_chars:
        raise ApiError(400, f"prompt has {len(prompt)} characters, more than this model's context can hold (at "
                            f"most {max_chars} characters)", param="prompt")
    return prompt, _flag(body, "add_special_tokens", True), _flag(body, "return_token_strs", False), ignored


def _tokenize(tokenizer: Any, source: str | ChatPrompt, add_special_tokens: bool, with_strs: bool,
              max_chars: int | None) -> tuple[list[int], list[str] | None]:
    ids = (render_chat(tokenizer, source, max_chars) if isinstance(source, ChatPrompt)
           else tokenizer.encode(source, add_special_tokens=add_special_tokens))
    return ids, tokenizer.convert_ids_to_tokens(ids) if with_strs else None


def _vocab_size(tokenizer: Any) -> int | None:
    """How many token ids `tokenizer` can decode (added tokens included), or None when it cannot say."""
    try:
        return len(tokenizer)
    except TypeError:  # not a Hugging Face tokenizer; its vocabulary may still tell
        get_vocab = getattr(tokenizer, "get_vocab", None)
        return len(get_vocab()) if callable(get_vocab) else None


def _parse_detokenize(body: Mapping[str, Any], model_name: str, strict: bool,
                      vocab_size: int | None) -> tuple[list[int], tuple[str, ...]]:
    ignored = _check_body(body, _DETOKENIZE_FIELDS, model_name, strict)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise ApiError(400, f"tokens is required: a list of token ids, got {describe(tokens)}", param="tokens")
    high = vocab_size if vocab_size is not None else 2**63
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < high:
            raise ApiError(400, f"tokens[{i}] must be a token id in [0, {vocab_size or 'inf'}), got "
                                f"{describe(token)}", param="tokens")
    return tokens, ignored


def add_utility_routes(router: APIRouter, gateway: Gateway, model_name: str, max_model_len: int | None,
                       strict_params: bool = False) -> None:
    """Add `/tokenize`, `/detokenize`, `/version` and `/ping` to `router`."""
    tokenizer, offload, max_chars = gateway.tokenizer, gateway.offload, gateway.max_prompt_chars
    vocab_size = _vocab_size(tokenizer)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        source, special, with_strs, ignored = await read_json_object(
            request, offload, lambda body: _parse_tokenize(body, model_name, strict_params, max_chars))
        headers = ignored_notice(request.method, request.url.path, ignored)
        ids, strs = await offload.run(_tokenize, tokenizer, source, special, with_strs, max_chars)
        return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs},
                            headers=headers)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        tokens, ignored = await read_json_object(
            request, offload, lambda body: _parse_detokenize(body, model_name, strict_params, vocab_size))
        headers = ignored_notice(request.method, request.url.path, ignored)
        return JSONResponse({"prompt": await offload.run(tokenizer.decode, tokens)}, headers=headers)

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    async def ping() -> HTTPResponse:
        return HTTPResponse(status_code=200)

    for method in ("GET", "POST"):  # one route each: FastAPI names a route's operation after its first method
        router.add_api_route("/ping", ping, methods=[method])
    router.add_api_route("/ping", ping, methods=["HEAD"], include_in_schema=False)

"""vLLM's utility routes: `/tokenize`, `/detokenize`, `/version` and `/ping`, with vLLM's shapes.

`POST /tokenize` takes a completion-style body (`prompt`, `add_special_tokens` default true) or a
chat-style one (`messages` and the chat-template options, `add_special_tokens` default false) and
answers `{count, max_model_len, tokens, token_strs}`; `POST /detokenize` turns `{tokens}` back into
`{prompt}`. Both run the tokenizer on a worker thread. `/ping` (GET or POST) answers an empty 200
while the server is up, as vLLM's does for SageMaker-style probes.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response as HTTPResponse
from pydantic import BaseModel

from fastgen import __version__
from fastgen.serving.http.chat.messages import ChatPrompt, chat_prompt, render_chat
from fastgen.serving.http.guard import ApiError, read_json_object
from fastgen.serving.http.openai_params import ignored_notice, model_not_found
from fastgen.serving.http.request_models import RequestModels, validate

if TYPE_CHECKING:
    from fastgen.serving.http.gateway import Gateway

__all__ = ["add_utility_routes"]


def _served(request: BaseModel, served: Callable[[str], bool]) -> tuple[str, ...]:
    """The request's unknown fields (kept aside by a lenient model); a `model` must be one `served`
    accepts (the base model or a LoRA adapter: both share the tokenizer)."""
    if request.model is not None and not served(request.model):
        raise model_not_found(request.model)
    return tuple(sorted(request.model_extra or ()))


def _parse_tokenize(body: dict[str, Any], models: RequestModels,
                    served: Callable[[str], bool]) -> tuple[str | ChatPrompt, bool, bool, tuple[str, ...]]:
    """(text or chat, add_special_tokens, return_token_strs, ignored fields) of a `/tokenize` body."""
    if "messages" in body:
        request = validate(models.tokenize_chat, body)
        ignored = _served(request, served)
        chat = chat_prompt(request)
        return chat, chat.add_special_tokens, bool(request.return_token_strs), ignored
    request = validate(models.tokenize, body)
    ignored = _served(request, served)
    return request.prompt, request.add_special_tokens is not False, bool(request.return_token_strs), ignored


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


def _parse_detokenize(body: dict[str, Any], models: RequestModels, served: Callable[[str], bool],
                      vocab_size: int | None) -> tuple[list[int], tuple[str, ...]]:
    request = validate(models.detokenize, body)
    ignored = _served(request, served)
    for i, token in enumerate(request.tokens):
        if vocab_size is not None and token >= vocab_size:
            raise ApiError(400, f"tokens[{i}] must be a token id in [0, {vocab_size}), got {token}", param="tokens")
    return request.tokens, ignored


def add_utility_routes(router: APIRouter, gateway: Gateway, model_name: str, max_model_len: int | None,
                       models: RequestModels, adapters: Container[str] = ()) -> None:
    """Add `/tokenize`, `/detokenize` (bodies validated as `models`; their `model` is `model_name` or one
    of the LoRA `adapters`), `/version` and `/ping` to `router`."""
    tokenizer, offload, max_chars = gateway.tokenizer, gateway.offload, gateway.max_prompt_chars

    def served(model: str) -> bool:
        return model == model_name or model in adapters
    vocab_size = _vocab_size(tokenizer)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        source, special, with_strs, ignored = await read_json_object(
            request, offload, lambda body: _parse_tokenize(body, models, served))
        headers = ignored_notice(request.method, request.url.path, ignored)
        ids, strs = await offload.run(_tokenize, tokenizer, source, special, with_strs, max_chars)
        return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs},
                            headers=headers)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        tokens, ignored = await read_json_object(
            request, offload, lambda body: _parse_detokenize(body, models, served, vocab_size))
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

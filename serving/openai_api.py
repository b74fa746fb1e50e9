"""The OpenAI-compatible API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Bodies are validated by `openai_params` (a 400 naming the field), then run through the
`Gateway`; this module shapes OpenAI's responses and server-sent events. The tokenizer is called
on a worker (`Gateway.offload`), never on the event loop: echoing token-id prompts and spelling out
logprob tokens both decode.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from fastgen.outputs import Response
from fastgen.serving.gateway import generation_error, prompt_texts
from fastgen.serving.http_guard import ApiError, read_json_object
from fastgen.serving.openai_params import Parsed, model_not_found, parse_chat, parse_completion

if TYPE_CHECKING:
    from fastgen.serving.gateway import Gateway, Generation

__all__ = ["ApiError", "add_openai_routes"]


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
        except Exception as exc:  # after the 200 head: the error goes in-band, then the stream ends
            yield f"data: {json.dumps(generation_error(exc).body())}\n\n"
        yield "data: [DONE]\n\n"

    async def release() -> None:
        # Also runs when the client went away mid-stream: aborts what is unfinished.
        generation.close()

    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(release),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def add_openai_routes(router: APIRouter, gateway: Gateway, model_name: str, max_model_len: int | None) -> None:
    """Add `/v1/models`, `/v1/completions` and `/v1/chat/completions` to `router`."""
    tokenizer, offload = gateway.tokenizer, gateway.offload
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
        req = await read_json_object(request, offload, lambda body: parse_completion(body, model_name))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        generation = await gateway.start(req.prompts, req.params, "prompt", req.max_tokens_param)
        try:
            echoes = await offload.run(prompt_texts, tokenizer, req.prompts, False) if req.echo else None
        except BaseException:
            generation.close()
            raise
        n = req.params.n
        if req.stream:
            return _sse_response(generation, _completion_events(generation, req, head, echoes, gateway))
        usage, choices = _Usage(), []
        for r in await gateway.collect(request, generation):
            usage.add(r)
            logprobs = None
            if req.top_logprobs is not None and r.logprobs:
                logprobs, _ = await offload.run(_completion_logprobs, tokenizer, r.token_ids, r.logprobs,
                                                req.top_logprobs, len(echoes[r.prompt_index]) if echoes else 0)
            text = (echoes[r.prompt_index] if echoes else "") + r.generated_text
            choices.append({"index": r.prompt_index * n + r.index, "text": text, "logprobs": logprobs,
                            "finish_reason": r.finish_reason})
        return JSONResponse({**head, "choices": choices, "usage": usage.as_dict()})

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = await read_json_object(request, offload, lambda body: parse_chat(body, model_name))
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        generation = await gateway.start(req.prompts, req.params, "messages", req.max_tokens_param)
        if req.stream:
            return _sse_response(generation, _chat_events(generation, req, head, gateway))
        usage, choices = _Usage(), []
        for r in await gateway.collect(request, generation):
            usage.add(r)
            logprobs = None
            if req.top_logprobs is not None and r.logprobs:
                content = await offload.run(_chat_logprobs, tokenizer, r.token_ids, r.logprobs, req.top_logprobs)
                logprobs = {"content": content}
            choices.append({"index": r.index, "message": {"role": "assistant", "content": r.generated_text},
                            "logprobs": logprobs, "finish_reason": r.finish_reason})
        return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage.as_dict()})


async def _completion_events(generation: Generation, req: Parsed, head: dict, echoes: list[str] | None,
                             gateway: Gateway) -> AsyncIterator[dict]:
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
            logprobs, offsets[key] = await gateway.offload.run(_completion_logprobs, gateway.tokenizer, d.token_ids,
                                                               d.logprobs, req.top_logprobs, offset)
        if text or final or logprobs:
            choice = {"index": d.prompt_index * req.params.n + d.index, "text": text, "logprobs": logprobs,
                      "finish_reason": d.finish_reason if final else None}
            yield {**head, "choices": [choice], **tail}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}


async def _chat_events(generation: Generation, req: Parsed, head: dict, gateway: Gateway) -> AsyncIterator[dict]:
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
            content = await gateway.offload.run(_chat_logprobs, gateway.tokenizer, d.token_ids, d.logprobs,
                                                req.top_logprobs)
            logprobs = {"content": content}
        delta = {"content": d.generated_text} if d.generated_text else {}
        if delta or final or logprobs:
            yield {**head, "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": d.finish_reason if final else None}], **tail}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}

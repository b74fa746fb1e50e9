"""The OpenAI-compatible API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Bodies are validated by `openai_params` (a 400 naming the field), then run through the
`Gateway`; this module shapes OpenAI's (and vLLM's) responses and server-sent events. The
tokenizer is called on a worker (`Gateway.offload`), never on the event loop: echoing token-id
prompts and spelling out logprob tokens both decode.

`echo` with `logprobs` answers as vLLM does: the choice's logprobs cover the prompt's tokens (the
first with null logprobs) and then the generated ones, which is how lm-eval scores loglikelihoods;
with `max_tokens: 0` one token is generated and dropped, so only the prompt comes back.

A chat choice's text is shaped by `chat.output.ChoiceOutput`: reasoning split off by the server's
`--reasoning-parser`, tool calls parsed out by the request's tool plan (`chat.tools.tool_plan`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from fastgen.outputs import Response
from fastgen.serving.backend import ServedAdapters, served_adapters
from fastgen.serving.http.chat.messages import render_chat_text
from fastgen.serving.http.chat.output import ChoiceOutput, chat_message
from fastgen.serving.http.gateway import generation_error
from fastgen.serving.http.guard import ApiError, read_json_object
from fastgen.serving.http.logprobs import chat_logprobs, completion_logprobs, echo_entries, vllm_prompt_logprobs
from fastgen.serving.http.lora_routes import adapter_cards
from fastgen.serving.http.openai_params import Parsed, ignored_notice, model_not_found, parse_chat, parse_completion
from fastgen.serving.http.request_models import RequestModels
from fastgen.serving.http.sse import coalesce

if TYPE_CHECKING:
    from fastgen.serving.http.gateway import Gateway, Generation

__all__ = ["add_openai_routes"]


class _Usage:
    """Token counts of one request: prompts once each (as OpenAI counts with n > 1), every choice.

    `echo_only` requests generate one token that is dropped, and so counted as none.
    """

    def __init__(self, echo_only: bool = False) -> None:
        self._echo_only = echo_only
        self._prompt: dict[int, int] = {}
        self._generated: dict[tuple[int, int], int] = {}

    def add(self, response: Response) -> dict[str, int]:
        """Count `response` (a delta or a whole choice); returns its choice's usage so far."""
        generated = 0 if self._echo_only else response.generated_length
        self._prompt[response.prompt_index] = response.prompt_length
        self._generated[(response.prompt_index, response.index)] = generated
        return _usage(response.prompt_length, generated)

    def as_dict(self) -> dict[str, int]:
        return _usage(sum(self._prompt.values()), sum(self._generated.values()))


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _echo_texts(tokenizer: Any, prompts: list, kept: list[list[int] | None], truncate: int | None) -> list[str]:
    """What `echo` prefixes per prompt: the text as sent (token ids decoded), or the kept tokens'
    text when `truncate_prompt_tokens` may have cut the prompt. Blocking: run on a worker."""
    return [p if isinstance(p, str) and truncate is None else tokenizer.decode(ids if ids is not None else p)
            for p, ids in zip(prompts, kept)]


def _completion_choice(tokenizer: Any, req: Parsed, r: Response, echo: str | None, prompt_ids: list[int] | None,
                       prompt_lps: list | None, index: int) -> dict[str, Any]:
    """One whole `choices[]` item of a completion (blocking: it decodes tokens)."""
    token_ids, entries, text = (([], [], "") if req.echo_only else
                                (r.token_ids, r.logprobs or [None] * len(r.token_ids), r.generated_text))
    if echo is not None:
        text = echo + text
        if prompt_ids is not None:
            token_ids = prompt_ids + token_ids
            entries = (echo_entries(prompt_ids, prompt_lps) or [None] * len(prompt_ids)) + entries
    logprobs = None
    if req.top_logprobs is not None and token_ids:
        logprobs, _ = completion_logprobs(tokenizer, token_ids, entries, req.top_logprobs, 0, req.token_ids_as_text)
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": r.finish_reason}
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = (None if prompt_lps is None else vllm_prompt_logprobs(
            tokenizer, prompt_lps, req.prompt_logprobs, req.token_ids_as_text))
    return choice


def _shared_prompt_logprobs(results: list[Response]) -> dict[int, list]:
    # The engine computes a prompt's logprobs once, on its choice 0; every choice of the prompt shares them.
    return {r.prompt_index: r.prompt_logprobs for r in results if r.prompt_logprobs is not None}


def _sse_response(generation: Generation, events: AsyncIterator[dict], headers: dict[str, str],
                  stream_interval: float) -> StreamingResponse:
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

    return StreamingResponse(coalesce(body(), stream_interval), media_type="text/event-stream",
                             background=BackgroundTask(release),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


async def _thinking(gateway: Gateway, req: Parsed) -> bool | None:
    """Whether the chat reply starts inside its thinking (see `ReasoningFormat.starts_thinking`), read
    off the rendered prompt; a prompt that closed the thinking already lets the constraint start at once."""
    text = await gateway.offload.run(render_chat_text, gateway.tokenizer, req.prompts[0])
    thinking = req.reasoning.starts_thinking(text)
    spec = req.params.structured_outputs
    if thinking is False and spec is not None and spec.reasoning_end is not None:
        req.params = dataclasses.replace(req.params, structured_outputs=dataclasses.replace(spec, reasoning_end=None))
    return thinking


def _tools_refusal(exc: ApiError, req: Parsed) -> ApiError:
    # The grammar backend names the constraint it was given; for tools, that constraint is theirs.
    if req.tools is not None and req.tools.constraint is not None and exc.param == "structured_outputs":
        if req.tools.choice == "auto":
            return ApiError(400, f"tools: strict tools under tool_choice auto cannot be constrained ({exc.message})",
                            param="tools")
        return ApiError(400, f"tools: the functions' parameters are not a JSON schema this server can compile "
                             f"({exc.message})", param="tools")
    return exc


def add_openai_routes(router: APIRouter, gateway: Gateway, model_name: str, max_model_len: int | None,
                      models: RequestModels, tool_call_parser: str | None = None,
                      reasoning_parser: str | None = None, adapters: ServedAdapters | None = None,
                      stream_interval: float = 0.0) -> None:
    """Add `/v1/models`, `/v1/completions` and `/v1/chat/completions` to `router`, their bodies
    validated as `models` (which refuse unknown fields when the app is strict); chat replies are
    parsed with the server's `tool_call_parser` and `reasoning_parser` formats (None: not parsed).
    A request's `model` is `model_name` or one of the LoRA `adapters`, which `/v1/models` lists too.
    Streamed events after a stream's first are sent in one write per `stream_interval` seconds (`coalesce`)."""
    adapters = adapters if adapters is not None else served_adapters(None)
    tokenizer, offload = gateway.tokenizer, gateway.offload
    card: dict[str, Any] = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "fastgen"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len

    @router.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card, *adapter_cards(adapters, model_name)]})

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        if model_id == model_name:
            return JSONResponse(card)
        for adapter in adapter_cards(adapters, model_name):
            if adapter["id"] == model_id:
                return JSONResponse(adapter)
        raise model_not_found(model_id)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = await read_json_object(request, offload,
                                     lambda body: parse_completion(body, models, model_name, adapters))
        headers = ignored_notice(request.method, request.url.path, req.ignored)
        head = {"id": req.response_id("cmpl", uuid.uuid4().hex), "object": "text_completion",
                "created": int(time.time()), "model": req.lora or model_name}
        generation = await gateway.start(req.prompts, req.params, "prompt", req.max_tokens_param, keep_ids=req.echo,
                                         add_special_tokens=req.add_special_tokens, lora=req.lora)
        try:
            echoes = (await offload.run(_echo_texts, tokenizer, req.prompts, generation.prompt_token_ids,
                                        req.params.truncate_prompt_tokens) if req.echo else None)
        except BaseException:
            generation.close()
            raise
        if req.stream:
            return _sse_response(generation, _completion_events(generation, req, head, echoes, gateway), headers,
                                 stream_interval)
        usage, choices = _Usage(req.echo_only), []
        results = await gateway.collect(request, generation)
        shared = _shared_prompt_logprobs(results)
        # Only logprobs decode tokens: without them a choice is built here, not with a hop to a worker.
        decodes = req.top_logprobs is not None or req.prompt_logprobs is not None
        for r in results:
            usage.add(r)
            p = r.prompt_index
            args = (tokenizer, req, r, echoes[p] if echoes else None, generation.prompt_token_ids[p], shared.get(p),
                    p * req.params.n + r.index)
            choices.append(await offload.run(_completion_choice, *args) if decodes else _completion_choice(*args))
        return JSONResponse({**head, "choices": choices, "usage": usage.as_dict()}, headers=headers)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = await read_json_object(request, offload, lambda body: parse_chat(
            body, models, model_name, tool_call_parser, reasoning_parser, adapters))
        headers = ignored_notice(request.method, request.url.path, req.ignored)
        head = {"id": req.response_id("chatcmpl", uuid.uuid4().hex), "created": int(time.time()),
                "model": req.lora or model_name}
        thinking = await _thinking(gateway, req) if req.reasoning is not None else None
        try:
            generation = await gateway.start(req.prompts, req.params, "messages", req.max_tokens_param, lora=req.lora)
        except ApiError as exc:
            raise _tools_refusal(exc, req) from None

        def output() -> ChoiceOutput:
            return ChoiceOutput(req.tools, req.reasoning is not None, thinking)

        if req.stream:
            return _sse_response(generation, _chat_events(generation, req, head, gateway, output), headers,
                                 stream_interval)
        chat = req.prompts[0]
        echo = chat.echo_text() if req.echo else ""
        usage, choices = _Usage(), []
        results = await gateway.collect(request, generation)
        for r in results:
            usage.add(r)
            logprobs = None
            if req.top_logprobs is not None and r.logprobs:
                content = await offload.run(chat_logprobs, tokenizer, r.token_ids, r.logprobs, req.top_logprobs,
                                            req.token_ids_as_text)
                logprobs = {"content": content}
            shaped = output()
            choices.append({"index": r.index, "message": chat_message(shaped, chat.response_role, r.generated_text, echo),
                            "logprobs": logprobs, "finish_reason": shaped.finish_reason(r.finish_reason)})
        body = {**head, "object": "chat.completion", "choices": choices, "usage": usage.as_dict()}
        if req.prompt_logprobs is not None:
            entries = _shared_prompt_logprobs(results).get(0)
            body["prompt_logprobs"] = None if entries is None else await offload.run(
                vllm_prompt_logprobs, tokenizer, entries, req.prompt_logprobs, req.token_ids_as_text)
        return JSONResponse(body, headers=headers)


async def _completion_events(generation: Generation, req: Parsed, head: dict, echoes: list[str] | None,
                             gateway: Gateway) -> AsyncIterator[dict]:
    usage = _Usage(req.echo_only)
    offsets: dict[tuple[int, int], int] = {}
    prompt_lps: dict[int, list] = {}
    tail = {"usage": None} if req.include_usage else {}
    async for d in generation:
        choice_usage = usage.add(d)
        key, p = (d.prompt_index, d.index), d.prompt_index
        if d.prompt_logprobs is not None:
            # On the first delta of choice 0, which comes before any other choice of the prompt starts.
            prompt_lps[p] = d.prompt_logprobs
        token_ids, entries, text = (([], [], "") if req.echo_only else
                                    (d.token_ids, d.logprobs or [None] * len(d.token_ids), d.generated_text))
        if echoes is not None and key not in offsets:
            text = echoes[p] + text
            prompt_ids = generation.prompt_token_ids[p] or []
            token_ids = prompt_ids + token_ids
            entries = (echo_entries(prompt_ids, prompt_lps.get(p)) or [None] * len(prompt_ids)) + entries
        offset = offsets.get(key, 0)
        # vLLM's rule: a chunk's offsets continue from the text sent so far.
        offsets[key] = offset + len(text)
        final = d.finish_reason != "none"
        logprobs = None
        if req.top_logprobs is not None and token_ids:
            logprobs, _ = await gateway.offload.run(completion_logprobs, gateway.tokenizer, token_ids, entries,
                                                    req.top_logprobs, offset, req.token_ids_as_text)
        if text or final or logprobs:
            choice = {"index": p * req.params.n + d.index, "text": text, "logprobs": logprobs,
                      "finish_reason": d.finish_reason if final else None}
            yield {**head, "choices": [choice], **({"usage": choice_usage} if req.continuous_usage else tail)}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}


async def _chat_events(generation: Generation, req: Parsed, head: dict, gateway: Gateway,
                       output: Callable[[], ChoiceOutput]) -> AsyncIterator[dict]:
    head = {**head, "object": "chat.completion.chunk"}
    outputs: dict[int, ChoiceOutput] = {}
    tail = {"usage": None} if req.include_usage else {}
    chat = req.prompts[0]
    echo = chat.echo_text() if req.echo else ""
    usage = _Usage()
    started = False
    async for d in generation:
        choice_usage = usage.add(d)
        if not started:
            # Sent with the first delta, as vLLM does: only then is the prompt's length known for `usage`.
            started = True
            opening = {**choice_usage, "completion_tokens": 0, "total_tokens": d.prompt_length}
            for index in range(req.params.n):
                for delta in ({"role": chat.response_role, "content": ""}, {"content": echo} if echo else None):
                    if delta is not None:
                        yield {**head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                    "finish_reason": None}],
                               **({"usage": opening} if req.continuous_usage else tail)}
        final = d.finish_reason != "none"
        logprobs = None
        if req.top_logprobs is not None and d.token_ids and d.logprobs:
            content = await gateway.offload.run(chat_logprobs, gateway.tokenizer, d.token_ids, d.logprobs,
                                                req.top_logprobs, req.token_ids_as_text)
            logprobs = {"content": content}
        shaped = outputs.setdefault(d.index, output())
        delta = shaped.feed(d.generated_text, final) if d.generated_text or final else {}
        if delta or final or logprobs:
            yield {**head, "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": shaped.finish_reason(d.finish_reason) if final else None}],
                   **({"usage": choice_usage} if req.continuous_usage else tail)}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage.as_dict()}

"""The REST gateway: MII's `/mii/{deployment}`, the OpenAI-compatible API, health and metrics.

One FastAPI app over an engine backend (an `EngineLoop`, or anything with its `submit_async`):
`scripts/serve.py --enable-restful-api` runs it with uvicorn next to the gRPC server, sharing the
engine. Every request is admitted by the `Gateway` (an optional cap on pending sequences answers
429 beyond it, where MII queued without bound), streams its deltas from the engine, and is aborted
when its client goes away, streaming or not, so its KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.responses import Response as HTTPResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastgen.engine_loop import RequestStream
from fastgen.outputs import Response
from fastgen.sampling_params import SamplingParams
from fastgen.serving.metrics import ServingMetrics
from fastgen.serving.openai_api import ApiError, add_openai_routes, normalize_prompts, read_json_object, sampling_params

logger = logging.getLogger("fastgen")

_MII_FIELDS = ("generated_text", "prompt_length", "generated_length", "finish_reason")


class Generation:
    """The engine requests of one HTTP request (one per prompt), read as one stream of deltas.

    Iterate it once with `async for`; each delta's `prompt_index` names its prompt. `close()`
    aborts whatever is unfinished and gives the admission slots back; it is idempotent and runs by
    itself when the iteration ends or is cancelled.
    """

    def __init__(self, gateway: Gateway, streams: list[RequestStream], num_sequences: int, started: float) -> None:
        self.num_sequences = num_sequences
        self._gateway = gateway
        self._streams = streams
        self._started = started
        self._last_token: dict[tuple[int, int], float] = {}
        self._prompts_seen: set[int] = set()
        self._num_finished = 0
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[Response]:
        inbox: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, stream, inbox)) for i, stream in enumerate(self._streams)]
        open_streams = len(pumps)
        try:
            while open_streams:
                item = await inbox.get()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self._observe(item)
                    yield item
        finally:
            for pump in pumps:
                pump.cancel()
            self.close()

    def _observe(self, delta: Response) -> None:
        now = time.perf_counter()
        metrics = self._gateway.metrics
        if delta.prompt_index not in self._prompts_seen:
            self._prompts_seen.add(delta.prompt_index)
            metrics.count_prompt_tokens(delta.prompt_length)
        if delta.token_ids:
            metrics.count_generation_tokens(len(delta.token_ids))
            key = (delta.prompt_index, delta.index)
            last = self._last_token.get(key)
            if last is None:
                metrics.observe_first_token(now - self._started)
            else:
                metrics.observe_inter_token(now - last)
            self._last_token[key] = now
        if delta.finish_reason != "none":
            self._num_finished += 1
            metrics.count_finished(delta.finish_reason)
            if self._num_finished == self.num_sequences:
                metrics.observe_request_latency(now - self._started)

    def close(self) -> None:
        """Abort the unfinished choices (if any) and release the admission slots; idempotent."""
        if self._closed:
            return
        self._closed = True
        unfinished = self.num_sequences - self._num_finished
        if unfinished > 0:
            for stream in self._streams:
                stream.abort()
            self._gateway.metrics.count_finished("abort", unfinished)
        self._gateway.release(self.num_sequences)


async def _pump(prompt_index: int, stream: RequestStream, inbox: asyncio.Queue) -> None:
    try:
        async for delta in stream:
            delta.prompt_index = prompt_index
            inbox.put_nowait(delta)
    except Exception as exc:  # handed to the reader, which raises it in the request's context
        inbox.put_nowait(exc)
    inbox.put_nowait(None)


async def _merge(generation: Generation) -> list[Response]:
    """One whole Response per choice, ordered by prompt, then choice."""
    merged: dict[tuple[int, int], Response] = {}
    async for d in generation:
        key = (d.prompt_index, d.index)
        whole = merged.get(key)
        if whole is None:
            merged[key] = dataclasses.replace(d, token_ids=list(d.token_ids),
                                              logprobs=list(d.logprobs) if d.logprobs else None)
            continue
        whole.generated_text += d.generated_text
        whole.token_ids.extend(d.token_ids)
        if d.logprobs:
            whole.logprobs = (whole.logprobs or []) + d.logprobs
        whole.generated_length = d.generated_length
        whole.finish_reason = d.finish_reason
    return [merged[key] for key in sorted(merged)]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Gateway:
    """Admission, submission and accounting between the HTTP routes and the engine backend."""

    def __init__(self, backend: Any, tokenizer: Any, metrics: ServingMetrics, max_pending_requests: int | None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_pending_requests = max_pending_requests
        # Sequences (prompts x n) admitted and not finished; only the event loop touches it.
        self.pending = 0

    async def start(self, prompts: list[str | list[int]], params: SamplingParams, prompt_param: str) -> Generation:
        """Admit and submit one engine request per prompt; 400 for a request the engine rejects, 429 when full."""
        num_sequences = len(prompts) * params.n
        limit = self.max_pending_requests
        if limit is not None:
            if num_sequences > limit:
                raise ApiError(400, f"this request needs {num_sequences} sequences (prompts x n) but the server "
                                    f"admits at most {limit} at a time", param="n" if params.n > 1 else prompt_param)
            if self.pending + num_sequences > limit:
                raise ApiError(429, f"server is at its limit of {limit} pending sequences "
                                    f"({self.pending} in flight); retry later",
                               code="too_many_pending_requests", headers={"Retry-After": "1"})
        started = time.perf_counter()
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                streams.append(self.backend.submit_async(prompt, params))
        except (ValueError, TypeError) as exc:
            for stream in streams:
                stream.abort()
            message = str(exc)
            if message.startswith("stop_token_ids"):
                raise ApiError(400, message, param="stop_token_ids") from None
            where = f"{prompt_param}[{len(streams)}]: " if len(prompts) > 1 else ""
            raise ApiError(400, where + message, param=prompt_param) from None
        except RuntimeError as exc:
            for stream in streams:
                stream.abort()
            raise ApiError(503, f"the engine is not accepting requests: {exc}", code="engine_unavailable") from None
        self.pending += num_sequences
        self.metrics.set_pending(self.pending)
        return Generation(self, streams, num_sequences, started)

    def release(self, num_sequences: int) -> None:
        """Give back admission slots (called by `Generation.close`)."""
        self.pending -= num_sequences
        self.metrics.set_pending(self.pending)

    async def collect(self, request: Request, generation: Generation) -> list[Response]:
        """Run `generation` to its end: one merged Response per choice. Aborts it if the client disconnects."""
        work = asyncio.ensure_future(_merge(generation))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            generation.close()
        if not work.done():
            raise ApiError(499, "client closed the request before it finished; it was aborted")
        try:
            return work.result()
        except RuntimeError as exc:
            raise ApiError(503, f"generation stopped: {exc}", code="engine_unavailable") from None
        except Exception as exc:
            logger.exception("generation failed")
            raise ApiError(500, f"generation failed: {exc}") from None

    def prompt_text(self, prompt: str | list[int]) -> str:
        """The prompt as OpenAI's `echo` shows it: a text prompt verbatim, token ids decoded."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def full_text_prefix(self, prompt: str | list[int]) -> str:
        """The prompt as `return_full_text` shows it everywhere (pipeline, gRPC): its tokens decoded
        without special tokens."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class _RequestCounter:
    """ASGI middleware counting responses by route template and status (no raw paths: bounded labels)."""

    def __init__(self, app: Any, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = scope.get("route")
            self.metrics.count_request(getattr(route, "path", "unmatched"), status)


def _bearer_auth(api_key: str) -> Callable:
    expected = api_key.encode()

    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), expected):
            raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


def _mii_params(gen: dict[str, Any]) -> SamplingParams:
    names = SamplingParams.field_names()
    for key in gen:
        if key not in names:
            raise ApiError(400, f"unknown generation parameter {key!r} (supported: {', '.join(names)})", param=key)
    return sampling_params(gen)


def _add_mii_routes(router: APIRouter, gateway: Gateway, deployment_name: str,
                    on_terminate: Callable[[], None] | None) -> None:
    @router.post("/mii/{name}")
    async def mii_generate(name: str, request: Request) -> JSONResponse:
        if name != deployment_name:
            raise ApiError(404, f"deployment {name!r} is not served here (this server serves {deployment_name!r})",
                           code="deployment_not_found")
        body = await read_json_object(request)
        if body.get("prompts") is None:
            raise ApiError(400, 'prompts is required: {"prompts": "..." or ["...", ...], <generation kwargs>}',
                           param="prompts")
        prompts = normalize_prompts(body.pop("prompts"), "prompts", flat_ids=False)
        params = _mii_params(body)
        results = await gateway.collect(request, await gateway.start(prompts, params, "prompts"))
        out = []
        for r in results:
            text = (gateway.full_text_prefix(prompts[r.prompt_index]) if params.return_full_text else "") + r.generated_text
            out.append(dict(zip(_MII_FIELDS, (text, r.prompt_length, r.generated_length, r.finish_reason))))
        return JSONResponse(out)

    @router.get("/terminate")
    async def terminate() -> PlainTextResponse:
        if on_terminate is None:
            raise ApiError(501, "this gateway has no deployment to stop: /terminate works when the server runs "
                                "under scripts/serve.py (create_app(on_terminate=...))", code="terminate_unavailable")
        # After the response is sent, as MII did: the caller gets its answer before the server goes.
        return PlainTextResponse(f"terminating deployment {deployment_name}", background=BackgroundTask(on_terminate))


def _check_positive(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def create_app(backend: Any, deployment_name: str, tokenizer: Any, model_name: str, api_key: str | None = None,
               max_model_len: int | None = None, metrics: ServingMetrics | None = None,
               on_terminate: Callable[[], None] | None = None, max_pending_requests: int | None = None) -> FastAPI:
    """The gateway app over `backend` (an `EngineLoop` or anything with its `submit_async`).

    `model_name` is the id OpenAI clients send as `model`; `api_key` (if set) is required as a
    bearer token everywhere but `/health` and `/healthz`; `metrics` (create it with the engine's
    `stats` so `/metrics` shows queue depth and KV usage) is shared with other servers of the
    deployment; `on_terminate` is called after `GET /terminate` answers; `max_pending_requests`
    caps the sequences (prompts x n) in flight through this gateway, answering 429 beyond it.
    """
    if not callable(getattr(backend, "submit_async", None)):
        raise TypeError(f"backend must have submit_async(prompt, params) like EngineLoop, got {type(backend).__name__}")
    for name, value in (("deployment_name", deployment_name), ("model_name", model_name)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if "/" in deployment_name:
        raise ValueError(f"deployment_name must not contain '/', got {deployment_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None")
    _check_positive("max_model_len", max_model_len)
    _check_positive("max_pending_requests", max_pending_requests)
    if metrics is not None and not isinstance(metrics, ServingMetrics):
        raise TypeError(f"metrics must be a ServingMetrics, got {type(metrics).__name__}")
    if on_terminate is not None and not callable(on_terminate):
        raise TypeError("on_terminate must be callable or None")
    metrics = metrics if metrics is not None else ServingMetrics()
    gateway = Gateway(backend, tokenizer, metrics, max_pending_requests)

    # Bodies are parsed by hand (OpenAI-shaped errors), so the generated schema would say little.
    app = FastAPI(title="fastgen", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.add_middleware(_RequestCounter, metrics=metrics)
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    public = APIRouter()
    public.add_api_route("/healthz", lambda: PlainTextResponse("ok"), methods=["GET"])
    public.add_api_route("/health", lambda: JSONResponse({"status": "ok"}), methods=["GET"])
    protected = APIRouter(dependencies=[Depends(_bearer_auth(api_key))] if api_key else [])
    add_openai_routes(protected, gateway, model_name, max_model_len)
    _add_mii_routes(protected, gateway, deployment_name, on_terminate)

    @protected.get("/metrics")
    async def prometheus_metrics() -> HTTPResponse:
        content, content_type = metrics.render()
        return HTTPResponse(content, media_type=content_type)

    app.include_router(public)
    app.include_router(protected)
    return app


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path} (see /v1/models, /v1/completions, /v1/chat/completions, /mii/<deployment>)"
    else:
        message = str(exc.detail)
    return ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None,
                    headers=exc.headers).response()


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

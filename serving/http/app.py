"""The REST gateway: MII's `/mii/{deployment}`, the OpenAI-compatible API, health and metrics.

One FastAPI app over an engine backend (an `EngineLoop`, or anything with its `submit_async`):
`scripts/serve.py --enable-restful-api` runs it with uvicorn next to the gRPC server, sharing the
engine. `HttpGuard` checks keys and body size before any route runs; every request is then
admitted by the `Gateway` (bounds from `ServingLimits`: prompts and `n` per request, sequences in
flight, answering 400/429 beyond them), prepared off the event loop (chat templates, tokenizing
for the context check), streams its deltas from the engine, and is aborted when its client goes
away, streaming or not, so its KV blocks are freed at the next step. One request's failure is its
own: a bad body is a 400 naming the field, an engine failure of that request a 500, and the loop
keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.responses import Response as HTTPResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastgen.serving.admission import PendingBudget
from fastgen.serving.backend import served_adapters
from fastgen.serving.http.gateway import Gateway
from fastgen.serving.http.guard import ApiError, HttpGuard, Offload, public_routes
from fastgen.serving.http.lora_routes import add_lora_routes
from fastgen.serving.http.mii_routes import add_mii_routes
from fastgen.serving.limits import ServingLimits
from fastgen.serving.metrics import ServingMetrics
from fastgen.serving.http.chat.reasoning import REASONING_PARSERS
from fastgen.serving.http.chat.tool_parsers import TOOL_CALL_PARSERS
from fastgen.serving.http.openai_routes import add_openai_routes
from fastgen.serving.http.openapi import install_openapi
from fastgen.serving.http.request_models import RequestModels
from fastgen.serving.http.utility_routes import add_utility_routes

logger = logging.getLogger("fastgen")

__all__ = ["ApiError", "Gateway", "create_app"]


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


def _check_positive(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _merged_limits(limits: ServingLimits | None, api_key: str | None,
                   max_pending_requests: int | None) -> ServingLimits:
    """`limits` with the older `api_key=` / `max_pending_requests=` arguments folded in."""
    if limits is not None and not isinstance(limits, ServingLimits):
        raise TypeError(f"limits must be a ServingLimits or None, got {type(limits).__name__}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None")
    _check_positive("max_pending_requests", max_pending_requests)
    limits = limits if limits is not None else ServingLimits()
    changes: dict[str, Any] = {}
    if api_key is not None and api_key not in limits.api_keys:
        changes["api_keys"] = (*limits.api_keys, api_key)
    if max_pending_requests is not None:
        if limits.max_pending_requests not in (None, max_pending_requests):
            raise ValueError(f"max_pending_requests={max_pending_requests} contradicts "
                             f"limits.max_pending_requests={limits.max_pending_requests}: give it once")
        changes["max_pending_requests"] = max_pending_requests
    return dataclasses.replace(limits, **changes) if changes else limits


def create_app(backend: Any, deployment_name: str, tokenizer: Any, model_name: str, api_key: str | None = None,
               max_model_len: int | None = None, metrics: ServingMetrics | None = None,
               on_terminate: Callable[[], None] | None = None, max_pending_requests: int | None = None,
               limits: ServingLimits | None = None, strict_params: bool = False,
               protect_metrics: bool = False, budget: PendingBudget | None = None,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None,
               stream_interval_ms: float = 0.0) -> FastAPI:
    """The gateway app over `backend` (an `EngineLoop` or anything with its `submit_async`).

    `model_name` is the id OpenAI clients send as `model`. `limits` holds the keys and bounds the
    deployment shares with its gRPC server: any of its `api_keys` (and `api_key`, the older form
    of one key) is required as a bearer token everywhere but the probes (`/health`, `/healthz`,
    `/ping`), `/version` and, unless `protect_metrics`, `/metrics`; bodies over
    `max_body_bytes` get 413; `max_pending_requests` (or the argument of that name) caps the
    sequences (prompts x n) in flight, answering 429 beyond it; `budget` is the deployment's admission
    budget when a gRPC server shares it (default: the gateway's own). `max_model_len` (the engine's
    context) enables the checks that refuse prompts too long for it before they are tokenized,
    and `max_tokens` that cannot fit with its prompt. `metrics` (create it with the engine's
    `stats` so `/metrics` shows queue depth and KV usage) is shared with other servers of the
    deployment (its vLLM-named series get `model_name` as their label); `on_terminate` is called
    after `GET /terminate` answers. OpenAI bodies with fields this server does not know are served
    with those fields ignored (a warning and an `X-Ignored-Fields` header), as vLLM does, or
    refused with a 400 when `strict_params`. `tool_call_parser` (one of `TOOL_CALL_PARSERS`) parses
    tool calls out of chat replies for `tool_choice: auto`; `reasoning_parser` (one of
    `REASONING_PARSERS`) splits a reasoning model's thinking into `reasoning_content` and starts
    structured constraints after it. `stream_interval_ms` > 0 sends a stream's events after its first in
    one write per that many milliseconds (`fastgen.serving.http.sse.coalesce`: fewer writes through a
    proxy; 0, the default, writes each event as it comes). The schema is served at `/openapi.json` (and
    `/docs`).
    """
    if not callable(getattr(backend, "submit_async", None)):
        raise TypeError(f"backend must have submit_async(prompt, params) like EngineLoop, got {type(backend).__name__}")
    for name, value in (("deployment_name", deployment_name), ("model_name", model_name)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if "/" in deployment_name:
        raise ValueError(f"deployment_name must not contain '/', got {deployment_name!r}")
    limits = _merged_limits(limits, api_key, max_pending_requests)
    for name, value, known in (("tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS),
                               ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
        if value is not None and value not in known:
            raise ValueError(f"{name} must be one of {', '.join(known)} or None, got {value!r}")
    _check_positive("max_model_len", max_model_len)
    if metrics is not None and not isinstance(metrics, ServingMetrics):
        raise TypeError(f"metrics must be a ServingMetrics, got {type(metrics).__name__}")
    if on_terminate is not None and not callable(on_terminate):
        raise TypeError("on_terminate must be callable or None")
    if (isinstance(stream_interval_ms, bool) or not isinstance(stream_interval_ms, (int, float))
            or not 0 <= stream_interval_ms <= 10_000):
        raise ValueError(f"stream_interval_ms must be a number of milliseconds in [0, 10000], got {stream_interval_ms!r}")
    metrics = metrics if metrics is not None else ServingMetrics()
    metrics.bind_model(model_name)
    public = public_routes(protect_metrics)
    offload = Offload()
    gateway = Gateway(backend, tokenizer, metrics, limits, max_model_len, offload, budget)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        offload.shutdown()

    app = FastAPI(title="fastgen", summary=f"fastgen serving {model_name} (deployment {deployment_name})",
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json", lifespan=lifespan)
    app.state.gateway = gateway
    # Starlette wraps each middleware added around the previous ones: the counter sees the guard's refusals.
    app.add_middleware(HttpGuard, limits=limits, public=public)
    app.add_middleware(_RequestCounter, metrics=metrics)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    router = APIRouter()

    # Readiness: both probes fail while the deployment drains, so load balancers stop sending to it.
    async def healthz() -> PlainTextResponse:
        if gateway.budget.draining:
            return PlainTextResponse("draining", status_code=503)
        return PlainTextResponse("ok")

    async def health() -> JSONResponse:
        if gateway.budget.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    for path, endpoint in (("/healthz", healthz), ("/health", health)):
        router.add_api_route(path, endpoint, methods=["GET"])
        router.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
    models = RequestModels.build(model_name, limits, gateway.max_prompt_chars, strict_params)
    adapters = served_adapters(backend)
    add_openai_routes(router, gateway, model_name, max_model_len, models, tool_call_parser, reasoning_parser,
                      adapters, stream_interval_ms / 1000)
    add_lora_routes(router, adapters, offload, model_name)
    add_utility_routes(router, gateway, model_name, max_model_len, models, adapters)
    add_mii_routes(router, gateway, deployment_name, models, on_terminate)

    @router.get("/metrics")
    async def prometheus_metrics() -> HTTPResponse:
        # Off the event loop: behind the replica router a scrape asks every replica for its adapters' use.
        content, content_type = await asyncio.to_thread(metrics.render)
        return HTTPResponse(content, media_type=content_type)

    app.include_router(router)
    install_openapi(app, models, deployment_name=deployment_name, limits=limits, public_paths=frozenset(public))
    return app


def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    # One line per refused request, no traceback: a bad body is the caller's, not a fault to debug.
    level = logging.WARNING if exc.status >= 500 else logging.INFO
    logger.log(level, "%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
    return exc.response()


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = (f"no route {request.method} {request.url.path[:200]} (see /v1/models, /v1/completions, "
                   "/v1/chat/completions, /tokenize, /mii/<deployment>, /openapi.json)")
    else:
        message = str(exc.detail)
    return ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None,
                    headers=exc.headers).response()


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

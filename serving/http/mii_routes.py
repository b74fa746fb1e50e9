"""MII's REST routes: `POST /mii/{deployment}` (MII's `prompts` plus generation kwargs by name) and
`GET /terminate`, which stops the deployment.

`GET /terminate` is kept for MII's users, whose client and curl call it, but a GET that stops a
server is also what any web page can fire at `127.0.0.1` (an `<img>` is enough). So a request a
browser marks as coming from another site is refused with a 403: an `Origin` header other than
this server's own, or `Sec-Fetch-Site: cross-site` / `same-site` (another port of the same host is
the same site). Clients that send neither header (MII's client, curl, scripts) are served, behind
the API key whenever one is set (`HttpGuard` checks it before any route runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.background import BackgroundTask

from fastgen.sampling_params import SamplingParams
from fastgen.serving.http.guard import ApiError, read_json_object
from fastgen.serving.http.openai_params import prompts_param, sampling_params
from fastgen.serving.http.request_models import RequestModels, validate

if TYPE_CHECKING:
    from fastgen.serving.http.gateway import Gateway

__all__ = ["add_mii_routes", "cross_site_refusal"]

_CROSS_SITE = frozenset({"cross-site", "same-site"})


def _parse_mii(body: dict[str, Any], models: RequestModels) -> tuple[list[str | list[int]], SamplingParams]:
    """Validate a `/mii/{deployment}` body (as `models.mii`): MII's `prompts` and generation kwargs by name.

    MII's gateway passed the body to its client's `generate(**body)`, so `stream` (a bool) is
    accepted as MII's unary call accepted it; the answer is the full completions either way.
    """
    request = validate(models.mii, body)
    if request.prompts is None:
        raise ApiError(400, 'prompts is required: {"prompts": "..." or ["...", ...], <generation kwargs>}',
                       param="prompts")
    prompts = prompts_param(request.prompts, "prompts", flat_ids=False)
    # What the body set, null included: None means MII's default for temperature and top_k.
    names = request.model_fields_set - {"prompts", "stream"}
    return prompts, sampling_params({name: getattr(request, name) for name in names})


def cross_site_refusal(request: Request) -> ApiError | None:
    """The 403 for a request a browser sent on behalf of another site (by its `Origin` or
    `Sec-Fetch-Site` header), or None when it came from this origin or from no browser at all."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site.strip().lower() in _CROSS_SITE:
        return ApiError(403, f"refused: a browser sent this request from another site (Sec-Fetch-Site: "
                             f"{fetch_site[:40]}); stop the server with curl or MII's client",
                        code="cross_site_request")
    origin = request.headers.get("origin")
    if origin is not None:
        host = request.headers.get("host", "")
        own = f"{request.url.scheme}://{host}".lower()
        if origin.strip().lower() != own:
            return ApiError(403, f"refused: Origin {origin[:100]!r} is not this server's origin ({own[:100]!r}); "
                                 "stop the server with curl or MII's client", code="cross_site_request")
    return None


def add_mii_routes(router: APIRouter, gateway: Gateway, deployment_name: str, models: RequestModels,
                   on_terminate: Callable[[], None] | None) -> None:
    """Add `POST /mii/{deployment_name}` (bodies validated as `models.mii`) and `GET /terminate` (which
    calls `on_terminate` after answering)."""

    @router.post("/mii/{name}")
    async def mii_generate(name: str, request: Request) -> JSONResponse:
        if name != deployment_name:
            raise ApiError(404, f"deployment {name[:100]!r} is not served here (this server serves "
                                f"{deployment_name!r})", code="deployment_not_found")
        prompts, params = await read_json_object(request, gateway.offload, lambda body: _parse_mii(body, models))
        results = await gateway.collect(request, await gateway.start(prompts, params, "prompts"))
        return JSONResponse([r.to_msg_dict() for r in results])

    @router.get("/terminate")
    async def terminate(request: Request) -> PlainTextResponse:
        refusal = cross_site_refusal(request)
        if refusal is not None:
            raise refusal
        if on_terminate is None:
            raise ApiError(501, "this gateway has no deployment to stop: /terminate works when the server runs "
                                "under scripts/serve.py (create_app(on_terminate=...))", code="terminate_unavailable")
        # After the response is sent, as MII did: the caller gets its answer before the server goes.
        return PlainTextResponse(f"terminating deployment {deployment_name}", background=BackgroundTask(on_terminate))

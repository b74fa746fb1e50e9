"""What stands between the network and the REST routes: keys, body size, and bodies that parse safely.

`HttpGuard` (ASGI middleware) checks the bearer key and refuses a body over the limit before any
route runs: by its `Content-Length`, or by counting a chunked body's bytes as they arrive, so an
oversized body is never read whole. `read_json_object` turns what is left into a JSON object or an
OpenAI-shaped 400 naming the offending field: invalid UTF-8, lone surrogates, NaN/Infinity,
numbers out of range and nesting too deep all stop here instead of failing later as a 500.
`Offload` runs blocking work (tokenizer calls, parsing big bodies) on a few worker threads so the
event loop keeps serving every other request meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from fastgen.serving.limits import ServingLimits, bearer_token, key_matches

logger = logging.getLogger("fastgen")

T = TypeVar("T")

PUBLIC_PATHS = frozenset({"/health", "/healthz"})
"""Paths always answered without a key (GET and HEAD only): load balancers probe them unauthenticated."""

_READ = frozenset({"GET", "HEAD"})


def public_routes(protect_metrics: bool = False) -> dict[str, frozenset[str]]:
    """The paths answered without a key, each with its methods: the health probes, `/ping` (GET and
    POST, as SageMaker-style probes send it), `/version`, and `/metrics` unless `protect_metrics`
    (Prometheus scrapers usually hold no key; vLLM leaves it open too)."""
    routes = {path: _READ for path in PUBLIC_PATHS}
    routes.update({"/ping": _READ | {"POST"}, "/version": _READ})
    if not protect_metrics:
        routes["/metrics"] = _READ
    return routes

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and arrays a body may have; real requests need 4 (chat content parts)."""

MAX_JSON_INT = 2**64 - 1
"""Largest integer magnitude in a body (the largest seed); beyond it no field has a meaning."""

_INLINE_PARSE_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones on a worker."""

_ERROR_TYPES = {413: "request_too_large", 429: "rate_limit_error", 499: "client_closed_request",
                501: "not_implemented_error"}


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


class Offload:
    """A few worker threads for blocking work the event loop must not do (tokenizer, big JSON).

    Bounded on purpose: a burst of huge prompts queues here instead of taking every core from the
    engine thread. Tokenizers release the GIL while they encode, so the loop runs on meanwhile.
    """

    def __init__(self, max_workers: int = 2) -> None:
        self.max_workers = max_workers
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread; its exception is raised here."""
        # Started on first use, and again after a shutdown: an app may be served (lifespan) more than once.
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="fastgen-rest-worker")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        """Stop the threads once their current work is done (the app's shutdown calls it)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


class _Constant:
    """A NaN/Infinity literal as the JSON parser met it: reported with its field by `check_json_tree`."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object whose every value is safe to hand on, or a 400 saying what is wrong."""
    if not raw.strip():
        raise ApiError(400, "request body is empty: expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}") \
            from None
    try:
        body = json.loads(text, parse_constant=_Constant)
    except RecursionError:
        raise ApiError(400, f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {_json_kind(body)}")
    check_json_tree(body)
    return body


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return "a boolean" if isinstance(value, bool) else "a number"


def check_json_tree(body: dict[str, Any]) -> None:
    """Raise a 400 naming the field of the first value no route can use: nesting deeper than
    `MAX_JSON_DEPTH`, NaN/Infinity, a float that overflowed, an integer beyond `MAX_JSON_INT`, or a
    string (or key) with a lone surrogate, which no tokenizer nor JSON response can encode."""
    # Iterative with parent links, so neither depth nor a million-element token list costs
    # recursion or a path string per element; the path is spelled out only for the error.
    stack: list[tuple[Any, Any, Any, int]] = [(body, None, None, 0)]
    while stack:
        node = stack.pop()
        value, _, _, depth = node
        if isinstance(value, str):
            _check_text(value, node)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if -MAX_JSON_INT <= value <= MAX_JSON_INT:
                continue
            _fail(node, f"integer with {len(str(abs(value)))} digits is out of range (at most 2**64 - 1)")
        elif isinstance(value, float):
            if not math.isfinite(value):
                _fail(node, "number is out of range (it overflows a 64-bit float)")
        elif isinstance(value, _Constant):
            _fail(node, f"{value.literal} is not a JSON number (numbers must be finite)")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                _fail(node, f"nested too deeply (at most {MAX_JSON_DEPTH} levels of objects and arrays)")
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, (key, node, key, depth + 1))
                    stack.append((item, node, key, depth + 1))
            elif not _plain_list(value):
                for index, item in enumerate(value):
                    stack.append((item, node, index, depth + 1))


def _plain_list(items: list) -> bool:
    """True when `items` are provably all safe numbers, or all ASCII strings, found with one
    C-speed pass: a 2 MB token-id prompt is half a million ints, too many to visit one by one."""
    try:
        # Bounds every |item| at once; any other kind of item (or an int too big for a float
        # beside floats) raises, and the caller then visits the items one by one.
        return sum(map(abs, items)) <= MAX_JSON_INT
    except (TypeError, OverflowError):
        pass
    try:
        return "".join(items).isascii()
    except TypeError:
        return False


def _check_text(text: str, node: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        _fail(node, f"string has a lone surrogate (\\u{ord(text[exc.start]):04x}) at index {exc.start}: "
                    "text must be valid Unicode")


def _fail(node: tuple, problem: str) -> None:
    keys = []
    while node is not None and node[1] is not None:
        keys.append(node[2])
        node = node[1]
    keys.reverse()
    if not keys:
        raise ApiError(400, f"request body: {problem}")
    path = str(keys[0]) + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys[1:])
    raise ApiError(400, f"{_printable(path)}: {problem}", param=_printable(str(keys[0])))


def _printable(text: str) -> str:
    # A field name may itself carry the lone surrogate being reported: escape it so the error encodes.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


async def read_json_object(request: Request, offload: Offload,
                           validate: Callable[[dict[str, Any]], T] | None = None) -> T | dict[str, Any]:
    """The request body as a checked JSON object (see `parse_json_object`), or a 400; with
    `validate`, what `validate(body)` returns (it may raise ApiError too).

    The body's size was bounded by `HttpGuard`; a large one is parsed, checked and validated on a
    worker thread, so the loop is not held for the tens of milliseconds that takes (a 2 MB list of
    token ids is half a million values to look at).
    """
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media = content_type.partition(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise ApiError(400, f"Content-Type must be application/json, got {content_type[:80]!r} "
                                "(curl: add -H 'Content-Type: application/json')")
    raw = await request.body()

    def parse() -> T | dict[str, Any]:
        body = parse_json_object(raw)
        return validate(body) if validate is not None else body

    return parse() if len(raw) <= _INLINE_PARSE_BYTES else await offload.run(parse)


class BodyTooLarge(ApiError):
    """A body over `ServingLimits.max_body_bytes` (HTTP 413); the connection is closed after it."""

    def __init__(self, limit: int, seen: int | None = None) -> None:
        size = f"request body is {seen} bytes, over" if seen is not None else "request body is over"
        super().__init__(413, f"{size} this server's limit of {limit} bytes (max_body_bytes)",
                         code="request_too_large", headers={"Connection": "close"})


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class HttpGuard:
    """ASGI middleware: the bearer key on every path but the public ones, and the body-size limit.

    Both are checked from the headers before the app runs, so a refused request costs no body
    read. A chunked body (no Content-Length) is counted as the app receives it and refused with a
    413 the moment it passes the limit; the rest is never read into memory. `public` maps each
    path answered without a key to its methods (default: `public_routes()`).
    """

    def __init__(self, app: Any, limits: ServingLimits, public: Mapping[str, frozenset[str]] | None = None) -> None:
        self.app = app
        self.limits = limits
        self.public = dict(public if public is not None else public_routes())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            logger.info("refused %s %s: %d %s", scope["method"], scope["path"], refusal.status, refusal.message)
            await refusal.response()(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        seen = 0
        started = False

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge as exc:
            # Raised where no exception handler answered it (e.g. a body read outside a route).
            if started:
                raise
            logger.info("refused %s %s: 413 %s", scope["method"], scope["path"], exc.message)
            await exc.response()(scope, receive, send)
        except Exception as exc:
            # A fault of ours: answered and logged once here, where Starlette's outermost handler
            # would answer and then re-raise it for the server to log a second traceback.
            if started:
                raise
            logger.error("unhandled error in %s %s", scope["method"], scope["path"], exc_info=exc)
            await ApiError(500, f"internal server error: {type(exc).__name__}: {exc}").response()(scope, receive, send)

    def _refusal(self, scope: dict) -> ApiError | None:
        limits = self.limits
        public = scope["method"] in self.public.get(scope["path"], ())
        if limits.requires_key and not public:
            token = bearer_token(_header(scope, b"authorization"))
            if token is None:
                return ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            if not key_matches(token, limits.api_keys):
                return ApiError(401, "incorrect API key", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        length = _header(scope, b"content-length")
        if length is not None:
            digits = length.strip()
            if not (digits.isascii() and digits.isdigit()):
                return ApiError(400, f"Content-Length must be a non-negative integer, got {length[:40]!r}")
            # Compared as text first: a 5000-digit length would not even convert to int.
            if len(digits) > 18 or int(digits) > limits.max_body_bytes:
                return BodyTooLarge(limits.max_body_bytes, int(digits) if len(digits) <= 18 else None)
        return None

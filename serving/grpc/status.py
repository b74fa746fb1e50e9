"""How the gRPC services end a call that failed, and how a client reads such an ending back.

A request rejected at admission (a bad field, a prompt the engine refuses) is INVALID_ARGUMENT
with the error's message (which names the field) and a `fastgen-error-type` trailer; a LoRA
adapter not loaded is NOT_FOUND, one that cannot be unloaded while requests use it
FAILED_PRECONDITION; a full server is RESOURCE_EXHAUSTED with a `retry-after-ms` trailer; a
loading or stopped engine is UNAVAILABLE; a failure after admission (the engine failed the
request mid-stream) is INTERNAL, never INVALID_ARGUMENT. The server keeps serving either way.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NoReturn

import grpc

from fastgen.engine import UnknownLoRAError
from fastgen.sampling_params import FieldTypeError, FieldValueError
from fastgen.serving.admission import Draining, Overloaded
from fastgen.serving.backend import BackendUnavailable, LoRAStateError
from fastgen.serving.grpc.guard import RETRY_AFTER_KEY

if TYPE_CHECKING:
    from fastgen.serving.grpc.server import GrpcServer

logger = logging.getLogger("fastgen.serving")

ERROR_TYPE_KEY = "fastgen-error-type"
"""Trailing-metadata key naming the Python exception class behind an INVALID_ARGUMENT."""
ERROR_FIELD_KEY = "fastgen-error-field"
"""Trailing-metadata key naming the request field an INVALID_ARGUMENT is about, when it names one."""


def rejection(call: grpc.Call) -> Exception | None:
    """The exception of the caller's a failed call stands for (None for other codes): INVALID_ARGUMENT's
    FieldTypeError/FieldValueError with the field its trailer names, NOT_FOUND's `UnknownLoRAError`,
    FAILED_PRECONDITION's `LoRAStateError`."""
    code = call.code()
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownLoRAError(call.details())
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return LoRAStateError(call.details())
    if code != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    trailers = dict(call.trailing_metadata() or ())
    kind = FieldTypeError if trailers.get(ERROR_TYPE_KEY) == "TypeError" else FieldValueError
    return kind(call.details(), trailers.get(ERROR_FIELD_KEY))


def reject(server: GrpcServer, context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """End a call refused at admission with the status that fits `exc` (raises, as `context.abort` does).

    Only here does a ValueError/TypeError mean the client's request was wrong; its kind (the
    builtin's name) and its field (a FieldError's) travel as trailers.
    """
    if isinstance(exc, UnknownLoRAError):
        context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, LoRAStateError):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        trailers = [(ERROR_TYPE_KEY, "TypeError" if isinstance(exc, TypeError) else "ValueError")]
        field = getattr(exc, "field", None)
        if isinstance(field, str) and field.isascii() and field.isprintable():  # what metadata may carry
            trailers.append((ERROR_FIELD_KEY, field))
        context.set_trailing_metadata(tuple(trailers))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, Overloaded):
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(exc.retry_after_ms)),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, Draining):
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    fail(server, context, exc)


def fail(server: GrpcServer, context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """End a call whose request failed after admission (or for a reason not the client's):
    UNAVAILABLE when the engine cannot serve at all, INTERNAL otherwise, whatever the exception's type."""
    if isinstance(exc, BackendUnavailable) or server.engine_stopped(exc):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine is not serving: {exc}")
    logger.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"the server failed the request: {type(exc).__name__}: {exc}")

"""What a gRPC call passes before it runs, and how our clients open channels.

The server side: `ApiKeyInterceptor` (a bearer key on every method but health and reflection)
and TLS credentials from PEM files (the pending budget, shared with REST, is `serving.admission`).
The client side (our clients and the replica router):
`open_channel` (plain or TLS) and `auth_metadata` (the key as call metadata).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import grpc

from fastgen.serving.limits import api_keys_from_env, bearer_token, key_matches

logger = logging.getLogger("fastgen.serving")

AUTH_METADATA_KEY = "authorization"
"""Metadata key carrying `Bearer KEY` (gRPC metadata keys are lower case)."""
RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing-metadata key of a RESOURCE_EXHAUSTED answer: milliseconds to wait before retrying."""
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")
"""Services callable without a key: load balancers probe health, and reflection only describes the API."""


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuse every call but those to `OPEN_SERVICES` unless it carries `authorization: Bearer KEY`
    with one of `keys` (compared in constant time); refused calls get UNAUTHENTICATED."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key (no key = no interceptor)")
        self._keys = keys

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        """The method's handler when the key is right (or the service is open), else one that refuses."""
        method = handler_call_details.method or ""
        handler = continuation(handler_call_details)
        if handler is None or method.lstrip("/").split("/", 1)[0] in OPEN_SERVICES:
            return handler
        header = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                header = value if isinstance(value, str) else value.decode("latin-1")
        token = bearer_token(header)
        if key_matches(token, self._keys):
            return handler
        if header is None:
            message = (f"{method}: this server requires an API key: send the metadata "
                       f"'{AUTH_METADATA_KEY}: Bearer <key>'")
        elif token is None:
            message = f"{method}: the '{AUTH_METADATA_KEY}' metadata must be 'Bearer <key>'"
        else:
            message = f"{method}: the API key is not valid for this server"
        # info, not warning: anyone who can reach the port could otherwise fill the log.
        logger.info("refused %s: %s", method, message.split(": ", 1)[1])
        return _refusal(handler, message)


def _refusal(handler: Any, message: str) -> Any:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED without running it."""
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kind[(bool(handler.request_streaming), bool(handler.response_streaming))]
    # No deserializer: the bytes of an unauthenticated caller never reach the protobuf parser.
    return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


def read_pem(option: str, path: str) -> bytes:
    """The bytes of a PEM file, or ValueError naming the option."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{option} must be a file path, got {path!r}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{option}: {path} is not a PEM file")
    return data


def server_credentials(cert_file: str | None, key_file: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials from a certificate chain and its private key (None when neither is given)."""
    if cert_file is None and key_file is None:
        return None
    if cert_file is None or key_file is None:
        raise ValueError("tls_cert and tls_key go together: give both files (or neither, for plain TCP)")
    return grpc.ssl_server_credentials([(read_pem("tls_key", key_file), read_pem("tls_cert", cert_file))])


def open_channel(address: str, options: list[tuple[str, Any]], tls_root_cert: str | None = None,
                 asynchronous: bool = False) -> Any:
    """A channel to `address`: TLS verified against `tls_root_cert` (a CA or self-signed cert
    file) when given, plain TCP otherwise; an asyncio channel with `asynchronous`."""
    module = grpc.aio if asynchronous else grpc
    if tls_root_cert is None:
        return module.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=read_pem("tls_root_cert", tls_root_cert))
    return module.secure_channel(address, credentials, options=options)


def client_api_key(api_key: str | None) -> str | None:
    """The key a client presents: `api_key`, else the first of `FASTGEN_API_KEY`, else none."""
    if api_key is None:
        keys = api_keys_from_env(None)
        return keys[0] if keys else None
    if not isinstance(api_key, str):
        raise TypeError(f"api_key must be a str or None, got {type(api_key).__name__}")
    return api_keys_from_env(api_key)[0]


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata presenting `api_key` (empty without a key)."""
    return ((AUTH_METADATA_KEY, f"Bearer {api_key}"),) if api_key else ()


__all__ = ["AUTH_METADATA_KEY", "ApiKeyInterceptor", "OPEN_SERVICES", "RETRY_AFTER_KEY", "auth_metadata",
           "client_api_key", "open_channel", "read_pem", "server_credentials"]

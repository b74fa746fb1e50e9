"""What one deployment admits: API keys and the bounds on work per request and per server.

One `ServingLimits` is built from the launcher's flags (or `serve()`'s options) and shared by the
gRPC services and the REST gateway, so both entry points enforce the same keys and bounds.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
from collections.abc import Iterable, Sequence

from fastgen.sampling_params import MAX_N, FieldValueError

API_KEY_ENV = "FASTGEN_API_KEY"
"""Environment variable holding the API key(s) (comma-separated) when no key is given explicitly."""

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
"""Largest HTTP body (and gRPC message) a server reads by default: 8 MiB."""

DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
"""Most prompts one request may carry by default."""

DEFAULT_MAX_N = MAX_N
"""Most completions (`n`) one prompt may ask for by default: all that `SamplingParams` allows."""


def api_keys_from_env(explicit: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The keys to require: `explicit` (one key or several) if given, else `FASTGEN_API_KEY`
    (comma-separated), else none (the server is open)."""
    if explicit is None:
        explicit = os.environ.get(API_KEY_ENV) or None
        if explicit is None:
            return ()
        explicit = [k.strip() for k in explicit.split(",")]
    if isinstance(explicit, str):
        explicit = [explicit]
    keys = tuple(explicit)
    for key in keys:
        if not isinstance(key, str) or not key or key != key.strip():
            raise ValueError("an API key must be a non-empty string without surrounding spaces")
    return keys


def key_matches(presented: str | bytes | None, keys: Iterable[str]) -> bool:
    """True when `presented` equals one of `keys`; every key is compared in constant time, so the
    time taken says nothing about how much of a key was right or which key matched."""
    if presented is None:
        return False
    given = presented.encode() if isinstance(presented, str) else presented
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key.encode())
    return ok


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header value (None if absent or malformed)."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    """Keys and bounds shared by every entry point of one deployment; validated on construction."""

    api_keys: tuple[str, ...] = ()
    """Bearer keys clients must present (any one of them); empty = no authentication."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body (HTTP) or message (gRPC) accepted; larger ones are refused before
    they are read in full (HTTP 413, gRPC RESOURCE_EXHAUSTED)."""

    max_pending_requests: int | None = None
    """Most sequences (prompts x n) in flight at once; beyond it new requests get HTTP 429 /
    gRPC RESOURCE_EXHAUSTED with a retry hint. None = unbounded."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    """Most prompts one request may carry (400 / INVALID_ARGUMENT beyond it)."""

    max_n: int = DEFAULT_MAX_N
    """Most completions (`n`) per prompt (400 / INVALID_ARGUMENT beyond it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", api_keys_from_env(list(self.api_keys)) if self.api_keys else ())
        for name in ("max_body_bytes", "max_prompts_per_request", "max_n"):
            _check_positive(name, getattr(self, name))
        if self.max_pending_requests is not None:
            _check_positive("max_pending_requests", self.max_pending_requests)

    @property
    def requires_key(self) -> bool:
        """Whether clients must present a key."""
        return bool(self.api_keys)

    def allows(self, presented: str | bytes | None) -> bool:
        """Whether a client presenting `presented` (a bare token) may call: always when no key is set."""
        return not self.api_keys or key_matches(presented, self.api_keys)

    def check_request_size(self, num_prompts: int, n: int, field: str = "prompts") -> None:
        """Raise a FieldValueError naming the bound when one request asks for too many prompts (its
        field: `field`, what the request calls its prompts, e.g. MII's "request") or choices ("n")."""
        if num_prompts > self.max_prompts_per_request:
            raise FieldValueError(f"{field}: a request may carry at most {self.max_prompts_per_request} prompts, "
                                  f"got {num_prompts}", field)
        if n > self.max_n:
            raise FieldValueError(f"n must be <= {self.max_n} on this server, got {n}", "n")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")

"""The one admission budget of a deployment: sequences in flight, shared by gRPC and REST.

`ServingLimits.max_pending_requests` bounds the sequences (prompts x n) in flight through the whole
deployment, whichever protocol they came by, so one `PendingBudget` is made per deployment and
handed to both the gRPC server and the REST gateway. A request that could never fit is the
caller's mistake (a FieldValueError naming its field: gRPC INVALID_ARGUMENT, HTTP 400); one that
does not fit now is `Overloaded` (gRPC RESOURCE_EXHAUSTED, HTTP 429), with a retry hint.

The budget is also where a deployment drains: after `drain()` it admits nothing (`Draining`: gRPC
UNAVAILABLE, HTTP 503) while the sequences already admitted run to their end, and `wait_idle`
tells when the last of them has been released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from fastgen.sampling_params import FieldValueError

RETRY_AFTER_MS = 1000
"""The retry hint given when the budget is full."""


class Overloaded(Exception):
    """The pending budget cannot take a request now; the caller should retry after `retry_after_ms`."""

    def __init__(self, message: str, retry_after_ms: int = RETRY_AFTER_MS) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Draining(Exception):
    """The deployment is shutting down: it admits nothing new (gRPC UNAVAILABLE, HTTP 503); the
    requests it admitted before finish."""


class PendingBudget:
    """The sequences (prompts x n) in flight through one deployment, bounded by `limit` (None =
    unbounded). Thread-safe: gRPC's worker threads and the REST event loop take from it at once;
    the lock is held only to compare and add, never across a wait."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be a positive int or None, got {limit!r}")
        self.limit = limit
        self._pending = 0
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._draining = False

    @property
    def pending(self) -> int:
        """Sequences admitted and not yet released."""
        return self._pending

    def acquire(self, count: int, field: str) -> Callable[[], None]:
        """Admit `count` sequences; returns the release (idempotent, callable from any thread).

        A request that could never fit is a FieldValueError naming `field`; one that does not fit
        now raises `Overloaded`.
        """
        limit = self.limit
        if limit is not None and count > limit:
            raise FieldValueError(f"{field}: this request needs {count} sequences (prompts x n) but the server "
                                  f"admits at most {limit} at a time", field)
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down: it finishes the requests it has and admits no "
                               "new ones; send this one to another replica")
            if limit is not None and self._pending + count > limit:
                raise Overloaded(f"server is at its limit of {limit} pending sequences ({self._pending} in flight); "
                                 f"retry in {RETRY_AFTER_MS} ms")
            self._pending += count
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if done:
                    return
                done = True
                self._pending -= count
                self._released.notify_all()

        return release

    @property
    def draining(self) -> bool:
        """Whether `drain()` was called: nothing new is admitted."""
        return self._draining

    def drain(self) -> None:
        """Admit nothing from now on (`acquire` raises `Draining`); what was admitted runs on. Idempotent."""
        with self._lock:
            self._draining = True

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until every admitted sequence has been released (True) or `timeout` seconds pass (False)."""
        with self._released:
            return self._released.wait_for(lambda: self._pending == 0, timeout)


def shared_budget(budget: PendingBudget | None, limit: int | None) -> PendingBudget:
    """`budget` (a deployment's shared one) checked against the limits' `limit`, or a new one of
    that limit when none is given (a server on its own)."""
    if budget is None:
        return PendingBudget(limit)
    if not isinstance(budget, PendingBudget):
        raise TypeError(f"budget must be a PendingBudget or None, got {type(budget).__name__}")
    if budget.limit != limit:
        raise ValueError(f"the shared budget's limit ({budget.limit}) contradicts limits.max_pending_requests "
                         f"({limit}): make the budget from the same ServingLimits")
    return budget

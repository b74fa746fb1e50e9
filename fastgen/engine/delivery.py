"""Where a producer's deltas go: `Deliveries`, the one routing rule of every way out of an engine.

Three producers hand deltas to callers: the `EngineLoop` (one engine on a server thread), the
`Pipeline` (an engine stepped by whichever call or stream is reading) and the replica router (one
gRPC stream per request). Each keeps a `Deliveries`: every open request's sink, by request id. A
request's sink receives each of its deltas, then, once it has ended, its error if it failed and
`END`. A request has ended when every one of its choices has delivered its final delta
(`finish_reason` other than "none"), when a delta carries an error (a failed request delivers
nothing more), or when its producer closes it (an abort, a stream that broke off, a loop that
stopped). A producer whose own stream ends by itself (the replica router's gRPC call) opens its
requests without a choice count and closes them when that stream ends, after its own bookkeeping
for the request (the replica's load) is done. Sinks are usually a `RequestGroup`'s (see
`request_group.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from fastgen.engine.request_group import END, Sink
from fastgen.outputs import Response

__all__ = ["Deliveries"]


class _Open:
    """One open request: its sink and how many of its choices have not finished."""

    __slots__ = ("sink", "remaining")

    def __init__(self, sink: Sink, remaining: int | None) -> None:
        self.sink = sink
        self.remaining = remaining


class Deliveries:
    """The sinks of open requests, by request id, and the rule that ends them (see the module).

    Thread-safe: the replica router delivers from a thread per request while its callers abort.
    A sink is called outside the lock, and never again once its request has ended.
    """

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str, sink: Sink, num_choices: int | None = 1) -> None:
        """Deliver `request_id`'s deltas to `sink` until its `num_choices` choices have finished
        (None: until `close`)."""
        if num_choices is not None and num_choices < 1:
            raise ValueError(f"num_choices must be >= 1, got {num_choices}")
        with self._lock:
            if request_id in self._open:
                raise ValueError(f"request {request_id!r} is already open")
            self._open[request_id] = _Open(sink, num_choices)

    def deliver(self, delta: Response) -> bool:
        """Hand `delta` to its request's sink and end the request if this was its last delta.
        False if the request is not open here (it ended, or belongs to nobody)."""
        if delta.error is not None:
            return self.close(delta.request_id, delta.error)
        with self._lock:
            entry = self._open.get(delta.request_id)
            if entry is None:
                return False
            if delta.finish_reason != "none" and entry.remaining is not None:
                entry.remaining -= 1
            ended = entry.remaining == 0
            if ended:
                del self._open[delta.request_id]
        entry.sink(delta)
        if ended:
            entry.sink(END)
        return True

    def deliver_all(self, deltas: Iterable[Response]) -> None:
        """`deliver` each of a step's deltas, in order."""
        for delta in deltas:
            self.deliver(delta)

    def close(self, request_id: str, error: BaseException | None = None) -> bool:
        """End a request now: its sink gets `error` (if any), then `END`. False if it was not open."""
        with self._lock:
            entry = self._open.pop(request_id, None)
        if entry is None:
            return False
        if error is not None:
            entry.sink(error)
        entry.sink(END)
        return True

    def close_all(self, error: BaseException | None = None) -> list[str]:
        """End every open request with `error`; returns their ids."""
        with self._lock:
            request_ids = list(self._open)
        return [rid for rid in request_ids if self.close(rid, error)]

    def request_ids(self) -> list[str]:
        """The ids of the open requests."""
        with self._lock:
            return list(self._open)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

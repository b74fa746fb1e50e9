"""Drives one `Engine` from a background thread so many callers (server handlers, threads,
asyncio tasks) share its continuous batching.

Callers never touch the engine directly: they send commands (add, abort) through a queue and
read their request's deltas from their own queue. Only the loop thread steps the engine, so the
engine itself needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, InvalidStateError, TimeoutError as FutureTimeout
from typing import Any, Callable

from fastgen.distributed import TensorParallelError
from fastgen.engine import Engine
from fastgen.outputs import Response
from fastgen.sampling_params import SamplingParams

logger = logging.getLogger("fastgen")

_DONE = object()


class RequestStream:
    """The deltas of one submitted request, ending after each of its `n` choices has finished."""

    def __init__(self, loop: "EngineLoop", request_id: str, n: int, deliver: Callable[[Any], None],
                 source: Any) -> None:
        self.request_id = request_id
        self._loop = loop
        self._remaining = n
        self._deliver = deliver
        self._source = source

    def _push(self, item: Any) -> None:
        """Called on the loop thread with a Response, an exception, or `_DONE`."""
        self._deliver(item)

    def __iter__(self) -> Iterator[Response]:
        while True:
            item = self._source.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def __aiter__(self) -> AsyncIterator[Response]:
        while True:
            item = await self._source.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def abort(self) -> None:
        """Cancel the request; its KV blocks are freed at the next step."""
        self._loop.abort(self.request_id)


class EngineLoop:
    """A background thread that owns an `Engine` and steps it while any request is unfinished."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._stopped = threading.Event()
        self.fatal_error: BaseException | None = None
        """Set when the engine can never step again (a tensor-parallel rank died); the loop then stops."""
        self._thread = threading.Thread(target=self._run, name="fastgen-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt: Any, params: SamplingParams | None = None) -> RequestStream:
        """Queue a request; raises here (ValueError/TypeError) if the engine rejects it."""
        deltas: queue.SimpleQueue = queue.SimpleQueue()
        return self._add(prompt, params, deltas.put, deltas)

    def submit_async(self, prompt: Any, params: SamplingParams | None = None) -> RequestStream:
        """Like `submit`, for asyncio code: iterate the result with `async for`.

        Must be called from a running event loop; the call blocks that loop only for the engine's
        validation (at most one step).
        """
        aio_loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        return self._add(prompt, params, lambda item: aio_loop.call_soon_threadsafe(deltas.put_nowait, item), deltas)

    def _add(self, prompt: Any, params: SamplingParams | None, deliver: Callable[[Any], None], source: Any) -> RequestStream:
        if self.fatal_error is not None:
            raise RuntimeError(f"the engine failed: {self.fatal_error}")
        if self._stopped.is_set():
            raise RuntimeError("the engine loop is shut down")
        params = params or SamplingParams()
        future: Future = Future()
        self._commands.put(("add", prompt, params, deliver, source, future))
        while True:
            try:
                return future.result(timeout=0.5)
            except FutureTimeout:
                # The loop may have stopped between our check and the put: nobody would answer.
                if not self._thread.is_alive():
                    self._fail_pending()

    def abort(self, request_id: str) -> None:
        """Cancel a request from any thread; unknown or finished ids are ignored."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything, stop the thread and wait for it."""
        if not self._stopped.is_set():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopped.is_set():
            # Block only when idle; while generating, commands are picked up between steps.
            block = not self.engine.has_unfinished()
            try:
                while True:
                    self._handle(self._commands.get(block=block))
                    block = False
            except queue.Empty:
                pass
            if self._stopped.is_set() or not self.engine.has_unfinished():
                continue
            try:
                deltas = self.engine.step()
            except Exception as exc:  # a failed step must not kill the loop: fail its requests, serve on
                logger.exception("engine step failed; aborting the running requests")
                for request_id in list(self._streams):
                    self.engine.abort(request_id)
                    self._close(request_id, exc)
                if isinstance(exc, TensorParallelError):
                    # No later step can succeed: stop, so the deployment reports it and exits.
                    self.fatal_error = exc
                    self._stopped.set()
                continue
            for delta in deltas:
                self._route(delta)
        self._fail_pending()

    def _fail_pending(self) -> None:
        """Answer every queued command of a stopped loop: its requests can never run."""
        error = RuntimeError(f"the engine failed: {self.fatal_error}" if self.fatal_error is not None
                             else "the engine loop is shut down")
        while True:
            try:
                command = self._commands.get(block=False)
            except queue.Empty:
                return
            if command[0] == "add":
                try:
                    command[-1].set_exception(error)
                except InvalidStateError:  # answered meanwhile by the other thread draining the queue
                    pass

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, prompt, params, deliver, source, future = command
            try:
                request_id = self.engine.add_request(prompt, params)
            except Exception as exc:
                future.set_exception(exc)
                return
            stream = RequestStream(self, request_id, params.n, deliver, source)
            self._streams[request_id] = stream
            future.set_result(stream)
        elif kind == "abort":
            request_id = command[1]
            stream = self._streams.get(request_id)
            for delta in self.engine.abort(request_id):
                if stream is not None and delta.finish_reason == "abort":
                    stream._push(delta)  # choices that had already finished were delivered before
            self._close(request_id, None)
        elif kind == "stop":
            for request_id in list(self._streams):
                self.engine.abort(request_id)
                self._close(request_id, RuntimeError("the engine loop was shut down"))
            self._stopped.set()

    def _route(self, delta: Response) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        stream._push(delta)
        if delta.finish_reason != "none":
            stream._remaining -= 1
            if stream._remaining == 0:
                self._close(delta.request_id, None)

    def _close(self, request_id: str, error: BaseException | None) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            if error is not None:
                stream._push(error)
            stream._push(_DONE)

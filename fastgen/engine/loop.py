"""Drives one `Engine` from a background thread so many callers (server handlers, threads,
asyncio tasks) share its continuous batching.

Callers never touch the engine directly: they send commands (add, abort) through a queue, and
each request's deltas go to the sink it was submitted with (a `RequestGroup`'s; see
`delivery.py` for when a sink ends). Only the loop thread steps the engine, so the engine itself
needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any, Callable

from fastgen.executor.distributed import TensorParallelError
from fastgen.engine.admission import PreparedRequest
from fastgen.engine.delivery import Deliveries
from fastgen.engine.engine import Engine
from fastgen.engine.step.output import RequestFailed
from fastgen.engine.request_group import Sink
from fastgen.sampling_params import SamplingParams

logger = logging.getLogger("fastgen")

__all__ = ["EngineLoop", "LoopRequest", "RequestFailed"]

TOKENIZER_THREADS = 4
"""Threads that tokenize `submit_async` prompts, so neither an event loop nor the engine thread
ever spends time in the tokenizer (fast tokenizers release the GIL while they encode)."""


class LoopRequest:
    """One request submitted to an `EngineLoop` (a `RequestGroup` member): its id and `abort()`."""

    def __init__(self, loop: "EngineLoop", request_id: str) -> None:
        self.request_id = request_id
        self._loop = loop

    def abort(self) -> None:
        """Cancel the request; its KV blocks are freed at the next step and its sink ends."""
        self._loop.abort(self.request_id)


class EngineLoop:
    """Owns an `Engine` and steps it while any request is unfinished: on a background thread, or on
    the thread that calls `run()` (`thread=False`).

    Which thread steps matters on a CPU. torch's OpenMP runtime (libgomp) counts every thread that
    ever led a parallel region, the main thread always among them, and once they outnumber the cores
    its workers stop spinning between regions and sleep; each of a step's ~1,000 small ops then waits
    for a worker to wake. Measured on 2 cores: a `[256, 1536]` fp32 multiply 26 us from the main
    thread, 125 us from another once the main thread had run one (69 us if it never had); a whole
    engine stepped off the main thread made 5300-5700 against 7200-9500 tok/s. So a process steps
    its engine on the main thread (`run()`), or, where the main thread is not its own (a Ray actor),
    builds and steps it on one thread (`start()`): building runs parallel regions too (loading,
    packing, the warm-up step), and a second thread that led them throttles the first for good
    (a Serve replica built on its event loop's thread: 178-244 against 310-332 tok/s once built
    on the stepping thread, SmolLM2-135M bf16 on 2 cores).
    """

    def __init__(self, engine: Engine, thread: bool = True) -> None:
        """Start stepping `engine` on a background thread; `thread=False` leaves the stepping to the
        caller's `run()` (the process's main thread, see `run`)."""
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._deliveries = Deliveries()  # touched only on the loop thread
        self._stopped = threading.Event()
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="fastgen-tokenize")
        self.fatal_error: BaseException | None = None
        """Set when the engine can never step again (a tensor-parallel rank died); the loop then stops."""
        self._idle_check: Callable[[], bool] | None = None
        self._idle_wait: float | None = None  # how long an idle loop blocks for a command; None: until one comes
        self._own_thread = thread
        self._thread = threading.Thread(target=self._run, name="fastgen-engine-loop", daemon=True)
        if thread:
            self._thread.start()

    @classmethod
    def start(cls, build: Callable[[], Engine]) -> "EngineLoop":
        """Call `build()` on a new thread and step the engine it returns there, the only thread that
        touches it (see the class docstring for why). Returns once the engine is built; re-raises
        what `build` raised, and then no thread is left behind."""
        built: Future = Future()

        def own_thread() -> None:
            try:
                loop = cls(build(), thread=False)
            except BaseException as exc:
                built.set_exception(exc)
                return
            loop._own_thread, loop._thread = True, threading.current_thread()
            built.set_result(loop)
            loop._run()

        thread = threading.Thread(target=own_thread, name="fastgen-engine-loop", daemon=True)
        thread.start()
        try:
            return built.result()
        except BaseException:
            thread.join()
            raise

    def run(self, idle_check: Callable[[], bool] | None = None, interval: float = 0.2) -> None:
        """Step the engine on the calling thread until `shutdown()`, or until `idle_check()` (called
        between steps and every `interval` s while idle) returns True; then every request still open
        is aborted with an error. For an `EngineLoop(engine, thread=False)`: the process's main thread
        is the best place to step an engine (see the class docstring).
        """
        if self._own_thread:
            raise RuntimeError("this EngineLoop already steps on its own thread")
        self._idle_check = idle_check
        self._idle_wait = None if idle_check is None else interval
        self._thread = threading.current_thread()
        try:
            self._run()
        finally:
            self._abort_all(RuntimeError("the engine loop stopped"))

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (what `submit_group` needs for `return_full_text`)."""
        return self.engine.tokenizer

    def submit(self, prompt: Any, params: SamplingParams | None, deliver: Sink,
               lora: str | None = None) -> LoopRequest:
        """Queue a request, run under the LoRA adapter named `lora` (None: the base model), whose deltas
        go to `deliver` (a `RequestGroup` sink, called on the engine thread); raises here
        (ValueError/TypeError, `UnknownLoRAError`) if the engine rejects it. To read one prompt's
        deltas, `submit_group(loop, [prompt], params)` builds the group.

        The prompt is tokenized and validated on the calling thread; the engine thread only queues it.
        """
        self._check_running()
        prepared = self.engine.prepare(prompt, params, lora)
        future = self._add(prepared, deliver)
        while True:
            try:
                return future.result(timeout=0.5)
            except FutureTimeout:
                # The loop may have stopped between our check and the put: nobody would answer. (A
                # `thread=False` loop whose `run()` has not begun yet will answer.)
                if self._stopped.is_set() or (self._own_thread and not self._thread.is_alive()):
                    self._fail_pending()

    async def submit_async(self, prompt: Any, params: SamplingParams | None, deliver: Sink,
                           lora: str | None = None) -> LoopRequest:
        """`submit` for asyncio code (`deliver` is an asynchronous `RequestGroup`'s sink).

        Tokenizing runs on the loop's tokenizer threads and acceptance is awaited, so the event loop
        is never blocked, however long the prompt or the current engine step.
        """
        self._check_running()
        aio_loop = asyncio.get_running_loop()
        prepared = await aio_loop.run_in_executor(self._tokenizers, self.engine.prepare, prompt, params, lora)
        return await asyncio.wrap_future(self._add(prepared, deliver))

    @property
    def stopped(self) -> bool:
        """True once the loop no longer takes requests (shut down, or the engine failed for good)."""
        return self._stopped.is_set()

    def _check_running(self) -> None:
        if self.fatal_error is not None:
            raise RuntimeError(f"the engine failed: {self.fatal_error}")
        if self._stopped.is_set():
            raise RuntimeError("the engine loop is shut down")

    def _add(self, prepared: PreparedRequest, deliver: Sink) -> Future:
        future: Future = Future()
        self._commands.put(("add", prepared, deliver, future))
        if self._stopped.is_set():  # the loop may have drained its queue for the last time already
            self._fail_pending()
        return future

    def call(self, function: Callable[[Engine], Any]) -> Future:
        """Run `function(engine)` on the loop thread between steps (what changes the engine from another
        thread, e.g. loading a LoRA adapter); the future gets its result or exception."""
        future: Future = Future()
        self._commands.put(("call", function, future))
        if self._stopped.is_set():
            self._fail_pending()
        return future

    def abort(self, request_id: str) -> None:
        """Cancel a request from any thread; unknown or finished ids are ignored."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything and stop stepping; waits for the loop's own thread (a `run()` elsewhere
        returns after its current step)."""
        if not self._stopped.is_set():
            self._commands.put(("stop",))
            if self._own_thread:
                self._thread.join(timeout)
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stopped.is_set():
            # Block only when idle; while generating, commands are picked up between steps.
            block = not self.engine.has_unfinished()
            try:
                while True:
                    self._handle(self._commands.get(block=block, timeout=self._idle_wait))
                    block = False
            except queue.Empty:
                pass
            if self._idle_check is not None and self._idle_check():
                self._stopped.set()
                break
            if self._stopped.is_set() or not self.engine.has_unfinished():
                continue
            try:
                deltas = self.engine.step()
            except Exception as exc:  # an engine fault: the step's requests cannot go on, the loop serves on
                logger.exception("engine step failed; aborting the running requests")
                if isinstance(exc, TensorParallelError):
                    error: BaseException = exc
                    # No later step can succeed: stop, so the deployment reports it and exits.
                    self.fatal_error = exc
                    self._stopped.set()
                else:
                    # A server error for every victim, whatever the exception's type: never a caller's
                    # "invalid argument".
                    error = RequestFailed(f"the engine step failed: {type(exc).__name__}: {exc}")
                    error.__cause__ = exc
                for request_id in self._deliveries.close_all(error):
                    self.engine.abort(request_id)
                continue
            self._deliveries.deliver_all(deltas)
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
            if command[0] in ("add", "call"):
                try:
                    command[-1].set_exception(error)
                except InvalidStateError:  # answered meanwhile by the other thread draining the queue
                    pass

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, prepared, deliver, future = command
            if future.done():  # answered by `_fail_pending` on another thread
                return
            try:
                request_id = self.engine.add_request(prepared)
            except Exception as exc:
                future.set_exception(exc)
                return
            self._deliveries.open(request_id, deliver, prepared.params.n)
            future.set_result(LoopRequest(self, request_id))
        elif kind == "call":
            _, function, future = command
            if future.done():  # answered by `_fail_pending` on another thread
                return
            try:
                future.set_result(function(self.engine))
            except Exception as exc:
                future.set_exception(exc)
        elif kind == "abort":
            request_id = command[1]
            for delta in self.engine.abort(request_id):
                if delta.finish_reason == "abort":  # choices that had already finished were delivered before
                    self._deliveries.deliver(delta)
            self._deliveries.close(request_id)
        elif kind == "stop":
            self._abort_all(RuntimeError("the engine loop was shut down"))

    def _abort_all(self, error: BaseException) -> None:
        """Abort every open request, ending its sink with `error`, and stop taking requests."""
        for request_id in self._deliveries.close_all(error):
            self.engine.abort(request_id)
        self._stopped.set()

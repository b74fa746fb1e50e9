"""Grammars compiled off the engine thread, once per (backend, tokenizer, spec).

`GrammarCompiler.submit` parses the spec on the caller's thread (cheap: an invalid schema, regex or
grammar raises there, before anything is queued) and hands the slow tokenizer-dependent compile to a
small thread pool. Identical specs share one compile (the cache keeps the future, so a second request
for a schema being compiled waits for the same work). The engine keeps a request queued, blocking no
one, until its `PendingGrammar` is ready, and fails it with a clear error when the compile fails or
outlasts `timeout_s` (a compile cannot be interrupted; it finishes in the background and is cached).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fastgen.engine.grammar.backend import GrammarBackend
from fastgen.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("fastgen")

COMPILE_THREADS = 2
"""Grammars compiled at once; more would take cores from the engine's own step."""

COMPILE_TIMEOUT_S = 60.0
"""A compile still running after this long fails its requests (xgrammar compiles a large schema
for a 50k-token vocabulary in well under a second; minutes mean a pathological grammar)."""

CACHE_SIZE = 512
"""Compiled grammars kept (least recently used dropped first)."""


class GrammarCompileError(RuntimeError):
    """A grammar that parsed could not be compiled, or its compile took longer than allowed."""


class PendingGrammar:
    """One request's grammar: compiling in the pool, then ready (or failed)."""

    __slots__ = ("spec", "_future", "_deadline", "_timeout_s")

    def __init__(self, spec: StructuredOutputsParams, future: Future, timeout_s: float) -> None:
        self.spec = spec
        self._future = future
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s

    @property
    def ready(self) -> bool:
        """True once compiled (or failed: `error` says which)."""
        return self._future.done() or time.monotonic() > self._deadline

    @property
    def error(self) -> BaseException | None:
        """Why this grammar cannot be used (a failed or overlong compile); None while fine."""
        if not self._future.done():
            if time.monotonic() > self._deadline:
                return GrammarCompileError(
                    f"structured_outputs.{self.spec.kind}: compiling the grammar took more than {self._timeout_s:g} s "
                    "(a simpler schema or grammar compiles faster)")
            return None
        return self._future.exception()

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for the compile (the engine's idle wait when only compiles are pending)."""
        try:
            self._future.exception(timeout=max(0.0, min(timeout_s, self._deadline - time.monotonic())))
        except TimeoutError:
            pass

    def result(self) -> Any:
        """The compiled grammar; raises `error` when there is one."""
        error = self.error
        if error is not None:
            raise error
        return self._future.result()


class GrammarCompiler:
    """A backend's compile pool and cache."""

    def __init__(self, backend: GrammarBackend, tokenizer_key: str, timeout_s: float = COMPILE_TIMEOUT_S,
                 threads: int = COMPILE_THREADS, cache_size: int = CACHE_SIZE) -> None:
        """`tokenizer_key` names the tokenizer the backend was built for (part of each cache key)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.backend = backend
        self.timeout_s = timeout_s
        self._tokenizer_key = tokenizer_key
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastgen-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # submit runs on callers' threads
        self.compile_seconds: list[float] = []
        """Wall time of each compile that ran (cache hits excluded), for benchmarks and metrics."""

    def submit(self, spec: StructuredOutputsParams) -> PendingGrammar:
        """Parse `spec` now (raises `FieldValueError` with the compiler's message) and compile it in the
        pool, or reuse the cached compile of the same spec. Safe on any thread."""
        key = (self.backend.name, self._tokenizer_key, _spec_key(spec))
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return PendingGrammar(spec, future, self.timeout_s)
        parsed = self.backend.parse(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, spec, parsed)
                self._cache[key] = future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return PendingGrammar(spec, future, self.timeout_s)

    def _compile(self, spec: StructuredOutputsParams, parsed: Any) -> Any:
        started = time.perf_counter()
        try:
            compiled = self.backend.compile(parsed)
        except Exception as exc:
            raise GrammarCompileError(f"structured_outputs.{spec.kind}: {self.backend.name} could not compile the "
                                      f"grammar: {exc}") from exc
        seconds = time.perf_counter() - started
        self.compile_seconds.append(seconds)
        logger.debug("fastgen: compiled a %s grammar in %.3f s", spec.kind, seconds)
        return compiled

    def shutdown(self) -> None:
        """Stop the pool (running compiles finish; queued ones are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _spec_key(spec: StructuredOutputsParams) -> tuple:
    # reasoning_end changes where a matcher starts, not the grammar: it is not part of the key.
    return (spec.json, spec.regex, spec.choice, spec.grammar, spec.json_object, spec.structural_tag,
            spec.whitespace_pattern, spec.disable_any_whitespace)

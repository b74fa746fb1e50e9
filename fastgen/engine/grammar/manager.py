"""The engine's side of structured outputs (vLLM's `StructuredOutputManager`): the backend and its
compile pool for the engine's tokenizer, each request's grammar when it is prepared, and each step's
token bitmask over the rows that sample.

The backend is built on the first constrained request, so an engine that never sees one never loads
a grammar library.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from fastgen.engine.grammar.backend import GrammarBackend, make_backend
from fastgen.engine.grammar.bitmask import allocate_bitmask
from fastgen.engine.grammar.compiler import COMPILE_TIMEOUT_S, GrammarCompiler, PendingGrammar
from fastgen.engine.grammar.sequence_grammar import SequenceGrammar
from fastgen.sampling_params import FieldValueError
from fastgen.structured_outputs import StructuredOutputsParams


class ConstrainedRow(Protocol):
    """What the manager reads of a sequence (`fastgen.engine.sequence.Sequence`)."""

    grammar: SequenceGrammar | None
    output_token_ids: list[int]


class PreparedGrammar:
    """A request's compile and where its constraint starts; one `SequenceGrammar` per choice."""

    __slots__ = ("pending", "start_after", "_backend")

    def __init__(self, pending: PendingGrammar, start_after: tuple[int, ...], backend: GrammarBackend) -> None:
        self.pending = pending
        self.start_after = start_after
        self._backend = backend

    def for_sequence(self) -> SequenceGrammar:
        """A fresh grammar state for one of the request's sequences."""
        return SequenceGrammar(self.pending, self._backend, self.start_after)


class StructuredOutputManager:
    """Grammars for one engine: compiled off the engine thread, masks filled per step."""

    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int, stop_rules: Any,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """`stop_rules.eos_token_ids` (read when the backend is built) end every grammar."""
        self.backend_name = backend_name
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_rules = stop_rules
        self._timeout_s = timeout_s
        self._compiler: GrammarCompiler | None = None
        self._compiling: dict[str, SequenceGrammar] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        """The compile pool (built, with its backend, on first use)."""
        if self._compiler is None:
            backend = make_backend(self.backend_name, self._tokenizer, self._vocab_size,
                                   sorted(self._stop_rules.eos_token_ids))
            key = f"{getattr(self._tokenizer, 'name_or_path', '')}:{len(self._tokenizer)}:{self._vocab_size}"
            self._compiler = GrammarCompiler(backend, key, self._timeout_s)
        return self._compiler

    def prepare(self, spec: StructuredOutputsParams) -> PreparedGrammar:
        """Validate `spec` with the backend (FieldValueError naming the key and the compiler's message)
        and start its compile. Safe on any thread."""
        try:
            compiler = self.compiler
        except ValueError as exc:  # the backend's package is missing
            raise FieldValueError(str(exc), "structured_outputs") from None
        start_after: tuple[int, ...] = ()
        if spec.reasoning_end is not None:
            start_after = tuple(self._tokenizer.encode(spec.reasoning_end, add_special_tokens=False))
        return PreparedGrammar(compiler.submit(spec), start_after, compiler.backend)

    def track(self, request_id: str, grammar: SequenceGrammar) -> None:
        """Watch a queued request whose grammar is still compiling (see `unusable`)."""
        self._compiling[request_id] = grammar

    def unusable(self) -> list[tuple[str, BaseException]]:
        """The tracked requests whose compile failed or ran too long, with why; tracked requests whose
        grammar is ready are forgotten. (A request that ended meanwhile is failed again harmlessly: the
        engine ignores ids it no longer has.)"""
        out = []
        for request_id, grammar in list(self._compiling.items()):
            if grammar.ready:
                del self._compiling[request_id]
                if grammar.pending.error is not None:
                    out.append((request_id, grammar.pending.error))
        return out

    def wait_for_compile(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for a tracked compile; False (at once) when none is tracked."""
        if not self._compiling:
            return False
        next(iter(self._compiling.values())).pending.wait(timeout_s)
        return True

    def fill_bitmask(self, rows: list[ConstrainedRow], histories: list[list[int]] | None = None,
                     ) -> tuple[Tensor | None, list[int]]:
        """The step's bitmask over `rows` (the sequences that sample, in row order) and the rows it
        constrains; (None, []) when none is. `histories[i]` is what row i's token follows (default
        its output; a verification row's later positions follow its drafts too). Raises what a
        row's matcher raises (`GrammarRejected`)."""
        constrained = [i for i, seq in enumerate(rows) if seq.grammar is not None]
        if not constrained:
            return None, []
        histories = histories or [seq.output_token_ids for seq in rows]
        bitmask = allocate_bitmask(len(rows), self._vocab_size)
        filled = [i for i in constrained if rows[i].grammar.fill(bitmask, i, histories[i])]
        return (bitmask, filled) if filled else (None, [])

    def shutdown(self) -> None:
        """Stop the compile pool."""
        if self._compiler is not None:
            self._compiler.shutdown()

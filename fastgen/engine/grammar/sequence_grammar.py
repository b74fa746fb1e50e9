"""One sequence's grammar state, kept in step with its generated tokens.

The matcher is synced to the sequence's output ids before each use: tokens appended since are
accepted, tokens removed since (a speculative draft rejected, a recompute that drops tokens) are
rolled back. So whatever the scheduler does to a sequence (preempt it, recompute its KV, fork it
for `n`), its matcher describes exactly the tokens it has. With `start_after` (a reasoning model's
end-of-thinking token ids), the constraint applies only to the tokens after their first occurrence.
"""

from __future__ import annotations

from torch import Tensor

from fastgen.engine.grammar.backend import GrammarBackend, Matcher
from fastgen.engine.grammar.compiler import PendingGrammar


class GrammarRejected(ValueError):
    """A token the grammar does not allow reached the matcher (the mask was not applied to it)."""


class SequenceGrammar:
    """The grammar of one sequence: its pending compile, then its matcher."""

    __slots__ = ("pending", "_backend", "_matcher", "_start_after", "_start", "_num_accepted")

    def __init__(self, pending: PendingGrammar, backend: GrammarBackend, start_after: tuple[int, ...] = ()) -> None:
        """`start_after`: token ids after whose first occurrence in the output the constraint starts
        (empty: from the first generated token)."""
        self.pending = pending
        self._backend = backend
        self._matcher: Matcher | None = None
        self._start_after = tuple(start_after)
        self._start: int | None = None if start_after else 0
        self._num_accepted = 0

    @property
    def ready(self) -> bool:
        """Whether the compile has finished (successfully or not: see `pending.error`)."""
        return self.pending.ready

    def fork(self) -> SequenceGrammar:
        """A state for a sibling choice: same compile, its own matcher."""
        return SequenceGrammar(self.pending, self._backend, self._start_after)

    def active(self, output_token_ids: list[int]) -> bool:
        """Whether the constraint applies to the next token (False while a reasoning model still thinks)."""
        return self._find_start(output_token_ids) is not None

    def fill(self, bitmask: Tensor, row: int, output_token_ids: list[int]) -> bool:
        """Write the next token's allowed ids into `bitmask[row]`; False (row untouched) while the
        constraint has not started."""
        matcher = self._synced(output_token_ids)
        if matcher is None:
            return False
        matcher.fill(bitmask, row)
        return True

    def is_terminated(self, output_token_ids: list[int]) -> bool:
        """Sync with `output_token_ids` and say whether the grammar has ended (its stop token was accepted).

        Raises `GrammarRejected` if a token the grammar forbids is among them."""
        matcher = self._synced(output_token_ids)
        return matcher is not None and matcher.is_terminated()

    def _find_start(self, output: list[int]) -> int | None:
        if self._start is not None and self._start > len(output):
            self._start = None  # the end-of-thinking marker itself was rolled back
        if self._start is None and self._start_after:
            n = len(self._start_after)
            first = self._start_after[0]
            for i in range(len(output) - n + 1):
                if output[i] == first and tuple(output[i:i + n]) == self._start_after:
                    self._start = i + n
                    break
        return self._start

    def _synced(self, output: list[int]) -> Matcher | None:
        start = self._find_start(output)
        if start is None:
            if self._matcher is not None and self._num_accepted:
                self._matcher.rollback(self._num_accepted)
                self._num_accepted = 0
            return None
        if self._matcher is None:
            self._matcher = self._backend.matcher(self.pending.result())
        wanted = len(output) - start
        if self._num_accepted > wanted:
            self._matcher.rollback(self._num_accepted - wanted)
            self._num_accepted = wanted
        for token in output[start + self._num_accepted:]:
            if not self._matcher.accept(token):
                raise GrammarRejected(f"token {token} is not allowed by the {self.pending.spec.kind} constraint "
                                      f"after {self._num_accepted} constrained tokens")
            self._num_accepted += 1
        return self._matcher

"""One sequence's grammar state, kept in step with its generated tokens.

The matcher is synced to the sequence's output ids before each use: it keeps the constrained
tokens it accepted, rolls back those after the longest prefix they share with the output (a
speculative draft rejected, a recompute that drops tokens) and accepts the output's tokens after
it. So whatever the scheduler does to a sequence (preempt it, recompute its KV, fork it for `n`),
its matcher describes exactly the tokens it has. With `start_after` (a reasoning model's
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

    __slots__ = ("pending", "_backend", "_matcher", "_start_after", "_start", "_tokens")

    def __init__(self, pending: PendingGrammar, backend: GrammarBackend, start_after: tuple[int, ...] = ()) -> None:
        """`start_after`: token ids after whose first occurrence in the output the constraint starts
        (empty: from the first generated token)."""
        self.pending = pending
        self._backend = backend
        self._matcher: Matcher | None = None
        self._start_after = tuple(start_after)
        self._start: int | None = None if start_after else 0
        self._tokens: list[int] = []  # the constrained tokens the matcher has accepted, in order

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

    def valid_prefix(self, output_token_ids: list[int], drafts: list[int]) -> int:
        """How many of `drafts` (speculative decoding's, after `output_token_ids`) the grammar allows in
        a row; the matcher is left synced to `output_token_ids`."""
        allowed = 0
        try:
            for j in range(len(drafts)):
                self._synced(output_token_ids + drafts[:j + 1])
                allowed = j + 1
        except GrammarRejected:
            pass
        self._synced(output_token_ids)
        return allowed

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
            self._rollback_to(0)
            return None
        if self._matcher is None:
            self._matcher = self._backend.matcher(self.pending.result())
        wanted = output[start:]
        tokens = self._tokens
        common = min(len(tokens), len(wanted))
        if tokens[:common] != wanted[:common]:  # usually equal: the output only grew (or shrank)
            common = next(i for i, (ours, theirs) in enumerate(zip(tokens, wanted)) if ours != theirs)
        self._rollback_to(common)
        for token in wanted[common:]:
            if not self._matcher.accept(token):
                raise GrammarRejected(f"token {token} is not allowed by the {self.pending.spec.kind} constraint "
                                      f"after {len(tokens)} constrained tokens")
            tokens.append(token)
        return self._matcher

    def _rollback_to(self, num_tokens: int) -> None:
        """Undo the accepted tokens after the first `num_tokens`."""
        if len(self._tokens) > num_tokens:
            self._matcher.rollback(len(self._tokens) - num_tokens)
            del self._tokens[num_tokens:]

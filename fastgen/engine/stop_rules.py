"""When a sequence stops: EOS, stop token ids, stop strings, `min_new_tokens`, `max_new_tokens` and
`max_length`, declared once for both sides of the step.

Before sampling, `banned_tokens` says which ids a row may not generate yet (EOS and stop ids below
`min_new_tokens`; the token that would complete a bad word). After sampling, `Scheduler.update`
asks `check` about every token it appends. The two are kept together so a stop id is never banned
by one rule and accepted as a stop by another.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastgen.engine.sequence import Sequence


class StopRules:
    """The engine-wide part of the stop rules (EOS ids, context length); each request's own part is
    its `SamplingParams`."""

    def __init__(self, eos_token_ids: Iterable[int] = (), max_model_len: int | None = None) -> None:
        """`eos_token_ids`: the model's end-of-sequence ids (ignored by `ignore_eos` requests);
        `max_model_len`: the most tokens a sequence may hold (None: no engine-wide cap)."""
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self.max_model_len = max_model_len

    def max_length(self, seq: Sequence) -> int | None:
        """The most tokens (prompt + output) `seq` may reach."""
        limits = [n for n in (seq.params.max_length, self.max_model_len) if n is not None]
        return min(limits) if limits else None

    def _stop_ids(self, seq: Sequence) -> set[int]:
        p = seq.params
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)

    def banned_tokens(self, seq: Sequence) -> list[int]:
        """The ids `seq` may not generate as its next token: EOS and stop ids below `min_new_tokens`,
        and the last token of every bad word whose other tokens end the output."""
        row: list[int] = []
        output = seq.output_token_ids
        if len(output) < seq.params.min_new_tokens:
            row.extend(self._stop_ids(seq))
        for word in seq.bad_words_ids:
            prefix = len(word) - 1
            if prefix == 0 or (len(output) >= prefix and tuple(output[-prefix:]) == word[:-1]):
                row.append(word[-1])
        return row

    def check(self, seq: Sequence, token: int) -> tuple[str, str | None]:
        """After `token` was appended to `seq`: the text it completes and why `seq` stops now
        ("stop", "length"), or None. A stop by id emits no text for the id; a finishing sequence
        releases the text its stream held back (see `TextStream.finish`).

        `seq.stream` None (sequences built without a tokenizer) means no text and no stop strings.
        """
        p = seq.params
        generated = len(seq.output_token_ids)
        text, reason = "", None
        # A grammar that accepted its stop token has ended the output, even under ignore_eos; syncing
        # it here advances the matcher (and raises if a token it forbids got through).
        grammar_ended = seq.grammar is not None and seq.grammar.is_terminated(seq.output_token_ids)
        # Below min_new_tokens these ids are banned from sampling; a token given by other means
        # (several per step) then does not stop either.
        if grammar_ended or (token in self._stop_ids(seq) and generated > p.min_new_tokens):
            reason = "stop"
        elif seq.stream is not None:
            text, stopped = seq.stream.append(token)
            if stopped:
                reason = "stop"
        max_len = self.max_length(seq)
        if reason is None and ((max_len is not None and seq.num_tokens >= max_len)
                               or (p.max_new_tokens is not None and generated >= p.max_new_tokens)):
            reason = "length"
        if reason is not None and seq.stream is not None:
            tail, _ = seq.stream.finish()
            text += tail
        return text, reason

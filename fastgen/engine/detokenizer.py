"""Incremental detokenization and stop-string matching for streamed generation.

`IncrementalDetokenizer` turns one sampled token at a time into text deltas by decoding a small
window of recent tokens (prefix offset / read offset, as vLLM and HF's TextStreamer do), holding
back text that ends inside a multi-byte character. `StopStringMatcher` cuts the text before the
first stop string and holds back a tail that could still start one. `TextStream` combines both.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the first output token, so tokenizers whose decoders depend
# on the left context (SentencePiece strips a leading space at the start of a decode) get it right.
_PROMPT_CONTEXT_TOKENS = 5


def _as_token_id(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int token id, got bool")
    try:
        token_id = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int token id, got {type(value).__name__}") from None
    if token_id < 0:
        raise ValueError(f"{what} must be >= 0, got {token_id}")
    return token_id


class IncrementalDetokenizer:
    """Decodes output tokens one at a time into completed text deltas, in O(1) tokens per step.

    Only the tokens not yet turned into text (plus the tokens released in the previous step, as
    left context) are decoded each step. When the decoded window ends in U+FFFD (a character split
    across tokens) the incomplete tail is held back until a later token completes it; `flush()`
    releases whatever is still held at the end.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        """Wrap `tokenizer` (has `decode(ids, skip_special_tokens=...)`) for one sequence."""
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer needs a decode() method, got {type(tokenizer).__name__}")
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
            raise TypeError("prompt_token_ids must be a sequence of int token ids")
        if not isinstance(skip_special_tokens, bool):
            raise TypeError("skip_special_tokens must be a bool")
        self._decode_fn = tokenizer.decode
        self._decode_kwargs: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
        if hasattr(tokenizer, "clean_up_tokenization_spaces"):
            # Clean-up rewrites spaces across the whole string; per-window it would diverge.
            self._decode_kwargs["clean_up_tokenization_spaces"] = False
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._window = [_as_token_id(t, "prompt token id") for t in context]
        self._prefix_text = self._decode(self._window)
        while self._prefix_text.endswith(_REPLACEMENT):
            # A prompt cut inside a character must not merge with the output's first bytes: the
            # output decodes on its own, as decode(output_ids) would.
            self._window.pop()
            self._prefix_text = self._decode(self._window)
        self._read_offset = len(self._window)  # window[:read_offset] is context already released
        self._emitted_pending = 0  # chars of the pending text already released (stable prefix)
        self._chunks: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, **self._decode_kwargs) if ids else ""

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        self._window.append(_as_token_id(token_id, "token_id"))
        text = self._decode(self._window)
        start = len(self._prefix_text) + self._emitted_pending
        if text.endswith(_REPLACEMENT):
            # Text before the trailing U+FFFD run can no longer change; the run itself might.
            delta = text.rstrip(_REPLACEMENT)[start:]
            self._emitted_pending += len(delta)
            return self._emit(delta)
        return self._advance(text[start:])

    def flush(self) -> str:
        """Release any held-back text at the end of generation (an invalid tail stays U+FFFD)."""
        if self._read_offset == len(self._window):
            return ""
        text = self._decode(self._window)
        return self._advance(text[len(self._prefix_text) + self._emitted_pending :])

    def _advance(self, delta: str) -> str:
        """Release `delta`; the tokens it came from become the next step's left context."""
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._emitted_pending = 0
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All generated text released so far (the prompt excluded)."""
        return "".join(self._chunks)


class StopStringMatcher:
    """Cuts streamed text right before the first stop string, holding back possible partial matches.

    `feed(delta)` returns `(text_to_emit, stopped)`. Text that could still be the start of a stop
    string (at most `max(len(s)) - 1` chars) is held back until it can no longer match, so a client
    never receives text that is later cut. The earliest occurrence wins; `stop_string` names it.
    """

    def __init__(self, stop: Sequence[str] | str = (), include_stop: bool = False) -> None:
        """Match the given stop strings; a bare string is one stop string. With `include_stop` the
        matched stop string is kept at the end of the text."""
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, Sequence):
            raise TypeError(f"stop must be a str or a sequence of str, got {type(stop).__name__}")
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"every stop string must be a str, got {type(s).__name__}")
            if not s:
                raise ValueError("stop strings must be non-empty")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._pending = ""
        self._chunks: list[str] = []
        self._include_stop = include_stop
        self.stop_string: str | None = None
        """The stop string that matched, or None while none has."""

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched."""
        return self.stop_string is not None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next text delta; return the text now safe to emit and whether a stop matched."""
        if not isinstance(delta, str):
            raise TypeError(f"delta must be a str, got {type(delta).__name__}")
        if self.stopped:
            raise RuntimeError("feed() called after a stop string already matched")
        if not self._stops:
            if delta:
                self._chunks.append(delta)
            return delta, False
        # A new match can only start inside the held-back tail or the new delta.
        buf = self._pending + delta
        cut = -1
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, self.stop_string = i, s
        if cut == -1:
            cut = self._hold_start(buf)
            self._pending = buf[cut:]
        else:
            self._pending = ""
            if self._include_stop:
                cut += len(self.stop_string)
        emit = buf[:cut]
        if emit:
            self._chunks.append(emit)
        return emit, self.stopped

    def _hold_start(self, buf: str) -> int:
        """Earliest index whose suffix is a proper prefix of some stop string (len(buf) if none)."""
        for p in range(max(0, len(buf) - self._max_len + 1), len(buf)):
            if buf[p] in self._first_chars:
                tail = buf[p:]
                if any(s.startswith(tail) for s in self._stops):
                    return p
        return len(buf)

    def finish(self) -> str:
        """Release the held-back tail at the end of generation (nothing after a stop matched)."""
        emit, self._pending = self._pending, ""
        if emit:
            self._chunks.append(emit)
        return emit

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)


class TextStream:
    """One sequence's output text: incremental detokenization followed by stop-string matching."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] | str = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        """Stream the text of tokens generated after `prompt_token_ids`, stopping at `stop` (cut
        before it, or after it with `include_stop`)."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._matcher = StopStringMatcher(stop, include_stop)

    def append(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token; return `(delta_to_emit, stopped)`."""
        if self._matcher.stopped:
            raise RuntimeError("append() called after a stop string already matched")
        return self._matcher.feed(self._detokenizer.append(token_id))

    def finish(self) -> tuple[str, bool]:
        """End of generation: release held-back text; return `(delta_to_emit, stopped)`."""
        if self._matcher.stopped:
            return "", True
        emit, stopped = self._matcher.feed(self._detokenizer.flush())
        return (emit, True) if stopped else (emit + self._matcher.finish(), False)

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched."""
        return self._matcher.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, or None."""
        return self._matcher.stop_string

    @property
    def text(self) -> str:
        """All text emitted so far (prompt excluded, cut before a matched stop string)."""
        return self._matcher.text

"""Reasoning models' thinking apart from their answer: the `--reasoning-parser` formats.

A reasoning model writes `<think>...</think>` before its answer. The parser splits a reply's text into
`reasoning_content` and `content`, incrementally for streams (text that may be the start of the end
marker is held back), so a stream assembles to exactly the non-streamed split. Whether the reply starts
inside its thinking is read off the rendered prompt: a template that ends with `<think>` opened it (the
reply is reasoning until `</think>`), one that ends with `</think>` closed it (all answer, e.g. Qwen3
with `enable_thinking: false`); otherwise the format decides. A structured constraint (`response_format`,
tools) starts after the end marker when the reply may think first (`StructuredOutputsParams.reasoning_end`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastgen.serving.http.chat.tool_parsers import partial_suffix

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One `--reasoning-parser` format."""

    thinks_first: bool
    """Without a marker at the prompt's end, whether the reply starts in its thinking (DeepSeek-R1's
    templates put `<think>` in the prompt; True) or thinks only when it opens with `<think>` (Qwen3)."""

    def starts_thinking(self, prompt_text: str) -> bool | None:
        """Whether a reply to `prompt_text` starts inside its thinking: True, False, or None (it does
        if it opens with `<think>`)."""
        tail = prompt_text.rstrip()
        if tail.endswith(END):
            return False
        if tail.endswith(START) or self.thinks_first:
            return True
        return None


REASONING_PARSERS = {"deepseek_r1": ReasoningFormat(thinks_first=True), "qwen3": ReasoningFormat(thinks_first=False)}
"""`--reasoning-parser` names -> their format."""


class ReasoningSplitter:
    """One reply's split: `feed` each piece of its text, then `finish` once; each returns
    `(reasoning, content)` that may be sent so far."""

    def __init__(self, thinking: bool | None) -> None:
        """`thinking`: as `ReasoningFormat.starts_thinking` says for this reply's prompt."""
        # "open": a leading <think> may come (and is dropped); "reasoning" until </think>; then "content".
        self._mode = "content" if thinking is False else "open"
        self._optional = thinking is True  # a reply that thinks anyway may still write its own <think>
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content let through after `text` was added to the reply."""
        self._buffer += text
        reasoning = content = ""
        if self._mode == "open":
            head = self._buffer.lstrip()
            if START.startswith(head):
                return "", ""  # only whitespace, or the start of <think> so far
            if head.startswith(START):
                self._buffer = head[len(START):]
                self._mode = "reasoning"
            else:
                self._mode = "reasoning" if self._optional else "content"
        if self._mode == "reasoning":
            i = self._buffer.find(END)
            if i < 0:
                keep = partial_suffix(self._buffer, END)
                reasoning, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:i], self._buffer[i + len(END):]
            self._mode = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is left once the reply is complete (an unfinished thought is reasoning)."""
        rest, self._buffer = self._buffer, ""
        if self._mode == "reasoning" or (self._mode == "open" and self._optional):
            return rest, ""
        return "", rest

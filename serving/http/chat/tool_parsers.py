"""Tool calls out of generated text, incrementally: the `--tool-call-parser` formats and the JSON a
`tool_choice` constraint produces.

A parser is fed the reply's text as it streams and returns what may be sent so far: content, and per
call its name (once) and pieces of its arguments. Text that may still turn out to be a tool call is
held back. A non-streamed reply is parsed by the same parser fed the whole text at once, so a stream's
pieces always assemble to exactly the non-streamed answer. Arguments are the call's JSON object as the
model wrote it (not re-serialized), which is what lets them stream before the object is complete.

When the text holds no call with a name, everything held back is content after all (sent at the end).
Text after the first call that is not a call (a model's trailing words) is dropped, as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")
"""The keys a call object's arguments may come under (hermes writes "arguments", llama3 "parameters")."""

_WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of one tool call: its `name` on the call's first piece (None after), then arguments text."""

    index: int
    name: str | None
    arguments: str


@dataclass(slots=True)
class ParserDelta:
    """What a parser lets through for one piece of text."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: ParserDelta) -> None:
        """Append `other` to this delta."""
        self.content += other.content
        self.calls.extend(other.calls)


@dataclass(slots=True)
class _Call:
    name: str | None = None
    arguments: list[str] = field(default_factory=list)
    index: int | None = None
    """Its place among the named calls, once announced."""
    sent: int = 0
    """Characters of its arguments taken so far."""


class CallScanner:
    """Reads a run of JSON call objects (`{"name": ..., "arguments": {...}}`) one character at a time.

    Between objects it accepts whitespace and the characters of `separators` (an array's brackets and
    commas, llama3's `;`); anything else there marks the run `failed` and ends it. Only the call
    objects' own members are interpreted: a `name` string and the raw text of the arguments object.
    """

    def __init__(self, separators: str = "[],;") -> None:
        self.separators = separators
        self.failed = False
        self.calls: list[_Call] = []
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._string = ""
        self._expect_key = True
        self._key: str | None = None
        self._in_arguments = False
        self._scalar = ""
        self._announced = 0

    @property
    def at_rest(self) -> bool:
        """Between call objects (where a format's closing marker may come)."""
        return self._depth == 0 and not self._in_string

    def feed(self, text: str) -> None:
        """Scan `text`."""
        for c in text:
            if self.failed:
                return
            self._char(c)

    def _char(self, c: str) -> None:
        call = self.calls[-1] if self.calls else None
        if self._in_string:
            if self._in_arguments:
                call.arguments.append(c)
            elif self._depth == 1:
                self._string += c
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1:
                    self._member_string(call)
            return
        if self._depth == 0:
            if c == "{":
                self._depth, self._expect_key, self._key, self._scalar = 1, True, None, ""
                self.calls.append(_Call())
            elif c not in _WHITESPACE and c not in self.separators:
                self.failed = True
            return
        if self._depth >= 2:  # inside a member's object or array value
            if self._in_arguments:
                call.arguments.append(c)
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._in_arguments = False
            return
        # depth 1: the call object's own members
        if c == '"':
            self._in_string, self._string = True, '"'
        elif c == ":":
            self._expect_key = False
        elif c in ",}":
            self._end_scalar(call)
            self._expect_key = True
            if c == "}":
                self._depth = 0
                if call.name is not None and not call.arguments:
                    call.arguments.append("{}")
        elif c in "{[":
            self._depth = 2
            if self._key in ARGUMENT_KEYS and not call.arguments:
                self._in_arguments = True
                call.arguments.append(c)
        elif c not in _WHITESPACE:
            self._scalar += c

    def _member_string(self, call: _Call) -> None:
        try:
            value = json.loads(self._string)
        except json.JSONDecodeError:
            self.failed = True
            return
        if self._expect_key:
            self._key = value
        elif self._key == "name" and call.name is None:
            call.name = value
        elif self._key in ARGUMENT_KEYS and not call.arguments:
            call.arguments.append(value)  # arguments sent as a JSON string holding the object

    def _end_scalar(self, call: _Call) -> None:
        # A scalar where the arguments object belongs: null means none; anything else is kept as written.
        if self._scalar and self._key in ARGUMENT_KEYS and not call.arguments and self._scalar != "null":
            call.arguments.append(self._scalar)
        self._scalar = ""

    def take(self) -> list[CallDelta]:
        """The call pieces not taken yet; a call is announced (its index and name) once its name is known."""
        out = []
        for call in self.calls:
            if call.name is None:
                continue
            arguments = "".join(call.arguments)
            if call.index is None:
                call.index = self._announced
                self._announced += 1
                out.append(CallDelta(call.index, call.name, arguments))
            elif len(arguments) > call.sent:
                out.append(CallDelta(call.index, None, arguments[call.sent:]))
            call.sent = len(arguments)
        return out

    @property
    def num_calls(self) -> int:
        """Calls announced so far."""
        return self._announced

    def restart(self) -> None:
        """Start a new run of objects (a new hermes block), keeping the calls found so far."""
        self.failed, self._depth, self._in_string, self._escape, self._in_arguments = False, 0, False, False, False


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (which may yet complete it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """One reply's parser: `feed` each piece of its text, then `finish` once."""

    def __init__(self, separators: str = "[],;") -> None:
        self._scanner = CallScanner(separators)
        self._buffer = ""
        self._held: list[str] = []  # the call region's text: content after all if it holds no call

    def feed(self, text: str) -> ParserDelta:
        """What may be sent of the reply after `text` was added to it."""
        self._buffer += text
        out = ParserDelta(self._run())
        out.calls = self._scanner.take()
        return out

    def finish(self) -> ParserDelta:
        """What is left to send once the reply is complete."""
        out = ParserDelta(self._flush())
        out.calls = self._scanner.take()
        if self._scanner.num_calls == 0:
            out.content += "".join(self._held)
            self._held = []
        return out

    def _run(self) -> str:
        """Consume what can be decided of the buffer; returns the content it let through."""
        raise NotImplementedError

    def _flush(self) -> str:
        """At the end: consume the undecided rest of the buffer; returns content it let through."""
        rest, self._buffer = self._buffer, ""
        self._held.append(rest)
        return ""

    def _to_calls(self, text: str) -> None:
        self._held.append(text)
        self._scanner.feed(text)


class JsonCallsParser(ToolCallParser):
    """Calls as bare JSON: an object, several separated by `;` or an array of them (what a
    `tool_choice` constraint produces, and llama3's format). A reply opening otherwise is content.

    `opening`: the characters a call region starts with; `tag`: a marker the model may put first
    (llama 3's `<|python_tag|>`), dropped."""

    def __init__(self, opening: str = "{[", tag: str | None = None) -> None:
        super().__init__()
        self._opening = opening
        self._tag = tag
        self._mode = "start"

    def _run(self) -> str:
        if self._mode == "start":
            head = self._buffer.lstrip()
            if not head or (self._tag is not None and self._tag.startswith(head)):
                return ""  # only whitespace, or maybe the tag: undecided
            if self._tag is not None and head.startswith(self._tag):
                self._held.append(self._buffer[:len(self._buffer) - len(head) + len(self._tag)])
                self._buffer = head[len(self._tag):]
                self._mode = "calls"
            else:
                self._mode = "calls" if head[0] in self._opening else "content"
        text, self._buffer = self._buffer, ""
        if self._mode == "content":
            return text
        self._to_calls(text)
        return ""


class HermesParser(ToolCallParser):
    """Hermes' (and Qwen's) format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks, content before the first one."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__(separators="")
        self._in_block = False
        self._seen_call = False

    def _run(self) -> str:
        content = []
        while self._buffer:
            if self._in_block:
                if not self._block():
                    break
                continue
            i = self._buffer.find(self.START)
            if i < 0:
                keep = partial_suffix(self._buffer, self.START)
                decided = self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(decided):]
                # Between blocks text is held with the calls; before the first it is content.
                (self._held if self._seen_call else content).append(decided)
                break
            (self._held if self._seen_call else content).append(self._buffer[:i])
            self._held.append(self.START)
            self._buffer = self._buffer[i + len(self.START):]
            self._in_block = self._seen_call = True
            self._scanner.restart()
        return "".join(content)

    def _block(self) -> bool:
        """Scan the buffer inside a block up to its end marker; False when more text is needed."""
        buffer = self._buffer
        for i, c in enumerate(buffer):
            if c == "<" and self._scanner.at_rest:
                rest = buffer[i:]
                if rest.startswith(self.END):
                    self._held.append(buffer[:i])
                    self._held.append(self.END)
                    self._buffer = buffer[i + len(self.END):]
                    self._in_block = False
                    return True
                if self.END.startswith(rest):
                    self._held.append(buffer[:i])
                    self._buffer = rest
                    return False
            self._scanner.feed(c)
        self._held.append(buffer)
        self._buffer = ""
        return False

    def _flush(self) -> str:
        if self._seen_call:
            return super()._flush()
        rest, self._buffer = self._buffer, ""
        return rest


TOOL_CALL_PARSERS = {"hermes": HermesParser, "llama3_json": lambda: JsonCallsParser("{", "<|python_tag|>")}
"""`--tool-call-parser` names -> a new parser for one reply."""


def make_tool_call_parser(name: str) -> ToolCallParser:
    """A fresh parser of the `--tool-call-parser` format `name`."""
    return TOOL_CALL_PARSERS[name]()

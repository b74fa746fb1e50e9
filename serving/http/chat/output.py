"""One chat choice's reply as OpenAI shapes it: `reasoning_content`, `content` and `tool_calls`.

The reply's text goes through the reasoning split (`--reasoning-parser`) and then the tool-call parser
(the request's `ToolPlan`); each piece of a stream gives the delta fields that may be sent so far. A
non-streamed reply is the same machinery fed the whole text at once and assembled, so a stream always
adds up to exactly the non-streamed message.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastgen.serving.http.chat.reasoning import ReasoningSplitter
from fastgen.serving.http.chat.tool_parsers import CallDelta
from fastgen.serving.http.chat.tools import ToolPlan


class ChoiceOutput:
    """The parsers of one choice's reply."""

    def __init__(self, tools: ToolPlan | None, reasoning: bool, thinking: bool | None = None) -> None:
        """`reasoning`: split the thinking off (`thinking` as `ReasoningFormat.starts_thinking` says)."""
        self.reasoning = reasoning
        self._splitter = ReasoningSplitter(thinking) if reasoning else None
        self._parser = tools.new_parser() if tools is not None else None
        self._ids: list[str] = []

    @property
    def num_calls(self) -> int:
        """Tool calls found so far."""
        return len(self._ids)

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta fields that may be sent once `text` was added to the reply (`final`: the reply
        is complete, nothing is held back any longer)."""
        reasoning, content = "", text
        if self._splitter is not None:
            reasoning, content = self._splitter.feed(text)
            if final:
                rest = self._splitter.finish()
                reasoning, content = reasoning + rest[0], content + rest[1]
        return self._fields(reasoning, content, final)

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason: "tool_calls" for a reply that ended by itself with calls."""
        return "tool_calls" if self._ids and reason == "stop" else reason

    def _fields(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        calls: list[CallDelta] = []
        if self._parser is not None:
            parsed = self._parser.feed(content)
            if final:
                parsed.extend(self._parser.finish())
            content, calls = parsed.content, parsed.calls
        fields: dict[str, Any] = {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = self._call_deltas(calls)
        return fields

    def _call_deltas(self, calls: list[CallDelta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for call in calls:
            if out and out[-1]["index"] == call.index and call.name is None:
                out[-1]["function"]["arguments"] += call.arguments
                continue
            if call.name is None:
                out.append({"index": call.index, "function": {"arguments": call.arguments}})
                continue
            self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
            out.append({"index": call.index, "id": self._ids[call.index], "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}})
        return out


def chat_message(output: ChoiceOutput, role: str, text: str, echo: str = "") -> dict[str, Any]:
    """The whole `message` of a non-streamed choice whose reply is `text` (`echo` before its content)."""
    fields = output.feed(text, final=True)
    content = echo + fields.get("content", "")
    # Fed at once, each call comes whole, in one piece.
    calls = [{"id": call["id"], "type": "function", "function": call["function"]} for call in fields.get("tool_calls", ())]
    message: dict[str, Any] = {"role": role, "content": content}
    if calls:
        message["tool_calls"] = calls
    if output.reasoning:
        message["reasoning_content"] = fields.get("reasoning_content") or None
    if not content and (calls or output.reasoning):
        message["content"] = None
    return message

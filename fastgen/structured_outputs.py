"""What a request's output must match: vLLM's `structured_outputs` keys, validated as data.

One spec names exactly one constraint (a JSON schema, a regex, a list of choices, an EBNF grammar,
any JSON object, or xgrammar's structural tag: free text in which triggered tags, such as tool calls, are
constrained). Whether the constraint itself is sound (a schema the compiler understands, a regex
that parses) is checked by the engine's grammar backend when the request is prepared, so the error
carries the compiler's own message. OpenAI's `response_format` and tool calling are turned into this
spec by the server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The keys of which a spec sets exactly one."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One structured-output constraint (vLLM's `StructuredOutputsParams`, the same keys).

    Build with `from_value(dict or instance)`; a bad shape raises ValueError/TypeError whose message
    starts with the offending key (`structured_outputs.json: ...`).
    """

    json: str | None = None
    """A JSON schema, as compact JSON text (a dict on input is serialized; the order of its keys is
    kept, since `properties` orders the output's keys)."""

    regex: str | None = None
    """A regular expression the whole output matches."""

    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""

    grammar: str | None = None
    """An EBNF grammar as xgrammar takes it (GBNF-style `root ::= ...`)."""

    json_object: bool | None = None
    """True: any JSON object (OpenAI's `json_object` mode)."""

    structural_tag: str | None = None
    """xgrammar's structural tag (`{"type": "structural_tag", "format": {...}}`) as compact JSON text (a
    dict on input is serialized): e.g. text in which each `<tool_call>` must hold a call matching its
    tool's schema. The xgrammar backend only."""

    whitespace_pattern: str | None = None
    """With `json`/`json_object`: a regex for the whitespace allowed between JSON tokens (llguidance
    only; the xgrammar backend refuses it)."""

    disable_any_whitespace: bool = False
    """With `json`/`json_object`: no free whitespace between JSON tokens (compact output)."""

    reasoning_end: str | None = None
    """When set (by a server's `--reasoning-parser`), the constraint starts only after the output
    contains this text (e.g. `</think>`): a reasoning model thinks freely first."""

    def __post_init__(self) -> None:
        set_keys = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(set_keys) != 1:
            what = "none" if not set_keys else ", ".join(set_keys)
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(CONSTRAINTS)} (got {what})")
        for name in ("regex", "grammar", "whitespace_pattern", "reasoning_end"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name}: must be a str, got {type(value).__name__}")
            if name in ("regex", "grammar", "reasoning_end") and value == "":
                raise ValueError(f"structured_outputs.{name}: must not be empty")
        if self.json is not None:
            object.__setattr__(self, "json", _object_text(self.json, "json", "JSON schema"))
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag", _object_text(self.structural_tag, "structural_tag", "JSON"))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if self.json_object not in (None, True, False):
            raise TypeError(f"structured_outputs.json_object: must be a bool, got {type(self.json_object).__name__}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError("structured_outputs.disable_any_whitespace: must be a bool, got "
                            f"{type(self.disable_any_whitespace).__name__}")
        if (self.whitespace_pattern is not None or self.disable_any_whitespace) and self.kind not in (
                "json", "json_object"):
            key = "whitespace_pattern" if self.whitespace_pattern is not None else "disable_any_whitespace"
            raise ValueError(f"structured_outputs.{key}: applies to json and json_object only, not {self.kind}")
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise ValueError("structured_outputs.whitespace_pattern: contradicts disable_any_whitespace=True")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `CONSTRAINTS`."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (None unless `kind` is json)."""
        return None if self.json is None else json.loads(self.json)

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams:
        """A spec from a dict of vLLM's keys (or a spec, returned as is); an unknown key is a TypeError
        naming it."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"structured_outputs: must be a dict of {', '.join(CONSTRAINTS)}, ..., got "
                            f"{type(value).__name__}")
        names = [f.name for f in fields(cls)]
        # vLLM clients send unset keys as null; they mean "not set".
        given = {key: item for key, item in value.items() if item is not None}
        for key in given:
            if key not in names:
                raise TypeError(f"structured_outputs.{str(key)[:80]}: unknown key (supported: {', '.join(names)})")
        return cls(**given)


def _object_text(value: Any, key: str, what: str) -> str:
    """A JSON object (a dict or its JSON text) as compact JSON text; `what` it is, for the messages."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.{key}: not valid JSON: {exc}") from None
    if isinstance(value, bool):
        raise ValueError(f"structured_outputs.{key}: a boolean {what} constrains nothing useful; give an object")
    if not isinstance(value, dict):
        raise TypeError(f"structured_outputs.{key}: must be a {what} object, got {type(value).__name__}")
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.{key}: not serializable as JSON: {exc}") from None


def _choices(choice: Any) -> tuple[str, ...]:
    if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)):
        raise TypeError(f"structured_outputs.choice: must be a list of str, got {type(choice).__name__}")
    if not choice:
        raise ValueError("structured_outputs.choice: must not be empty")
    for i, item in enumerate(choice):
        if not isinstance(item, str):
            raise TypeError(f"structured_outputs.choice[{i}]: must be a str, got {type(item).__name__}")
        if not item:
            raise ValueError(f"structured_outputs.choice[{i}]: must not be empty")
    return tuple(choice)

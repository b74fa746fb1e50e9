"""Tool calling on chat completions: `tools`, `tool_choice` and `parallel_tool_calls` validated into a
`ToolPlan` (what the template gets, how the reply is constrained and parsed).

- `none`: the template still sees the tools (the model knows them), the reply is plain content.
- `required` and a named function: the reply is grammar-constrained to JSON calls, as vLLM does: one
  `{"name": ..., "parameters": {...}}` object per call, the name one of the tools' (or the named one)
  and the parameters the tool's schema; an array of them when `parallel_tool_calls` (OpenAI's default).
- `auto` (the default when tools are given): the model answers freely and calls are parsed out of its
  text in the server's `--tool-call-parser` format; without one it is refused. When a tool is marked
  `strict`, the free text is constrained by an xgrammar structural tag: text stays free, but once the
  parser's call opening appears (`<tool_call>` for hermes, `{"name": "` for llama3_json) the call must
  name one of the tools and its arguments must match a strict tool's schema (any JSON object for the
  others).

Every refusal is a 400 naming the field, raised before anything is queued.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from fastgen.serving.http.chat.tool_parsers import TOOL_CALL_PARSERS, JsonCallsParser, ToolCallParser, \
    make_tool_call_parser
from fastgen.serving.http.guard import ApiError

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_CHOICES = ("none", "auto", "required")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list[dict[str, Any]]
    """The tools as the chat template takes them (`{"type": "function", "function": {...}}`)."""
    choice: str
    """"none", "auto", "required" or "named"."""
    constraint: dict[str, Any] | None
    """The `structured_outputs` spec of `required` and named choices, and of `auto` with strict tools
    (None otherwise)."""
    parser: str | None
    """The `--tool-call-parser` format of `auto` replies (None otherwise)."""

    def new_parser(self) -> ToolCallParser | None:
        """A parser for one reply (None when the reply is plain content)."""
        if self.choice in ("required", "named"):
            return JsonCallsParser()
        return make_tool_call_parser(self.parser) if self.parser is not None else None


def _tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ApiError(400, f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
    if tool.get("type") != "function":
        raise ApiError(400, f"{where}.type must be \"function\" (the only tool type supported), got "
                            f"{str(tool.get('type'))[:40]!r}", param="tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ApiError(400, f"{where}.function must be an object with name, description and parameters",
                       param="tools")
    name = function.get("name")
    if name is None:
        raise ApiError(400, f"{where}.function.name is required", param="tools")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got "
                            f"{str(name)[:80]!r}", param="tools")
    if not isinstance(function.get("description", ""), (str, type(None))):
        raise ApiError(400, f"{where}.function.description must be a string", param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema object", param="tools")
    if function.get("strict") not in (None, True, False):
        raise ApiError(400, f"{where}.function.strict must be a boolean", param="tools")
    return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    """(choice, the named function) of `tool_choice`, defaulting as OpenAI does."""
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise ApiError(400, f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                                f"\"function\": {{\"name\": ...}}}}, got {tool_choice[:40]!r}", param="tool_choice")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", param="tool_choice")
    if not names:
        raise ApiError(400, "tool_choice naming a function needs tools", param="tool_choice")
    if name not in names:
        raise ApiError(400, f"tool_choice names function {name[:80]!r}, which is not among tools "
                            f"({', '.join(names)})", param="tool_choice")
    return "named", name


def tool_plan(request: Any, parser: str | None) -> ToolPlan | None:
    """The tool plan of a validated chat body (None without tools), `parser` the server's
    `--tool-call-parser`; a 400 naming the field for anything it cannot serve."""
    raw = request.tools or []
    if not isinstance(raw, list):
        raise ApiError(400, "tools must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    tools = [_tool(i, tool) for i, tool in enumerate(raw)]
    names = [tool["function"]["name"] for tool in tools]
    duplicate = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if duplicate is not None:
        raise ApiError(400, f"tools: two functions are named {duplicate!r}", param="tools")
    choice, named = _choice(request.tool_choice, names)
    if not tools:
        if choice == "required":
            raise ApiError(400, "tool_choice required needs tools", param="tool_choice")
        return None
    if choice == "auto":
        if parser is None:
            param = "tools" if request.tool_choice is None else "tool_choice"
            raise ApiError(400, "tools with tool_choice auto (the default with tools) need the server started with "
                                f"--tool-call-parser (one of {', '.join(TOOL_CALL_PARSERS)}); use tool_choice "
                                "required, a named function or none", param=param)
    constraint = None
    if choice in ("required", "named"):
        parallel = request.parallel_tool_calls is not False and choice == "required"
        constraint = {"json": calls_schema(tools, named, parallel)}
    elif choice == "auto" and any(tool["function"].get("strict") for tool in tools):
        constraint = {"structural_tag": calls_tag(tools, parser, request.parallel_tool_calls is not False)}
    return ToolPlan(tools, choice, constraint, parser if choice == "auto" else None)


_CALL_FORMATS = {
    "hermes": ("<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('{"name": "', '{"name": "', '", "parameters": ', "}"),
}
"""Per `--tool-call-parser`: the trigger, and a call's text before its name, between its name and
arguments, and after them (what the bundled hermes-style templates and llama 3 write)."""


def calls_tag(tools: list[dict[str, Any]], parser: str, parallel: bool) -> dict[str, Any]:
    """The xgrammar structural tag of `tool_choice` auto with strict tools, in `parser`'s call format:
    free text, each call (after the trigger) to one of `tools` with a strict tool's arguments matching its
    schema; one call at most unless `parallel`."""
    trigger, before_name, before_arguments, after = _CALL_FORMATS[parser]
    tags = []
    for tool in tools:
        function = tool["function"]
        schema = (function.get("parameters") or _ANY_OBJECT) if function.get("strict") else _ANY_OBJECT
        tags.append({"type": "tag", "begin": before_name + function["name"] + before_arguments,
                     "content": {"type": "json_schema", "json_schema": schema}, "end": after})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                                                 "stop_after_first": not parallel}}


def calls_schema(tools: list[dict[str, Any]], named: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema of the reply to `tool_choice` required (`named` None: any of `tools`, an array
    of calls when `parallel`) or naming the function `named`."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if named is not None and function["name"] != named:
            continue
        parameters = function.get("parameters") or _ANY_OBJECT
        calls.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [function["name"]]}, "parameters": _hoisted(parameters, f"tool{i}", defs)},
            "required": ["name", "parameters"], "additionalProperties": False})
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "minItems": 1, "items": call} if parallel else dict(call)
    if defs:
        schema["$defs"] = defs
    return schema


def _hoisted(schema: dict[str, Any], key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A reference to `schema` kept in the combined schema's `defs` as `key`: its own `$defs` move there
    too (renamed `<key>_<name>`) and its references are rewritten, since a `$ref` is read from the root."""
    # Definitions that are not objects stay where they are, for the compiler to judge.
    moved = [name for name in ("definitions", "$defs") if isinstance(schema.get(name), dict)]
    own = {def_name: value for name in moved for def_name, value in schema[name].items()}
    body = {name: value for name, value in schema.items() if name not in moved}
    if not own and '"$ref"' not in json.dumps(body):
        return body  # nothing refers to the root: the schema goes inline

    def rewritten(node: Any) -> Any:
        if isinstance(node, dict):
            out = {name: rewritten(value) for name, value in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                for prefix in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(prefix):
                        out["$ref"] = f"#/$defs/{key}_{ref[len(prefix):]}"
                        break
                else:
                    out["$ref"] = f"#/$defs/{key}{ref[1:]}"
            return out
        if isinstance(node, list):
            return [rewritten(item) for item in node]
        return node

    defs[key] = rewritten(body)
    for name, value in own.items():
        defs[f"{key}_{name}"] = rewritten(value)
    return {"$ref": f"#/$defs/{key}"}

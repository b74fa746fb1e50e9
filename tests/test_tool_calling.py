"""Tool calling and reasoning on `/v1/chat/completions`, with the official `openai` client (unmodified)
against the real server over a tiny checkpoint whose chat template renders tools hermes-style (as
Qwen's do): `tool_choice` required and named are grammar-constrained and parsed into `tool_calls`
(streamed and not, the stream assembling to the non-streamed answer), `auto` parses calls out of free
text (its parsers tested on scripted text, split at every character), the next turn's `tool_calls` and
`tool` messages reach the template, bad tools are 400s before queueing, and `--reasoning-parser`
splits `reasoning_content` off and starts a constraint only after the thinking."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from kit import build_checkpoint
from rest_server import serve

from fastgen.engine.grammar import GrammarCompiler, SequenceGrammar, make_backend
from fastgen.serving.cli import build_parser
from fastgen.serving.http.app import create_app
from fastgen.serving.http.chat.messages import ChatPrompt, chat_conversation, render_chat_text
from fastgen.serving.http.chat.output import ChoiceOutput, chat_message
from fastgen.serving.http.chat.reasoning import REASONING_PARSERS, ReasoningSplitter
from fastgen.serving.http.chat.tool_parsers import JsonCallsParser, make_tool_call_parser
from fastgen.serving.http.chat.tools import ToolPlan, calls_schema, tool_plan
from fastgen.serving.http.guard import ApiError
from fastgen.structured_outputs import StructuredOutputsParams

MODEL = "tiny-tools"
ENGINE = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]

# Hermes-style, as Qwen's templates render tools, calls and tool results; the reply opens with closed
# thinking unless `enable_thinking` (what a deepseek_r1 reasoning parser reads off the prompt).
TEMPLATE = (
    "{%- if tools %}<|system|><tools>{% for tool in tools %}{{ tool.function.name }} {% endfor %}</tools></s>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|assistant|>{{ message.content or '' }}"
    "{%- for call in message.tool_calls %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{%- endfor %}</s>"
    "{%- elif message.role == 'tool' %}<|tool|><tool_response id=\"{{ message.tool_call_id }}\">"
    "{{ message.content }}</tool_response></s>"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}</s>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>{% else %}<think></think>{% endif %}"
    "{%- endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_checkpoint(str(tmp_path_factory.mktemp("tools") / "llama"), "llama")
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(TEMPLATE)
    with serve(path, MODEL, ENGINE, tool_call_parser="hermes", reasoning_parser="deepseek_r1") as s:
        yield s
        s.wait_idle()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _check_call(call) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _assembled(stream) -> tuple[dict[int, list[str]], str, str | None]:
    """A streamed choice's tool calls (index -> [name, arguments]), content and finish reason."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                if call.id is not None:
                    assert call.index == len(calls) and call.type == "function" and call.id.startswith("call_")
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
    return calls, content, finish


def test_required_and_named_calls_are_constrained(client):
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=250, seed=1)
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=250, seed=2, n=2,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in [*required.choices, *named.choices]:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0])
    assert all(c.message.tool_calls[0].function.name == "get_time" for c in named.choices)


def test_parallel_required_calls_stream_to_the_non_streamed_answer(client):
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=250, seed=7,
                temperature=0.7)
    whole = client.chat.completions.create(**body).choices[0]
    calls, content, finish = _assembled(client.chat.completions.create(**body, stream=True))
    assert whole.finish_reason == finish == "tool_calls" and content == ""
    assert {i: [c.function.name, c.function.arguments] for i, c in enumerate(whole.message.tool_calls)} == calls
    for call in whole.message.tool_calls:
        _check_call(call)


def test_auto_without_calls_is_content_and_the_next_turn_renders(served, client):
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=6, seed=3)
    assert reply.choices[0].finish_reason in ("length", "stop") and reply.choices[0].message.tool_calls is None
    prompt = render_chat_text(served.tokenizer, ChatPrompt(chat_conversation(turn), tools=TOOLS))
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert '<tool_response id="call_1">sunny</tool_response>' in prompt and "<tools>get_weather get_time </tools>" in prompt


def test_parallel_tool_calls_false_is_one_call_not_an_array():
    assert calls_schema(TOOLS, None, parallel=False)["anyOf"][0]["properties"]["name"] == {
        "type": "string", "enum": ["get_weather"]}
    assert calls_schema(TOOLS, None, parallel=True)["type"] == "array"
    named = calls_schema(TOOLS, "get_time", parallel=False)
    assert named["properties"]["parameters"] == TIME


def test_tool_defs_are_hoisted_so_refs_resolve():
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    schema = calls_schema([{"type": "function", "function": {"name": "f", "parameters": params}}], "f", False)
    assert schema["properties"]["parameters"] == {"$ref": "#/$defs/tool0"}
    assert schema["$defs"]["tool0"]["properties"]["p"] == {"$ref": "#/$defs/tool0_P"}


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name is required"),
    ({"tools": [{"type": "retrieval"}]}, 'tools[0].type must be "function"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names function 'nope', which is not among tools"),
    ({"tool_choice": "required"}, "tool_choice required needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools: the functions' parameters are not a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": WEATHER, "strict": True}}],
      "response_format": {"type": "json_object"}}, "strict tools under tool_choice auto constrain the reply's calls"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice must be none, auto, required"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined with response_format"),
    ({"tools": TOOLS + TOOLS[:1]}, "two functions are named 'get_weather'"),
    ({"functions": [{"name": "f"}]}, "use tools"),
]


@pytest.mark.parametrize("body, message", BAD)
def test_bad_tools_are_400_before_queueing(served, client, body, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=body)
    assert message in str(info.value)
    assert not served.engine.requests
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0].message is not None


def test_auto_needs_a_parser_and_none_parses_nothing():
    class Request:
        tools, tool_choice, parallel_tool_calls = TOOLS, None, None

    with pytest.raises(ApiError, match="need the server started with --tool-call-parser") as info:
        tool_plan(Request(), None)
    assert info.value.param == "tools"
    Request.tool_choice = "none"
    plan = tool_plan(Request(), None)
    assert plan.choice == "none" and plan.new_parser() is None and plan.tools == TOOLS


STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
STRICT_CALLS = {  # per parser: a call to the strict tool, the same with days out of range, a non-strict call
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 0}}\n</tool_call>',
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "mars"}}\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris", "days": 0}}',
                    '{"name": "get_time", "parameters": {"zone": "mars"}}'),
}


@pytest.mark.parametrize("parser", sorted(STRICT_CALLS))
def test_strict_tools_under_auto_constrain_the_calls_in_the_parsers_format(served, parser):
    class Request:
        tools, tool_choice, parallel_tool_calls = STRICT_TOOLS, "auto", None

    plan = tool_plan(Request(), parser)
    assert plan.choice == "auto" and plan.parser == parser and "structural_tag" in plan.constraint
    compiler = GrammarCompiler(make_backend("xgrammar", served.engine.tokenizer, served.engine.vocab_size,
                                            [served.engine.tokenizer.eos_token_id]), "tools")
    grammar = SequenceGrammar(compiler.submit(StructuredOutputsParams.from_value(plan.constraint)), compiler.backend)
    grammar.pending.wait(30)
    eos = served.engine.tokenizer.eos_token_id

    def allowed(text: str) -> bool:
        ids = served.engine.tokenizer.encode(text, add_special_tokens=False) + [eos]
        return grammar.valid_prefix([], ids) == len(ids)

    valid, out_of_range, not_strict = STRICT_CALLS[parser]
    assert allowed(valid) and allowed(not_strict) and allowed("No call needed.")
    assert not allowed(out_of_range)
    # What the grammar lets through, the server's parser reads as the call.
    assert _parse(lambda: make_tool_call_parser(parser), [valid]) == (
        "", [["get_weather", '{"city": "Paris", "days": 2}']])
    compiler.shutdown()


def test_strict_tools_under_auto_are_served(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, tools=STRICT_TOOLS, seed=1)
    choice = reply.choices[0]
    for call in choice.message.tool_calls or ():
        _check_call(call)
    assert choice.finish_reason in ("stop", "length", "tool_calls")


def test_cli_flags_and_unknown_parser_names():
    args = build_parser().parse_args(["--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("llama3_json", "qwen3")
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        create_app(type("B", (), {"submit_async": lambda self: None})(), "d", None, "m", tool_call_parser="x")


# -- parsers on scripted text ---------------------------------------------------------------------------

def _parse(factory, pieces: list[str]) -> tuple[str, list[list[str]]]:
    parser = factory()
    content, calls = "", []
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for delta in deltas:
        content += delta.content
        for call in delta.calls:
            if call.name is not None:
                assert call.index == len(calls)
                calls.append([call.name, ""])
            calls[call.index][1] += call.arguments
    return content, calls


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"<ris", "n": [1, {"a": "}"}]}}'
          '\n</tool_call>\n<tool_call>{"arguments": {"zone": "utc"}, "name": "get_time"}</tool_call>')
CASES = [
    ("hermes", HERMES, ("Let me check. ", [["get_weather", '{"city": "Pa\\"<ris", "n": [1, {"a": "}"}]}'],
                                          ["get_time", '{"zone": "utc"}']])),
    ("hermes", "a < b and <tool but no call", ("a < b and <tool but no call", [])),
    ("hermes", "x <tool_call>not json</tool_call>", ("x <tool_call>not json</tool_call>", [])),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', ("", [["f", "{}"]])),
    ("llama3_json", ' {"name": "a", "parameters": {"q": 1}}; {"name": "b", "parameters": {}}',
     ("", [["a", '{"q": 1}'], ["b", "{}"]])),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": null}', ("", [["a", "{}"]])),
    ("llama3_json", 'Hello {"name": "a"}', ('Hello {"name": "a"}', [])),
    ("llama3_json", '{"answer": 42}', ('{"answer": 42}', [])),
    ("json", '[{"name": "a", "parameters": {"s": "]}"}}, {"name": "b", "parameters": {"z": []}}]',
     ("", [["a", '{"s": "]}"}'], ["b", '{"z": []}']])),
    ("json", '{"name": "a", "parameters": "{\\"k\\": 1}"}', ("", [["a", '{"k": 1}']])),
]


@pytest.mark.parametrize("name, text, expected", CASES)
def test_parsers_at_every_split(name, text, expected):
    factory = JsonCallsParser if name == "json" else (lambda: make_tool_call_parser(name))
    assert _parse(factory, [text]) == expected
    assert _parse(factory, list(text)) == expected
    for i in range(len(text) + 1):
        assert _parse(factory, [text[:i], text[i:]]) == expected, i


def test_streaming_holds_back_what_may_be_a_call():
    parser = make_tool_call_parser("hermes")
    assert parser.feed("Sure <tool_").content == "Sure "
    delta = parser.feed('call>{"name": "get_time", "argu')
    assert delta.content == "" and [(c.index, c.name, c.arguments) for c in delta.calls] == [(0, "get_time", "")]
    assert [c.arguments for c in parser.feed('ments": {"zone"').calls] == ['{"zone"']


# -- reasoning ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("thinking, text, expected", [
    (True, "plan a</think>\n\nanswer", ("plan a", "\n\nanswer")),
    (True, "<think>plan</think>answer", ("plan", "answer")),
    (True, "unfinished </thi", ("unfinished </thi", "")),
    (None, "<think>plan</think>answer", ("plan", "answer")),
    (None, "just an answer </think>", ("", "just an answer </think>")),
    (False, "<think>x</think>y", ("", "<think>x</think>y")),
])
def test_reasoning_split_at_every_split(thinking, text, expected):
    for pieces in ([text], list(text), *([text[:i], text[i:]] for i in range(len(text) + 1))):
        splitter = ReasoningSplitter(thinking)
        parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == expected


def test_reasoning_format_reads_the_prompt():
    r1, qwen3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
    assert r1.starts_thinking("<|assistant|><think>\n") is True
    assert r1.starts_thinking("<|assistant|><think></think>\n\n") is False and r1.starts_thinking("x") is True
    assert qwen3.starts_thinking("<|assistant|>") is None


def test_reasoning_and_calls_together_assemble():
    plan = ToolPlan(TOOLS, "auto", None, "hermes")
    text = 'hmm</think>ok <tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
    message = chat_message(ChoiceOutput(plan, True, True), "assistant", text)
    assert message["reasoning_content"] == "hmm" and message["content"] == "ok "
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "cet"}'}
    streamed = ChoiceOutput(plan, True, True)
    fields = [streamed.feed(c) for c in text] + [streamed.feed("", final=True)]
    assert "".join(f.get("reasoning_content", "") for f in fields) == "hmm"
    assert "".join(c["function"]["arguments"] for f in fields for c in f.get("tool_calls", ())) == '{"zone": "cet"}'
    assert streamed.finish_reason("stop") == "tool_calls" and streamed.finish_reason("length") == "length"


def test_reasoning_over_rest_streamed_and_not(client):
    body = dict(model=MODEL, messages=ASK, max_tokens=8, seed=4, extra_body={
        "chat_template_kwargs": {"enable_thinking": True}})
    whole = client.chat.completions.create(**body).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and whole.message.content is None and whole.finish_reason == "length"
    streamed = "".join(chunk.choices[0].delta.model_extra.get("reasoning_content") or ""
                       for chunk in client.chat.completions.create(**body, stream=True) if chunk.choices)
    assert streamed == reasoning


def test_constraint_starts_after_the_thinking(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    closed = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=250, seed=5)
    assert closed.choices[0].message.model_extra["reasoning_content"] is None
    jsonschema.validate(json.loads(closed.choices[0].message.content), WEATHER)
    # Thinking (the prompt opened it): the model writes freely until </think>, which it never writes here.
    thinking = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=12, seed=5,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.choices[0].finish_reason == "length"
    assert thinking.choices[0].message.model_extra["reasoning_content"]

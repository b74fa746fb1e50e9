"""Structured outputs over the OpenAI REST routes with the official `openai` client (unmodified) against
the real server, and over the typed gRPC API: `response_format` (json_schema, json_object, text) on chat
and completions, `chat.completions.parse` with a pydantic model, vLLM's `structured_outputs` and
`guided_*` extras, streaming and `n`; the 400s name the field and the compiler's message, nothing is
queued and the server serves on."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pydantic
import pytest
from rest_server import serve

from fastgen.config import EngineConfig
from fastgen.engine import Engine, EngineLoop
from fastgen.sampling_params import SamplingParams
from fastgen.serving.backend import LocalBackend
from fastgen.serving.grpc.server import GrpcServer
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc
from fastgen.serving.grpc.convert import params_from_proto, params_to_proto
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb

MODEL = "tiny-llama"
ENGINE = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False}
COMPACT = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}


class City(pydantic.BaseModel):
    """What `chat.completions.parse` is asked for."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=6)
    rank: int = pydantic.Field(ge=1, le=9)


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    with serve(tiny_checkpoints["llama"], MODEL, ENGINE) as s:
        yield s
        s.wait_idle()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def test_response_format_json_schema_on_chat_and_completions(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A city?"}],
                                          response_format=fmt, max_tokens=300, n=2, seed=3)
    completion = client.completions.create(model=MODEL, prompt="A city:", max_tokens=300, seed=4,
                                           extra_body={"response_format": fmt})
    texts = [c.message.content for c in chat.choices] + [completion.choices[0].text]
    for text, choice in zip(texts, [*chat.choices, completion.choices[0]]):
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_completions_parse_with_a_pydantic_model(client):
    result = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A city?"}],
                                           response_format=City, max_tokens=300, seed=5)
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, City) and 1 <= parsed.rank <= 9


def test_structured_outputs_extra_and_guided_fields(client):
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=30, seed=1,
                                      extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", regex.choices[0].text)
    choice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Yes or no?"}],
                                            max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    grammar = client.completions.create(model=MODEL, prompt="Sum:", max_tokens=30, seed=2, extra_body={
        "structured_outputs": {"grammar": 'root ::= num "+" num\nnum ::= [1-9]'}})
    assert re.fullmatch(r"[1-9]\+[1-9]", grammar.choices[0].text)
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON"}], max_tokens=300,
                                         seed=2, extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(obj.choices[0].message.content), SCHEMA)
    text = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason == "length"


def test_streaming_assembles_to_valid_json(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A city?"}],
                                            max_tokens=300, seed=9, stream=True, extra_body=COMPACT)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "structured_outputs.json: invalid JSON schema"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex: invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar: invalid grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "both ask for structured output"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {"type": "tag"}}}},
     "structured_outputs.structural_tag: invalid structural tag"),
])
def test_bad_constraints_are_400_before_queueing(served, client, body, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       extra_body=body)
    assert message in str(info.value)
    assert not served.engine.requests
    ok = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3, temperature=0)
    assert ok.choices[0].text is not None


def test_grpc_structured_outputs_round_trip_and_generate(tiny_checkpoints):
    """The typed gRPC field converts both ways; a Generate call over a real gRPC server is constrained."""
    for spec in ({"json": SCHEMA, "disable_any_whitespace": True}, {"choice": ["a", "b c"]}, {"regex": "x+"},
                 {"grammar": 'root ::= "a"'}, {"json_object": True, "whitespace_pattern": " ?"},
                 {"structural_tag": {"type": "structural_tag", "format": {"type": "any_text"}}}):
        params = SamplingParams(structured_outputs=spec)
        assert params_from_proto(params_to_proto(params)).structured_outputs == params.structured_outputs
    with pytest.raises(ValueError, match="exactly one of"):
        params_from_proto(pb.SamplingParams(structured_outputs=pb.StructuredOutputs(whitespace_pattern=" ")))
    backend = LocalBackend(EngineLoop(Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], **ENGINE))),
                           "tiny")
    server = GrpcServer("127.0.0.1", 0, deployment_name="tiny", backend=backend)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.FastGenStub(channel)
            request = pb.GenerateRequest(prompts=[pb.Prompt(text="Pick")], params=params_to_proto(
                SamplingParams(max_new_tokens=10, structured_outputs={"choice": ["left", "right"]})))
            reply = stub.Generate(request, timeout=60)
            assert reply.completions[0].text in ("left", "right")
            bad = pb.GenerateRequest(prompts=[pb.Prompt(text="Pick")], params=pb.SamplingParams(
                structured_outputs=pb.StructuredOutputs(regex="((")))
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(bad, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "structured_outputs.regex: invalid regex" in info.value.details()
    finally:
        server.stop(grace=0)
        backend.close()

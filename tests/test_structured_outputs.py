"""Structured outputs through the engine and the Python API: every constraint kind, with `n`, streaming,
stop strings, logprobs, prefix caching and preemption; a request waits for its grammar without blocking
others; bad constraints are refused before anything is queued; both backends.

The tiny test model's logits are random, so only the mask makes its outputs valid: every output of a
temperature-1 run is validated (jsonschema for JSON)."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

import fastgen
from fastgen.engine import RequestFailed

SMALL = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
COMPACT = {"disable_any_whitespace": True}  # random logits would otherwise pad JSON with whitespace forever

SCHEMAS = {
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "ok": {"type": "boolean"}},
             "required": ["color", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                  "tag": {"type": "string", "maxLength": 4}},
                 "required": ["id", "tag"], "additionalProperties": False}},
               "required": ["user"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "maximum": 99,
                                                                               "minimum": -9},
                                                      "minItems": 1, "maxItems": 3}},
              "required": ["xs"], "additionalProperties": False},
    "anyof_null": {"type": "object", "properties": {"v": {"anyOf": [{"type": "null"},
                                                                   {"type": "string", "maxLength": 3}]}},
                   "required": ["v"], "additionalProperties": False},
    "ref": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["x"], "additionalProperties": False}},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
            "required": ["a", "b"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "n": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 5}},
              "required": ["kind", "n"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def path(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def pipe(path):
    with fastgen.pipeline(path, **SMALL) as p:
        yield p


def test_json_schemas_are_always_valid_at_temperature_1(pipe):
    prompts = ["The quick brown fox", "def f(x):", "Hello"]
    for name, schema in SCHEMAS.items():
        out = pipe(prompts, max_new_tokens=80, temperature=1.0, top_p=1.0, n=2, seed=1,
                   structured_outputs={"json": schema, **COMPACT})
        assert len(out) == 6
        for response in out:
            assert response.finish_reason == "stop", (name, response.generated_text)
            jsonschema.validate(json.loads(response.generated_text), schema)


@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"[a-c]{2,4}![0-9]"}, lambda t: re.fullmatch(r"[a-c]{2,4}![0-9]", t)),
    ({"choice": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")),
    ({"grammar": 'root ::= "[" num ("," num)? "]"\nnum ::= [0-9] | [1-9] [0-9]'},
     lambda t: re.fullmatch(r"\[\d{1,2}(,\d{1,2})?\]", t)),
    ({"json_object": True, **COMPACT}, lambda t: isinstance(json.loads(t), dict)),
])
def test_each_constraint_kind(pipe, constraint, check):
    # json_object is free-form: a random model rarely closes it unless nudged, so give it the room.
    out = pipe(["Once upon a time", "x ="], max_new_tokens=200, temperature=1.0, top_p=1.0, n=2, seed=3,
               structured_outputs=constraint,
               **({"logit_bias": {pipe.tokenizer.convert_tokens_to_ids(t): 8.0 for t in '"}'}}
                  if "json_object" in constraint else {}))
    for response in out:
        assert response.finish_reason == "stop" and check(response.generated_text), response.generated_text


def test_greedy_picks_the_best_allowed_and_ends_on_eos(pipe):
    out = pipe(["Hello"], do_sample=False, max_new_tokens=20, structured_outputs={"choice": ["yes", "no"]})[0]
    assert out.generated_text in ("yes", "no") and out.finish_reason == "stop"
    assert out.token_ids[-1] in pipe.engine.eos_token_ids


def test_streaming_stop_strings_and_logprobs(pipe):
    schema = SCHEMAS["nested"]
    kwargs = dict(max_new_tokens=80, temperature=1.0, top_p=1.0, seed=7, logprobs=2,
                  structured_outputs={"json": schema, **COMPACT})
    whole = pipe(["A prompt"], **kwargs)[0]
    deltas = list(pipe.stream(["A prompt"], **kwargs))
    assert "".join(d.generated_text for d in deltas) == whole.generated_text
    jsonschema.validate(json.loads(whole.generated_text), schema)
    assert len(whole.logprobs) == len(whole.token_ids) and all(len(lp) >= 1 for lp in whole.logprobs)
    # A stop string still ends the output where it matches (the constraint does not override it).
    stopped = pipe(["A prompt"], stop=['"tag"'], **kwargs)[0]
    assert stopped.finish_reason == "stop" and whole.generated_text.startswith(stopped.generated_text)
    assert '"tag"' not in stopped.generated_text


def test_prefix_cache_and_preemption_keep_outputs(path):
    """Seeded constrained requests give the same valid outputs with a roomy KV cache, and with one so
    small that they preempt each other (their matchers must survive the recompute), and again with
    their prompts cached."""
    schema = SCHEMAS["array"]
    prompts = [f"Prompt number {i}: " + "words " * 6 for i in range(6)]
    kwargs = dict(max_new_tokens=40, temperature=1.0, top_p=1.0, seed=11, structured_outputs={"json": schema, **COMPACT})
    with fastgen.pipeline(path, **SMALL) as roomy:
        first = [r.generated_text for r in roomy(prompts, **kwargs)]
        again = roomy(prompts, **kwargs)
        assert [r.generated_text for r in again] == first
        assert all(r.num_cached_tokens > 0 for r in again)
    with fastgen.pipeline(path, **{**SMALL, "num_kv_blocks": 12}) as tight:
        out = tight(prompts, **kwargs)
    assert [r.generated_text for r in out] == first
    for text in first:
        jsonschema.validate(json.loads(text), schema)


def test_preemption_happens_in_the_tight_run(path):
    """The tight cache of the test above does preempt (so that test exercises recompute)."""
    with fastgen.pipeline(path, **{**SMALL, "num_kv_blocks": 12}) as tight:
        engine = tight.engine
        params = fastgen.SamplingParams(max_new_tokens=40, temperature=1.0, top_p=1.0, seed=11,
                                        structured_outputs={"json": SCHEMAS["array"], **COMPACT})
        ids = [engine.add_request(f"Prompt number {i}: " + "words " * 6, params) for i in range(6)]
        seqs = [s for rid in ids for s in engine.sequences(rid)]
        while engine.has_unfinished():
            engine.step()
        assert sum(s.num_preemptions for s in seqs) > 0
        for seq in seqs:
            jsonschema.validate(json.loads(seq.stream.text), SCHEMAS["array"])


def test_invalid_constraints_are_refused_before_queueing(pipe):
    engine = pipe.engine
    cases = [({"json": {"type": "nope"}}, "structured_outputs.json: invalid JSON schema"),
             ({"regex": "(("}, "structured_outputs.regex: invalid regex"),
             ({"grammar": "root ::= missing"}, "structured_outputs.grammar: invalid grammar"),
             ({"json": {}, "regex": "a"}, "exactly one of"),
             ({"choices": ["a"]}, "structured_outputs.choices: unknown key"),
             ({"json": {"type": "object"}, "whitespace_pattern": " "}, "xgrammar backend cannot compile")]
    for constraint, message in cases:
        with pytest.raises((ValueError, TypeError), match=re.escape(message)) as info:
            pipe(["Hi"], structured_outputs=constraint)
        assert info.value.field == "structured_outputs"
        assert not engine.requests
    with pytest.raises(ValueError, match="min_new_tokens cannot be combined"):
        pipe(["Hi"], min_new_tokens=2, structured_outputs={"regex": "a+"})
    assert pipe(["Hi"], max_new_tokens=5, do_sample=False)[0].generated_length == 5  # serving on


class _Gate:
    """Wraps the engine's backend: compiles wait until `open` (or raise `error`)."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.name = backend.name
        self.open = threading.Event()
        self.error: Exception | None = None

    def parse(self, spec):
        return self._backend.parse(spec)

    def compile(self, parsed):
        self.open.wait(30)
        if self.error is not None:
            raise self.error
        return self._backend.compile(parsed)

    def matcher(self, compiled):
        return self._backend.matcher(compiled)


def run(engine) -> list:
    """Step `engine` until it is idle; every delta."""
    deltas = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    return deltas


def test_a_compiling_request_waits_without_blocking_others(path):
    with fastgen.pipeline(path, **SMALL) as p:
        engine = p.engine
        compiler = engine.structured_outputs.compiler
        gate = _Gate(compiler.backend)
        compiler.backend = gate
        constrained = engine.add_request("Hi", fastgen.SamplingParams(
            max_new_tokens=10, do_sample=False, structured_outputs={"regex": "[0-9]{3}"}))
        plain = engine.add_request("Hello there", fastgen.SamplingParams(max_new_tokens=6, do_sample=False))
        for _ in range(20):
            engine.step()
        assert plain not in engine.requests  # finished while the other's grammar compiled
        engine_seq = engine.sequences(constrained)[0]
        assert engine_seq.num_computed_tokens == 0
        gate.open.set()
        assert not [d for d in run(engine) if d.error is not None]
        assert re.fullmatch("[0-9]{3}", engine_seq.stream.text)

        gate.open.clear()
        gate.error = RuntimeError("out of states")
        failing = engine.add_request("Hi", fastgen.SamplingParams(structured_outputs={"regex": "[a-z]{5}"}))
        gate.open.set()
        [failure] = [d.error for d in run(engine) if d.request_id == failing]
        assert isinstance(failure, RequestFailed) and "could not compile the grammar: out of states" in str(failure)

        compiler.timeout_s = 0.2
        gate.open.clear()
        gate.error = None
        slow = engine.add_request("Hi", fastgen.SamplingParams(structured_outputs={"regex": "[a-z]{6}"}))
        [failure] = [d.error for d in run(engine) if d.request_id == slow]
        gate.open.set()
        assert "compiling the grammar took more than 0.2 s" in str(failure)


def test_llguidance_backend(path):
    with fastgen.pipeline(path, structured_outputs_backend="llguidance", **SMALL) as p:
        assert p.engine.plan.structured_outputs_backend == "llguidance"
        schema = SCHEMAS["ref"]
        for response in p(["One", "Two"], max_new_tokens=60, temperature=1.0, top_p=1.0, seed=5,
                          structured_outputs={"json": schema, "whitespace_pattern": r"[ ]?"}):
            jsonschema.validate(json.loads(response.generated_text), schema)
        with pytest.raises(ValueError, match="structured_outputs.regex: invalid regex"):
            p(["Hi"], structured_outputs={"regex": "(("})

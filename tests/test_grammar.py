"""The grammar engine on its own: the structured-output spec, both backends' parsing and errors, the
compile pool and cache (and its timeout), per-sequence matchers (advance, rollback, EOS only where the
grammar accepts, the reasoning gate) and the mask in the batched sampler."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from fastgen.engine.grammar import (GrammarCompileError, GrammarCompiler, GrammarRejected, SequenceGrammar,
                                    allocate_bitmask, apply_bitmask_, make_backend)
from fastgen.engine.step.sampler import Sampler
from fastgen.engine.step.sampling_metadata import SamplingMetadata
from fastgen.sampling_params import FieldValueError, SamplingParams
from fastgen.structured_outputs import StructuredOutputsParams
from kit_tokenizer import build_tokenizer

VOCAB = 520  # wider than the tokenizer's 512: the logits of a model with padded embeddings
EOS = 2
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def compiler(request, tokenizer):
    """A compile pool over each backend for the test kit's tokenizer."""
    pool = GrammarCompiler(make_backend(request.param, tokenizer, VOCAB, [EOS]), "kit")
    yield pool
    pool.shutdown()


def spec(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams.from_value(kw)


def generate(compiler, tokenizer, s: StructuredOutputsParams, seed: int, max_tokens: int = 200,
             favour: str = "") -> tuple[str, bool]:
    """Sample from random logits through the mask until the grammar ends; (text, ended). The tokens of
    `favour` (and EOS) get +6, so free-form constraints (any JSON object) end within the limit."""
    favoured = [EOS, *(tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(favour))]
    grammar = SequenceGrammar(compiler.submit(s), compiler.backend)
    grammar.pending.wait(30)
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        mask = allocate_bitmask(1, VOCAB)
        assert grammar.fill(mask, 0, out)
        logits = torch.randn(1, VOCAB, generator=generator) * 3
        logits[0, favoured] += 6
        apply_bitmask_(logits, mask)
        out.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
        if grammar.is_terminated(out):
            assert out[-1] == EOS
            return tokenizer.decode(out[:-1]), True
    return tokenizer.decode(out), False


# The spec -------------------------------------------------------------------------------------

def test_spec_validates_its_shape():
    assert json.loads(spec(json=PERSON).json) == PERSON
    assert list(spec(json=PERSON).schema["properties"]) == ["name", "age"]  # the output's property order
    assert spec(json=json.dumps(PERSON)).json == spec(json=PERSON).json  # one cache key for both forms
    assert spec(choice=["a", "b"]).choice == ("a", "b")
    assert spec(json_object=True, disable_any_whitespace=True).kind == "json_object"
    cases = [
        (dict(), ValueError, "exactly one of"),
        (dict(json=PERSON, regex="a"), ValueError, "got json, regex"),
        (dict(regex="a", foo=1), TypeError, "structured_outputs.foo: unknown key"),
        (dict(json="{not json"), ValueError, "structured_outputs.json: not valid JSON"),
        (dict(json=[1]), TypeError, "structured_outputs.json"),
        (dict(choice=[]), ValueError, "structured_outputs.choice: must not be empty"),
        (dict(choice=["a", 3]), TypeError, r"structured_outputs.choice\[1\]"),
        (dict(regex=""), ValueError, "structured_outputs.regex: must not be empty"),
        (dict(regex="a", disable_any_whitespace=True), ValueError, "applies to json and json_object only"),
        (dict(json_object="yes"), TypeError, "json_object: must be a bool"),
        (dict(structural_tag="{not json"), ValueError, "structured_outputs.structural_tag: not valid JSON"),
        (dict(structural_tag=["tag"]), TypeError, "structural_tag: must be a JSON object"),
    ]
    for kwargs, kind, message in cases:
        with pytest.raises(kind, match=message):
            StructuredOutputsParams.from_value(kwargs)
    with pytest.raises(TypeError, match="must be a dict"):
        StructuredOutputsParams.from_value("json")


# Backends: parse errors carry the compiler's message -----------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(json={"type": "nope"}), r"structured_outputs.json: invalid JSON schema: .*nope"),
    (dict(regex="a(b"), r"structured_outputs.regex: invalid regex: .+"),
    (dict(grammar='root ::= foo'), r"structured_outputs.grammar: invalid grammar: .*foo"),
])
def test_invalid_constraints_name_the_key_and_the_compiler_message(compiler, kwargs, message):
    with pytest.raises(FieldValueError, match=message) as info:
        compiler.submit(spec(**kwargs))
    assert info.value.field == "structured_outputs"
    assert "/project/cpp" not in str(info.value)  # xgrammar's log prefix is stripped


def test_whitespace_pattern_is_llguidance_only(compiler, tokenizer):
    s = spec(json=PERSON, whitespace_pattern=r"[ ]?")
    if compiler.backend.name == "xgrammar":
        with pytest.raises(FieldValueError, match="xgrammar backend cannot compile a whitespace pattern"):
            compiler.submit(s)
    else:
        text, ended = generate(compiler, tokenizer, s, seed=0)
        assert ended and jsonschema.validate(json.loads(text), PERSON) is None


CALL_TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
    {"type": "tag", "begin": '<tool_call>{"name": "who", "arguments": ', "end": "}</tool_call>",
     "content": {"type": "json_schema", "json_schema": PERSON}}]}}


def test_structural_tag_constrains_only_what_follows_a_trigger(compiler, tokenizer):
    if compiler.backend.name == "llguidance":
        with pytest.raises(FieldValueError, match="structural tags are compiled by the xgrammar backend only"):
            compiler.submit(spec(structural_tag=CALL_TAG))
        return
    with pytest.raises(FieldValueError, match="structured_outputs.structural_tag: invalid structural tag"):
        compiler.submit(spec(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}))
    grammar = SequenceGrammar(compiler.submit(spec(structural_tag=json.dumps(CALL_TAG))), compiler.backend)
    grammar.pending.wait(30)

    def allowed(text: str, end: bool) -> bool:
        ids = tokenizer.encode(text) + ([EOS] if end else [])
        return grammar.valid_prefix([], ids) == len(ids)

    call = '<tool_call>{"name": "who", "arguments": {"name": "ada", "age": 36}}</tool_call>'
    assert allowed("free text, then no call", end=True)
    assert allowed("let me look. " + call + " done", end=True)
    assert not allowed('<tool_call>{"name": "who", "arguments": {"name": "ada", "age": 360}}</tool_call>', end=False)
    assert not allowed('<tool_call>{"name": "what", "arguments": {}}</tool_call>', end=False)
    assert not allowed('<tool_call>{"name": "who", "arguments": {"name": "ada"', end=True)  # no EOS inside a call


# Every constraint kind gives matching outputs from random logits --------------------------------

@pytest.mark.parametrize("kwargs, check", [
    (dict(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    (dict(json=PERSON, disable_any_whitespace=True),
     lambda t: t in (json.dumps(json.loads(t), ensure_ascii=False),
                     json.dumps(json.loads(t), ensure_ascii=False, separators=(",", ":")))),
    (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    (dict(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    (dict(choice=["yes", "no", "maybe so", "ünïcode \"q\""]), lambda t: t in ("yes", "no", "maybe so", "ünïcode \"q\"")),
    (dict(grammar='root ::= "(" digit+ ("," digit+)* ")"\ndigit ::= [0-9]'),
     lambda t: re.fullmatch(r"\(\d+(,\d+)*\)", t)),
])
def test_constrained_outputs_match(compiler, tokenizer, kwargs, check):
    for seed in range(5):
        text, ended = generate(compiler, tokenizer, spec(**kwargs), seed, favour='"}' if "json_object" in kwargs else "")
        assert ended, f"no end within the token limit: {text!r}"
        assert check(text), text


def test_eos_only_where_the_grammar_accepts(compiler, tokenizer):
    grammar = SequenceGrammar(compiler.submit(spec(regex="ab")), compiler.backend)
    grammar.pending.wait(30)
    ids = tokenizer.encode("ab")
    mask = allocate_bitmask(1, VOCAB)
    for i in range(len(ids) + 1):
        mask.fill_(-1)
        grammar.fill(mask, 0, ids[:i])
        eos_allowed = bool((mask[0, EOS // 32] >> (EOS % 32)) & 1)
        assert eos_allowed == (i == len(ids)), i
    # Padded vocabulary ids past the tokenizer's are never allowed.
    allowed = torch.zeros(1, VOCAB)
    apply_bitmask_(allowed, mask)
    assert torch.isinf(allowed[0, 512:]).all()


def test_matcher_rolls_back_to_the_sequence_tokens(compiler, tokenizer):
    grammar = SequenceGrammar(compiler.submit(spec(json=PERSON)), compiler.backend)
    grammar.pending.wait(30)
    ids = tokenizer.encode('{"name": "ab", "age": 1')
    masks = []
    for i in (3, len(ids), 3):  # forward, then back (a rejected draft, a recompute that dropped tokens)
        mask = allocate_bitmask(1, VOCAB)
        grammar.fill(mask, 0, ids[:i])
        masks.append(mask)
    assert torch.equal(masks[0], masks[2]) and not torch.equal(masks[0], masks[1])
    with pytest.raises(GrammarRejected, match="not allowed"):
        grammar.fill(allocate_bitmask(1, VOCAB), 0, ids[:3] + tokenizer.encode("}}}"))
    # A fork (a sibling of n) starts from the beginning with its own matcher.
    sibling = grammar.fork()
    first = allocate_bitmask(1, VOCAB)
    sibling.fill(first, 0, [])
    assert not torch.equal(first, masks[1])


def test_reasoning_gate(compiler, tokenizer):
    marker = tuple(tokenizer.encode("</think>"))
    grammar = SequenceGrammar(compiler.submit(spec(choice=["A", "B"])), compiler.backend, start_after=marker)
    grammar.pending.wait(30)
    thinking = tokenizer.encode("hmm, let me see")
    mask = allocate_bitmask(1, VOCAB)
    assert not grammar.fill(mask, 0, thinking) and (mask == -1).all()
    assert grammar.fill(mask, 0, thinking + list(marker))
    allowed = torch.zeros(1, VOCAB)
    apply_bitmask_(allowed, mask)
    assert set(torch.isfinite(allowed[0]).nonzero().flatten().tolist()) <= {
        tokenizer.encode("A")[0], tokenizer.encode("B")[0]}


# The pool -------------------------------------------------------------------------------------

def test_compiles_are_cached_per_spec(compiler):
    before = len(compiler.compile_seconds)
    s = spec(regex=r"cache-[0-9]+")
    first = compiler.submit(s)
    second = compiler.submit(StructuredOutputsParams.from_value({"regex": r"cache-[0-9]+"}))
    first.wait(30)
    second.wait(30)
    assert first.result() is second.result()
    assert len(compiler.compile_seconds) == before + 1


class _SlowBackend:
    """A backend whose compile blocks until released (or fails when told to)."""

    name = "slow"

    def __init__(self) -> None:
        self.release = threading.Event()

    def parse(self, s):
        return s

    def compile(self, parsed):
        self.release.wait(10)
        if parsed.regex == "fail":
            raise RuntimeError("backend exploded")
        return parsed

    def matcher(self, compiled):
        raise AssertionError("not used")


def test_overlong_compile_fails_clearly_and_failures_are_retried():
    backend = _SlowBackend()
    pool = GrammarCompiler(backend, "slow", timeout_s=0.2)
    try:
        pending = pool.submit(spec(regex="x"))
        assert not pending.ready and pending.error is None
        time.sleep(0.3)
        assert pending.ready
        with pytest.raises(GrammarCompileError, match=r"structured_outputs.regex: compiling the grammar took more "
                                                      r"than 0.2 s"):
            pending.result()
        backend.release.set()
        failed = pool.submit(spec(regex="fail"))
        failed.wait(5)
        with pytest.raises(GrammarCompileError, match="slow could not compile the grammar: backend exploded"):
            failed.result()
        assert pool.submit(spec(regex="fail"))._future is not failed._future  # a failure is not cached
    finally:
        backend.release.set()
        pool.shutdown()


# The mask in the sampler ----------------------------------------------------------------------

@pytest.mark.parametrize("rows", [None, [0, 2]])
def test_apply_bitmask_matches_xgrammars_kernel(rows):
    """Our table lookup against xgrammar's own CPU kernel, on a vocabulary that is not a multiple of
    32 (the last word's spare bits are ignored) and scores that are already infinite."""
    xgrammar = pytest.importorskip("xgrammar")
    generator = torch.Generator().manual_seed(0)
    vocab = VOCAB - 5
    mask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    scores = torch.randn(4, vocab, generator=generator)
    scores[1, :3] = float("-inf")
    scores[3, 7] = float("inf")
    ours = apply_bitmask_(scores.clone(), mask, rows)
    theirs = scores.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, mask, indices=rows)
    assert torch.equal(ours, theirs)
    if rows is not None:
        assert torch.equal(ours[1], scores[1])
    assert torch.isinf(ours[0]).sum() > vocab // 4


def test_sampler_masks_after_bias_and_before_top_p():
    """Row 0: logit_bias lifts a forbidden token far above the rest; the mask still wins. Row 1: top-p
    0.5 over logits whose likely tokens are all forbidden: masking first keeps an allowed nucleus (masking
    after top-p would leave only -inf). Row 2: greedy takes the best allowed token. Row 3: unconstrained."""
    allowed = [7, 11, 300]
    mask = allocate_bitmask(4, VOCAB)
    for row in range(3):
        mask[row] = 0
        for token in allowed:
            mask[row, token // 32] |= 1 << (token % 32)
    logits = torch.full((4, VOCAB), -5.0)
    logits[:, 7], logits[:, 11], logits[:, 300] = 0.0, 0.5, 1.0
    logits[:, 100:110] = 8.0  # forbidden and far more likely
    params = [SamplingParams(logit_bias={5: 100.0}, top_p=1.0), SamplingParams(top_p=0.5),
              SamplingParams(do_sample=False), SamplingParams(do_sample=False)]
    seen = [set() for _ in params]
    for seed in range(40):
        torch.manual_seed(seed)
        md = SamplingMetadata.build(params, [[1]] * 4, [[]] * 4, [None] * 4, VOCAB, "cpu",
                                    grammar_bitmask=mask, grammar_rows=[0, 1, 2])
        for row, token in enumerate(Sampler()(logits.clone(), md).sampled_token_ids.tolist()):
            seen[row].add(token)
    assert seen[0] <= set(allowed) and len(seen[0]) > 1
    assert seen[1] <= set(allowed)
    assert seen[2] == {300}
    assert seen[3] <= set(range(100, 110))

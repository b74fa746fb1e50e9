"""llguidance (the alternative backend): an Earley parser over a lexer, masks computed per step with no
grammar precompilation; takes whitespace patterns and Lark grammars xgrammar lacks."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
from torch import Tensor

from fastgen.engine.grammar.backend import JSON_OBJECT_SCHEMA, compiler_error
from fastgen.sampling_params import FieldValueError
from fastgen.structured_outputs import StructuredOutputsParams


class LLGuidanceMatcher:
    """A `Matcher` over an `llguidance.LLMatcher`."""

    __slots__ = ("_matcher", "_stop_token_ids", "_num_tokens", "_stopped_at")

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._num_tokens = 0
        # llguidance's is_stopped() already holds when only EOS may follow; the engine's contract is
        # "a stop token was accepted", so that moment is counted here.
        self._stopped_at: int | None = None

    def accept(self, token_id: int) -> bool:
        """Advance over `token_id` (False, state unchanged: not allowed here)."""
        # validate_tokens does not count a stop token; one is allowed exactly where the grammar accepts.
        stop = token_id in self._stop_token_ids
        allowed = self._matcher.is_accepting() if stop else self._matcher.validate_tokens([token_id]) == 1
        if not allowed or not self._matcher.consume_token(token_id):
            return False
        self._num_tokens += 1
        if stop:
            self._stopped_at = self._num_tokens
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self._matcher.get_error()}")
        self._num_tokens -= num_tokens
        if self._stopped_at is not None and self._stopped_at > self._num_tokens:
            self._stopped_at = None

    def fill(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance matcher failed: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        """True once a stop token ended the grammar."""
        return self._stopped_at is not None


class LLGuidanceBackend:
    """`GrammarBackend` over llguidance for one Hugging Face tokenizer."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._stop_token_ids = frozenset(stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                       eos_token=sorted(stop_token_ids) or None)

    def parse(self, spec: StructuredOutputsParams) -> str:
        """The spec as an llguidance grammar, validated against the tokenizer (FieldValueError with
        llguidance's message when invalid)."""
        if spec.kind == "structural_tag":
            raise FieldValueError("structured_outputs.structural_tag: xgrammar's structural tags are compiled by the "
                                  "xgrammar backend only (serve with structured_outputs_backend='xgrammar')",
                                  "structured_outputs")
        try:
            if spec.kind in ("json", "json_object"):
                options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
                if spec.whitespace_pattern is not None:
                    options["whitespace_pattern"] = spec.whitespace_pattern
                schema = JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.json
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
            elif spec.kind == "choice":
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
                grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            else:
                grammar = llguidance.grammar_from("ebnf", spec.grammar)  # GBNF (xgrammar's EBNF) or Lark
        except (ValueError, RuntimeError) as exc:
            raise compiler_error(spec, exc) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise compiler_error(spec, messages[0])
        return grammar

    def compile(self, parsed: str) -> llguidance.LLMatcher:
        """A template matcher at the grammar's start (each sequence gets a copy)."""
        matcher = llguidance.LLMatcher(self._tokenizer, parsed, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance could not build the grammar: {matcher.get_error()}")
        return matcher

    def matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        """A fresh matcher (a copy of the compiled template)."""
        return LLGuidanceMatcher(compiled.deep_copy(), self._stop_token_ids)

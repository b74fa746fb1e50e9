"""xgrammar (the default backend): grammars compiled to per-state token masks, CPU bitmask filling."""

from __future__ import annotations

import json
from typing import Any

import xgrammar
from torch import Tensor

from fastgen.engine.grammar.backend import JSON_OBJECT_SCHEMA, compiler_error
from fastgen.sampling_params import FieldValueError
from fastgen.structured_outputs import StructuredOutputsParams


_LENGTH_BOUNDED_CHAR = r'[^\"\\\r\n]'
"""The character class xgrammar 0.2.8 and 0.2.9 give strings with minLength/maxLength: it lets raw control
characters (U+0000-U+001F but CR and LF) into the string, which JSON forbids, so outputs failed to
parse (a tab or \x01 inside a bounded string, seen on the test tokenizer)."""

_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'
"""JSON's unescaped string character: anything but a control character, a quote or a backslash."""


def _without_raw_control_characters(grammar: xgrammar.Grammar) -> xgrammar.Grammar:
    """`grammar` with xgrammar's length-bounded string characters restricted to JSON's."""
    text = str(grammar)
    if _LENGTH_BOUNDED_CHAR not in text:
        return grammar
    return xgrammar.Grammar.from_ebnf(text.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))


MAX_JSON_WHITESPACE = 20
"""The longest whitespace run JSON may hold between its tokens: room for pretty-printed indentation,
but a small model sampled at temperature 1 can no longer fall into newlines until max_tokens (xgrammar
allows a run of any length otherwise)."""


class XGrammarMatcher:
    """A `Matcher` over an xgrammar `GrammarMatcher`."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance over `token_id` (False: not allowed here)."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self._matcher.rollback(num_tokens)

    def fill(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """True once a stop token ended the grammar."""
        return self._matcher.is_terminated()


class XGrammarBackend:
    """`GrammarBackend` over xgrammar for one Hugging Face tokenizer."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._stop_token_ids = sorted(stop_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=self._stop_token_ids or None)
        # One compile at a time per grammar: the pool runs several grammars in parallel.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def parse(self, spec: StructuredOutputsParams) -> xgrammar.Grammar:
        """The spec as an xgrammar `Grammar` (FieldValueError with xgrammar's message when invalid)."""
        if spec.whitespace_pattern is not None:
            raise FieldValueError("structured_outputs.whitespace_pattern: the xgrammar backend cannot compile a "
                                  "whitespace pattern (serve with structured_outputs_backend='llguidance', or use "
                                  "disable_any_whitespace)", "structured_outputs")
        try:
            if spec.kind in ("json", "json_object"):
                schema = JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.json
                grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=not spec.disable_any_whitespace,
                                                            max_whitespace_cnt=MAX_JSON_WHITESPACE)
                return _without_raw_control_characters(grammar)
            if spec.kind == "regex":
                return xgrammar.Grammar.from_regex(spec.regex)
            if spec.kind == "choice":
                # EBNF string literals take JSON's escapes; ensure_ascii=False keeps other scripts as they are.
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
                return xgrammar.Grammar.from_ebnf(f"root ::= {alternatives}")
            if spec.kind == "structural_tag":
                return xgrammar.Grammar.from_structural_tag(spec.structural_tag)
            return xgrammar.Grammar.from_ebnf(spec.grammar)
        except (RuntimeError, ValueError) as exc:
            raise compiler_error(spec, exc) from None

    def compile(self, parsed: xgrammar.Grammar) -> xgrammar.CompiledGrammar:
        """Compile `parsed` against the tokenizer (the slow part)."""
        return self._compiler.compile_grammar(parsed)

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> XGrammarMatcher:
        """A fresh matcher; it ends only on the engine's stop tokens (EOS)."""
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids or None))

"""The grammar backend contract: what the engine asks of xgrammar or llguidance.

A backend turns a `StructuredOutputsParams` into a grammar in two stages: `parse` (cheap, on the
caller's thread when the request is prepared, so an invalid schema, regex or grammar is refused before
anything is queued, with the compiler's own message) and `compile` (the tokenizer-dependent work that
can take seconds, run in the compile pool). A compiled grammar makes one `Matcher` per sequence.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any, Protocol

from torch import Tensor

from fastgen.planning.plan import STRUCTURED_OUTPUTS_BACKENDS
from fastgen.sampling_params import FieldValueError
from fastgen.structured_outputs import StructuredOutputsParams

BACKENDS = STRUCTURED_OUTPUTS_BACKENDS
"""The grammar backends, default first (declared with the plan field that chooses one)."""

JSON_OBJECT_SCHEMA = '{"type":"object"}'
"""OpenAI's json_object mode as a schema: any JSON object (xgrammar's builtin JSON grammar would also
allow a top-level array)."""


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance over `token_id`; False (state unchanged) when the grammar does not allow it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    def fill(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit set = allowed)."""

    def is_terminated(self) -> bool:
        """True once a stop token ended the grammar."""


class GrammarBackend(Protocol):
    """Parses and compiles specs for one tokenizer; makes per-sequence matchers."""

    name: str
    """One of `BACKENDS`."""

    def parse(self, spec: StructuredOutputsParams) -> Any:
        """The spec as the backend's grammar, validated; raises `FieldValueError` naming the key and the
        compiler's message."""

    def compile(self, parsed: Any) -> Any:
        """The parsed grammar compiled against the tokenizer (slow; run off the engine thread)."""

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of `compiled`."""


def installed(name: str) -> bool:
    """Whether the backend's package can be imported."""
    return importlib.util.find_spec(name) is not None


def make_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
    """The backend `name` for `tokenizer`, whose masks are `vocab_size` wide (the logits' width) and
    whose grammars end with one of `stop_token_ids`. Raises ValueError when it is not installed."""
    if name not in BACKENDS:
        raise ValueError(f"structured outputs backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if not installed(name):
        raise ValueError(f"structured outputs need the {name} package, which is not installed "
                         f"(pip install 'fastgen[structured]')")
    if name == "xgrammar":
        from fastgen.engine.grammar.xgrammar_backend import XGrammarBackend
        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    from fastgen.engine.grammar.llguidance_backend import LLGuidanceBackend
    return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids)


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def compiler_error(spec: StructuredOutputsParams, exc_or_message: BaseException | str) -> FieldValueError:
    """A compiler's complaint about `spec` as a FieldValueError naming the key (`structured_outputs.json`)
    and the compiler's message (without its log prefix)."""
    message = str(exc_or_message).strip()
    message = _LOG_PREFIX.sub("", message)
    labels = {"json": "invalid JSON schema", "regex": "invalid regex", "grammar": "invalid grammar",
              "choice": "invalid choice", "json_object": "cannot compile json_object",
              "structural_tag": "invalid structural tag"}
    return FieldValueError(f"structured_outputs.{spec.kind}: {labels[spec.kind]}: {message}", "structured_outputs")

"""Generation parameters of one request, validated once when the request arrives.

The names and defaults are DeepSpeed-MII's, so `pipe(prompts, **gen)` calls written for MII keep
working; the fields MII lacked follow vLLM/OpenAI. MII's known faults are fixed here on purpose:
`min_new_tokens` counts generated tokens only, `ignore_eos` never disables `stop`, and temperature
is applied before top-k/top-p, as Hugging Face does.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from dataclasses import dataclass
from typing import Any

from fastgen.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
"""Largest `logprobs` a request may ask for (OpenAI's `top_logprobs` limit)."""

MAX_N = 64
"""Largest `n` (completions per prompt) a request may ask for."""

MAX_SEED = 2**64 - 1
"""Largest seed `torch.Generator.manual_seed` accepts."""


class FieldError(Exception):
    """A request field with a bad value; `field` names it as data, so a server maps the error onto
    its own field names (an HTTP 400's `param`, a gRPC trailer) without reading the message.

    Raised as `FieldValueError` (a wrong value) or `FieldTypeError` (a wrong type), which callers
    catch as the ValueError/TypeError they are.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple:
        # Pickled with its field (the default reduce passes only the message).
        return type(self), (str(self), self.field)


class FieldValueError(FieldError, ValueError):
    """A field's value is out of its range (or contradicts another field's)."""


class FieldTypeError(FieldError, TypeError):
    """A field's value has the wrong type (or the field does not exist)."""


def field_error(exc: BaseException, field: str | None, message: str | None = None) -> FieldError:
    """`exc` (a ValueError or TypeError) as the FieldError of the same kind naming `field`, with
    `message` (default: its own) and `exc` as its cause."""
    kind = FieldTypeError if isinstance(exc, TypeError) else FieldValueError
    out = kind(str(exc) if message is None else message, field)
    out.__cause__ = exc
    return out


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FieldTypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})", name)
    return value


def _check_int(name: str, value: Any, field: str | None = None) -> int:
    # bool is an int subclass, but `top_k=True` is a caller's mistake, not a 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldTypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})", field or name)
    if isinstance(value, numbers.Integral):
        return int(value)
    # JSON and gRPC clients often send whole numbers as floats (50.0): accept those only.
    if not math.isfinite(value) or value != int(value):
        raise FieldTypeError(f"{name} must be an int, got {value!r} (not a whole number)", field or name)
    return int(value)


def _check_float(name: str, value: Any, field: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldTypeError(f"{name} must be a float, got {type(value).__name__} ({value!r})", field or name)
    try:
        return float(value)
    except OverflowError:  # an int beyond any float
        raise FieldValueError(f"{name} is out of range: {value!r:.40} has no float value", field or name) from None


def _format_bound(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _check_range(name: str, value: float, low: float | None, high: float | None, *,
                 low_open: bool = False, field: str | None = None) -> None:
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    # An int is always finite (and math.isfinite overflows on one too large for a float).
    if too_low or too_high or (isinstance(value, float) and not math.isfinite(value)):
        left = "(" if low_open else "["
        lo = "-inf" if low is None else _format_bound(low)
        hi = "inf)" if high is None else f"{_format_bound(high)}]"
        raise FieldValueError(f"{name} must be in {left}{lo}, {hi}, got {value!r}", field or name)


@dataclass(frozen=True, slots=True)
class Bounds:
    """The range of a numeric sampling field (or of each item of a list field): [low, high], or
    (low, high] with `low_open`; None = unbounded on that side."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def check(self, name: str, value: float, field: str | None = None) -> None:
        """Raise a FieldValueError naming `field` (default `name`) when `value` is outside."""
        _check_range(name, value, self.low, self.high, low_open=self.low_open, field=field)


_CHECKS = {int: _check_int, float: _check_float, bool: lambda name, value, field=None: _check_bool(name, value)}


def sampling_field(default: Any, kind: type | None = None, low: float | None = None, high: float | None = None, *,
                   low_open: bool = False, items: Bounds | None = None, none_is_default: bool = False) -> Any:
    """Declare a sampling field's contract once: its `kind` (int, float or bool, checked strictly: no
    bools as numbers, whole floats as ints), its range (`low`..`high`, `low_open`), the range of
    each item of a list or dict field (`items`), and whether None on input means the default
    (`none_is_default`, MII's convention for temperature and top_k; a field whose default is None
    keeps None). `SamplingParams`' own checks, the REST request models with their OpenAPI schema,
    and gRPC (which builds SamplingParams) all derive from these."""
    bounds = Bounds(low, high, low_open) if low is not None or high is not None else None
    return dataclasses.field(default=default, metadata={"kind": kind, "bounds": bounds, "items": items,
                                                        "none_is_default": none_is_default})


def _check_sequence(name: str, value: Any, what: str) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise FieldTypeError(f"{name} must be a list of {what}, got {type(value).__name__} ({value!r})", name)
    return tuple(value)


@dataclass(slots=True)
class SamplingParams:
    """How to generate for one request: stopping rules, sampling warpers, penalties, logprobs.

    Construct directly or with `SamplingParams.from_kwargs(**gen)`; every field is checked on
    construction and a bad value raises `FieldValueError` (wrong range) or `FieldTypeError` (wrong
    type), a ValueError/TypeError naming the field in its message and in its `field` (None for a
    contradiction between two fields). Assigning a field afterwards is not re-validated: use
    `dataclasses.replace`, which is.
    """

    max_length: int | None = sampling_field(None, int, 1)
    """Cap on prompt + generated tokens; None = the model's maximum length. The engine rejects a
    prompt whose length is >= max_length."""

    max_new_tokens: int | None = sampling_field(None, int, 1)
    """Cap on generated tokens (>= 1); None = whatever `max_length` leaves after the prompt."""

    min_new_tokens: int = sampling_field(0, int, 0)
    """EOS and stop token ids are suppressed until this many tokens are generated (generated
    tokens only, unlike MII which compared it with prompt + generated length)."""

    ignore_eos: bool = sampling_field(False, bool)
    """Keep generating past the EOS token. Affects EOS only: `stop` and `stop_token_ids` still
    apply (MII disabled `stop` too)."""

    do_sample: bool = sampling_field(True, bool)
    """Sample from the processed distribution; False = greedy (argmax of the penalised logits)."""

    temperature: float = sampling_field(1.0, float, 0.0, none_is_default=True)
    """Logits are divided by this before top-k/top-p (Hugging Face's order). 0 = greedy, as in
    OpenAI and vLLM. None on input means 1.0 (MII's default)."""

    top_k: int = sampling_field(0, int, 0, none_is_default=True)
    """Keep only the k most likely tokens (ties with the k-th kept, as Hugging Face does);
    0 = off. None on input means 0 (MII's default)."""

    top_p: float = sampling_field(0.9, float, 0.0, 1.0, low_open=True)
    """Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches
    top_p (at least one token is kept); 1.0 = off. 0.9 is MII's default."""

    stop: tuple[str, ...] = ()
    """Stop strings, matched on the detokenized text; the output is cut before the stop string and
    EOS still stops generation. A str or a list/tuple of non-empty str on input."""

    return_full_text: bool = sampling_field(False, bool)
    """Prefix the prompt text to `generated_text` in the response."""

    seed: int | None = sampling_field(None, int, 0, MAX_SEED)
    """Seed of this request's own random generator, so its samples do not depend on what else is
    batched with it; None = the engine's shared generator."""

    stop_token_ids: tuple[int, ...] = sampling_field((), items=Bounds(0))
    """Token ids that stop generation (the token is kept in the output ids), besides EOS."""

    repetition_penalty: float = sampling_field(1.0, float, 0.0, low_open=True)
    """Hugging Face's repetition penalty (> 0) over prompt and generated tokens: a seen token's
    positive logit is divided by it, a negative one multiplied; 1.0 = off."""

    presence_penalty: float = sampling_field(0.0, float, -2.0, 2.0)
    """OpenAI's presence penalty in [-2, 2]: subtracted once from the logit of every token already
    generated (prompt tokens do not count)."""

    frequency_penalty: float = sampling_field(0.0, float, -2.0, 2.0)
    """OpenAI's frequency penalty in [-2, 2]: subtracted from a token's logit once per time it has
    been generated (prompt tokens do not count)."""

    logprobs: int | None = sampling_field(None, int, 0, MAX_LOGPROBS)
    """None = no logprobs; 0 = the chosen token's logprob; N (<= 20) = also the top-N tokens'.
    Logprobs are of the raw model distribution (before penalties and temperature)."""

    n: int = sampling_field(1, int, 1, MAX_N)
    """Number of completions to generate for the prompt (1..64)."""

    prompt_logprobs: int | None = sampling_field(None, int, 0, MAX_LOGPROBS)
    """None = none; N (<= 20) = the logprob of every prompt token after the first under the model,
    plus the top-N tokens at each position (vLLM's `prompt_logprobs`; what OpenAI `echo` with
    `logprobs` returns). Computed in the steps that prefill the prompt; such a request does not use
    the prefix cache, since cached tokens have no logits."""

    min_p: float = sampling_field(0.0, float, 0.0, 1.0)
    """Drop tokens whose probability is below min_p times the most likely token's (after
    temperature, top-k and top-p, Hugging Face's order); 0 = off."""

    logit_bias: dict[int, float] | None = sampling_field(None, items=Bounds(-100.0, 100.0))
    """Token id -> bias in [-100, 100] added to its logit before anything else (OpenAI's
    `logit_bias`; keys may be digit strings, as JSON sends them). Greedy rows see it too."""

    allowed_token_ids: tuple[int, ...] | None = sampling_field(None, items=Bounds(0))
    """Only these token ids may be generated (a non-empty list); None = all."""

    bad_words: tuple[str, ...] = ()
    """Words that are never generated: the tokens of each word (and of the word after a space) are
    banned as a sequence, i.e. a word's last token is banned whenever its other tokens were just
    generated (vLLM's `bad_words`)."""

    skip_special_tokens: bool = sampling_field(True, bool)
    """Leave special tokens (EOS, chat markers) out of the generated text."""

    spaces_between_special_tokens: bool = sampling_field(True, bool)
    """Join special tokens with spaces when they are kept in the text. The tokenizers fastgen loads
    are fast tokenizers, whose decoding has no such option: both values give the tokenizer's own
    text (as in vLLM with a fast tokenizer)."""

    include_stop_str_in_output: bool = sampling_field(False, bool)
    """Keep the matched stop string at the end of the text instead of cutting it off."""

    truncate_prompt_tokens: int | None = sampling_field(None, int, 1)
    """Keep only the last k prompt tokens (>= 1); None = the whole prompt."""

    structured_outputs: StructuredOutputsParams | None = sampling_field(None)
    """What the output must match (vLLM's `structured_outputs`): a dict with one of `json` (a JSON
    schema), `regex`, `choice`, `grammar` (EBNF), `json_object`, `structural_tag` (xgrammar's), or a
    `StructuredOutputsParams`. The
    engine masks every token the constraint forbids, and EOS until the output is complete."""

    priority: int = sampling_field(0, int, -2**31, 2**31 - 1)
    """Scheduling priority: lower values are admitted first and preempted last; equal values are
    first come, first served."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            kind = f.metadata.get("kind")
            if kind is None:
                continue
            value = getattr(self, f.name)
            if value is None and (f.default is None or f.metadata["none_is_default"]):
                setattr(self, f.name, f.default)
                continue
            value = _CHECKS[kind](f.name, value)
            if f.metadata["bounds"] is not None:
                f.metadata["bounds"].check(f.name, value)
            setattr(self, f.name, value)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        if self.max_length is not None and self.min_new_tokens >= self.max_length:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be < max_length "
                             f"({self.max_length}), which also counts the prompt")
        self.stop = self._normalise_words("stop", self.stop)
        self.stop_token_ids = self._normalise_token_ids("stop_token_ids", self.stop_token_ids) or ()
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = self._normalise_token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.allowed_token_ids == ():
            raise FieldValueError("allowed_token_ids must not be empty (None allows every token)", "allowed_token_ids")
        self.bad_words = self._normalise_words("bad_words", self.bad_words)
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
            except (TypeError, ValueError) as exc:
                raise field_error(exc, "structured_outputs") from None
            if self.min_new_tokens:
                raise FieldValueError("min_new_tokens cannot be combined with structured_outputs: the constraint "
                                      "decides where the output may end", "min_new_tokens")

    @staticmethod
    def _normalise_words(name: str, words: Any) -> tuple[str, ...]:
        if words is None:
            return ()
        items = (words,) if isinstance(words, str) else _check_sequence(name, words, "str")
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise FieldTypeError(f"{name}[{i}] must be a str, got {type(item).__name__} ({item!r})", name)
            if not item:
                raise FieldValueError(f"{name}[{i}] must be a non-empty string, got ''", name)
        return items

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise FieldTypeError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}",
                                 "logit_bias")
        out = {}
        for key, value in bias.items():
            if isinstance(key, str) and key.strip().isdigit():
                key = int(key)
            token_id = _check_int(f"logit_bias key {key!r}", key, "logit_bias")
            _check_range("logit_bias token id", token_id, 0, None, field="logit_bias")
            value = _check_float(f"logit_bias[{token_id}]", value, "logit_bias")
            field_bounds("logit_bias", items=True).check(f"logit_bias[{token_id}]", value, field="logit_bias")
            out[token_id] = value
        return out or None

    @staticmethod
    def _normalise_token_ids(name: str, ids: Any) -> tuple[int, ...] | None:
        if ids is None:
            return None
        items = _check_sequence(name, ids, "int")
        bounds = field_bounds(name, items=True)
        checked = []
        for i, item in enumerate(items):
            token_id = _check_int(f"{name}[{i}]", item, name)
            bounds.check(f"{name}[{i}]", token_id, field=name)
            checked.append(token_id)
        return tuple(checked)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the (penalised) logits."""
        return not self.do_sample or self.temperature == 0.0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The supported generation parameter names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, /, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments as `pipe(prompts, **gen)` receives them.

        Raises `FieldTypeError` for a keyword that is not a generation parameter (MII silently
        ignored typos such as `max_new_token`), naming it (its first 80 characters: a key may come
        from a request body of any size).
        """
        names = cls.field_names()
        for key in kwargs:
            if key not in names:
                shown = key[:80]
                raise FieldTypeError(f"unknown generation parameter {shown!r} (supported: {', '.join(names)})", shown)
        return cls(**kwargs)


def field_bounds(name: str, items: bool = False) -> Bounds | None:
    """The declared range of sampling field `name` (of each of its items with `items`); None when unbounded."""
    return _FIELDS[name].metadata.get("items" if items else "bounds")


def field_kind(name: str) -> type | None:
    """The declared scalar kind of sampling field `name` (int, float or bool); None for the others."""
    return _FIELDS[name].metadata.get("kind")


_FIELDS = types.MappingProxyType({f.name: f for f in dataclasses.fields(SamplingParams)})

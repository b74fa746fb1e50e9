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
from dataclasses import dataclass
from typing import Any

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

    max_length: int | None = None
    """Cap on prompt + generated tokens; None = the model's maximum length. The engine rejects a
    prompt whose length is >= max_length."""

    max_new_tokens: int | None = None
    """Cap on generated tokens (>= 1); None = whatever `max_length` leaves after the prompt."""

    min_new_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens are generated (generated
    tokens only, unlike MII which compared it with prompt + generated length)."""

    ignore_eos: bool = False
    """Keep generating past the EOS token. Affects EOS only: `stop` and `stop_token_ids` still
    apply (MII disabled `stop` too)."""

    do_sample: bool = True
    """Sample from the processed distribution; False = greedy (argmax of the penalised logits)."""

    temperature: float = 1.0
    """Logits are divided by this before top-k/top-p (Hugging Face's order). 0 = greedy, as in
    OpenAI and vLLM. None on input means 1.0 (MII's default)."""

    top_k: int = 0
    """Keep only the k most likely tokens (ties with the k-th kept, as Hugging Face does);
    0 = off. None on input means 0 (MII's default)."""

    top_p: float = 0.9
    """Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches
    top_p (at least one token is kept); 1.0 = off. 0.9 is MII's default."""

    stop: tuple[str, ...] = ()
    """Stop strings, matched on the detokenized text; the output is cut before the stop string and
    EOS still stops generation. A str or a list/tuple of non-empty str on input."""

    return_full_text: bool = False
    """Prefix the prompt text to `generated_text` in the response."""

    seed: int | None = None
    """Seed of this request's own random generator, so its samples do not depend on what else is
    batched with it; None = the engine's shared generator."""

    stop_token_ids: tuple[int, ...] = ()
    """Token ids that stop generation (the token is kept in the output ids), besides EOS."""

    repetition_penalty: float = 1.0
    """Hugging Face's repetition penalty (> 0) over prompt and generated tokens: a seen token's
    positive logit is divided by it, a negative one multiplied; 1.0 = off."""

    presence_penalty: float = 0.0
    """OpenAI's presence penalty in [-2, 2]: subtracted once from the logit of every token already
    generated (prompt tokens do not count)."""

    frequency_penalty: float = 0.0
    """OpenAI's frequency penalty in [-2, 2]: subtracted from a token's logit once per time it has
    been generated (prompt tokens do not count)."""

    logprobs: int | None = None
    """None = no logprobs; 0 = the chosen token's logprob; N (<= 20) = also the top-N tokens'.
    Logprobs are of the raw model distribution (before penalties and temperature)."""

    n: int = 1
    """Number of completions to generate for the prompt (1..64)."""

    prompt_logprobs: int | None = None
    """None = none; N (<= 20) = the logprob of every prompt token after the first under the model,
    plus the top-N tokens at each position (vLLM's `prompt_logprobs`; what OpenAI `echo` with
    `logprobs` returns). Computed in the steps that prefill the prompt; such a request does not use
    the prefix cache, since cached tokens have no logits."""

    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's (after
    temperature, top-k and top-p, Hugging Face's order); 0 = off."""

    logit_bias: dict[int, float] | None = None
    """Token id -> bias in [-100, 100] added to its logit before anything else (OpenAI's
    `logit_bias`; keys may be digit strings, as JSON sends them). Greedy rows see it too."""

    allowed_token_ids: tuple[int, ...] | None = None
    """Only these token ids may be generated (a non-empty list); None = all."""

    bad_words: tuple[str, ...] = ()
    """Words that are never generated: the tokens of each word (and of the word after a space) are
    banned as a sequence, i.e. a word's last token is banned whenever its other tokens were just
    generated (vLLM's `bad_words`)."""

    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the generated text."""

    spaces_between_special_tokens: bool = True
    """Join special tokens with spaces when they are kept in the text. The tokenizers fastgen loads
    are fast tokenizers, whose decoding has no such option: both values give the tokenizer's own
    text (as in vLLM with a fast tokenizer)."""

    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text instead of cutting it off."""

    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens (>= 1); None = the whole prompt."""

    priority: int = 0
    """Scheduling priority: lower values are admitted first and preempted last; equal values are
    first come, first served."""

    def __post_init__(self) -> None:
        if self.max_length is not None:
            self.max_length = _check_int("max_length", self.max_length)
            _check_range("max_length", self.max_length, 1, None)
        if self.max_new_tokens is not None:
            self.max_new_tokens = _check_int("max_new_tokens", self.max_new_tokens)
            _check_range("max_new_tokens", self.max_new_tokens, 1, None)
        self.min_new_tokens = _check_int("min_new_tokens", self.min_new_tokens)
        _check_range("min_new_tokens", self.min_new_tokens, 0, None)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        if self.max_length is not None and self.min_new_tokens >= self.max_length:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be < max_length "
                             f"({self.max_length}), which also counts the prompt")

        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.do_sample = _check_bool("do_sample", self.do_sample)
        self.return_full_text = _check_bool("return_full_text", self.return_full_text)

        self.temperature = 1.0 if self.temperature is None else _check_float(
            "temperature", self.temperature)
        _check_range("temperature", self.temperature, 0.0, None)
        self.top_k = 0 if self.top_k is None else _check_int("top_k", self.top_k)
        _check_range("top_k", self.top_k, 0, None)
        self.top_p = _check_float("top_p", self.top_p)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)

        self.stop = self._normalise_stop(self.stop)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
            _check_range("seed", self.seed, 0, MAX_SEED)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)

        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs)
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self.n = _check_int("n", self.n)
        _check_range("n", self.n, 1, MAX_N)

        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs)
            _check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self.min_p = _check_float("min_p", self.min_p)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            items = _check_sequence("allowed_token_ids", self.allowed_token_ids, "int")
            if not items:
                raise FieldValueError("allowed_token_ids must not be empty (None allows every token)",
                                      "allowed_token_ids")
            checked = []
            for i, item in enumerate(items):
                token_id = _check_int(f"allowed_token_ids[{i}]", item, "allowed_token_ids")
                _check_range(f"allowed_token_ids[{i}]", token_id, 0, None, field="allowed_token_ids")
                checked.append(token_id)
            self.allowed_token_ids = tuple(checked)
        self.bad_words = self._normalise_words("bad_words", self.bad_words)
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
            setattr(self, name, _check_bool(name, getattr(self, name)))
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            _check_range("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, None)
        self.priority = _check_int("priority", self.priority)
        _check_range("priority", self.priority, -2**31, 2**31 - 1)

    @staticmethod
    def _normalise_stop(stop: Any) -> tuple[str, ...]:
        return SamplingParams._normalise_words("stop", stop)

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
            _check_range(f"logit_bias[{token_id}]", value, -100.0, 100.0, field="logit_bias")
            out[token_id] = value
        return out or None

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        items = _check_sequence("stop_token_ids", ids, "int")
        checked = []
        for i, item in enumerate(items):
            token_id = _check_int(f"stop_token_ids[{i}]", item, "stop_token_ids")
            _check_range(f"stop_token_ids[{i}]", token_id, 0, None, field="stop_token_ids")
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

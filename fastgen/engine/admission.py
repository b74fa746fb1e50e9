"""Admission: a request's prompt tokenized and every parameter checked against the model before the
engine sees it (`Admission.prepare` -> `PreparedRequest`).

Preparing touches no engine state, so servers do it on their own threads (tokenizing a long prompt
then never holds up the engine thread or an event loop), and a request that passes can no longer
fail validation when it is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

from fastgen.engine.grammar import PreparedGrammar, StructuredOutputManager
from fastgen.sampling_params import FieldValueError, SamplingParams


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request tokenized and validated by `Engine.prepare`, ready for `add_request`.

    Preparing touches no engine state, so servers do it on their own threads (tokenizing a long
    prompt then never holds up the engine thread or an event loop).
    """

    prompt_token_ids: list[int]
    """The prompt's token ids (after `truncate_prompt_tokens`)."""
    params: SamplingParams
    """The request's validated generation parameters."""
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences of `params.bad_words` (each word alone and after a space)."""
    grammar: PreparedGrammar | None = None
    """The structured-output constraint, compiling in the grammar pool (None: unconstrained)."""
    lora: str | None = None
    """The LoRA adapter the request runs under (None: the base model); checked again when it is queued,
    since an adapter may be unloaded in between."""


class Admission:
    """Checks requests against one model: its tokenizer, vocabulary and context length."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 structured_outputs: StructuredOutputManager | None = None) -> None:
        """`max_model_len`: the most tokens (prompt + output) a sequence may hold in this engine;
        `structured_outputs` validates and compiles constraints (None: they are refused)."""
        self.structured_outputs = structured_outputs
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)

    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of a text prompt, or validated ids of a token-id prompt.

        A text prompt whose length alone proves it cannot fit the context is refused before it is
        tokenized, so a huge body costs a `len()`, not seconds of tokenizer time.
        """
        if isinstance(prompt, str):
            if self._max_prompt_chars is not None and len(prompt) > self._max_prompt_chars:
                raise ValueError(
                    f"prompt has {len(prompt)} characters: more than the {self.max_model_len}-token context can hold "
                    f"(no text over {self._max_prompt_chars} characters fits it with this tokenizer)")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise TypeError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        return ids

    def prepare(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                lora: str | None = None) -> PreparedRequest:
        """Tokenize and validate a request without touching engine state (safe on any thread); `lora`
        travels with it (the engine checks the name).

        Raises ValueError/TypeError naming the problem; a request that passes can no longer fail
        validation in `add_request`.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.encode_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        max_len = min(params.max_length or self.max_model_len, self.max_model_len)
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_length is {max_len}: nothing is left to generate "
                f"(the engine holds at most {self.max_model_len} tokens per sequence)"
            )
        for name, token_ids in (("stop_token_ids", params.stop_token_ids),
                                ("logit_bias", tuple(params.logit_bias or ())),
                                ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in token_ids if t >= self.vocab_size]
            if bad:
                raise FieldValueError(f"{name} contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})", name)
        grammar = None
        if params.structured_outputs is not None:
            if self.structured_outputs is None:
                raise FieldValueError("structured_outputs: this engine has no grammar backend", "structured_outputs")
            # Parsed here (an invalid schema raises before anything is queued), compiled in the pool.
            grammar = self.structured_outputs.prepare(params.structured_outputs)
        return PreparedRequest(ids, params, self._bad_words_ids(params.bad_words), grammar, lora)

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens at the start of a text and after a space (vLLM's rule: the spaced
        form counts only when it is a different first token and the same number of tokens)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if bare and bare not in out:
                out.append(bare)
            if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare) and spaced not in out:
                out.append(spaced)
        return tuple(out)


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """The longest text prompt (in characters) that could fit `max_model_len` tokens, or None when
    `tokenizer` cannot say; a longer text is refused without tokenizing it.

    A vocabulary entry spells its token in the tokenizer's own alphabet (byte-level BPE: one
    character per byte; SentencePiece: byte-fallback entries like `<0xE2>` are longer than the
    byte they stand for), so its length bounds the characters of text the token covers. The bound
    is doubled for normalizers that compose characters (NFKC: "e" + U+0301 -> one char).
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(get_vocab):
        return None
    token_chars = max(1, max((len(piece) for piece in get_vocab()), default=1))
    return 2 * token_chars * max_model_len

"""What a caller gets back: MII's `Response`, plus token ids and logprobs when asked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MII_FIELDS = ("generated_text", "prompt_length", "generated_length", "finish_reason")
"""The fields of MII's `Response`, in MII's order (what `to_msg_dict` and MII's REST route carry)."""


@dataclass(slots=True, repr=False)
class Response:
    """One completion (or, while streaming, one delta of it).

    `str(response)` and `repr(response)` are the text, as in MII, so `print(responses)` prints the
    texts; `response.fields()` is every field as a dict (to see token ids, logprobs, ...), and
    `to_msg_dict()` MII's four fields.
    """

    generated_text: str
    """The generated text (the delta while streaming); with `return_full_text`, prompt + generated."""
    prompt_length: int
    """Prompt tokens."""
    generated_length: int
    """Generated tokens so far (all of them, not just this delta)."""
    finish_reason: str
    """"stop" (EOS, stop string or stop token), "length" (max_new_tokens/max_length), "abort",
    "error" (the engine failed the request: see `error`), or "none" for a streamed delta that is not the last."""
    token_ids: list[int]
    """Generated token ids (this delta's while streaming)."""
    logprobs: list[dict[int, float]] | None = None
    """Per generated token, {token_id: logprob} for the chosen token and the top-N, if asked."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With `prompt_logprobs`: per prompt token, {token_id: logprob} for the prompt's own token and
    the top-N (None for the first token, which nothing predicts). On the final response, and on the
    first delta of choice 0 while streaming."""
    index: int = 0
    """Which of the request's `n` completions this is."""
    prompt_index: int = 0
    """Position of the prompt in the caller's list."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    request_id: str = ""
    """The engine's id of the request this completion belongs to."""
    error: BaseException | None = None
    """Only on the one final delta `Engine.step` gives a request that failed inside the engine (a
    `fastgen.engine.RequestFailed`, finish_reason "error"): whoever delivers the request raises it."""

    def __str__(self) -> str:
        return self.generated_text

    def __repr__(self) -> str:
        # MII's Response.__repr__ is the text: code that prints a list of responses shows the texts.
        return self.generated_text

    def fields(self) -> dict[str, Any]:
        """Every field by name (the values themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_msg_dict(self) -> dict[str, Any]:
        """MII's `Response.to_msg_dict()`: generated_text, prompt_length, generated_length, finish_reason."""
        return {name: getattr(self, name) for name in MII_FIELDS}

"""OpenAI's and vLLM's logprob objects, built from the engine's per-token `{token_id: logprob}` entries.

An engine entry holds the scored token first (the chosen one, or the prompt's own token), then the
top-N tokens by logprob; a scored token that is itself in the top-N appears once. The shapes
follow vLLM's server: a completion's `logprobs` lists, per token, the token's text, its logprob and
the first N + 1 entries (OpenAI: "up to logprobs + 1 elements"), with `null` for a prompt's first
token, which nothing predicts; a chat token lists the N most likely tokens; `prompt_logprobs` is
vLLM's list of `{token_id: {logprob, rank, decoded_token}}`. Logprobs below -9999 (or -inf) are
sent as -9999.0, as OpenAI does, since JSON has no infinity. Everything here decodes tokens:
run it on a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_FLOOR = -9999.0

Entry = Mapping[int, float]
"""One token's logprobs: the scored token first, then the top-N."""


def _clamp(logprob: float) -> float:
    # Also maps NaN to the floor: neither -inf nor NaN can be written as JSON.
    return logprob if logprob > _FLOOR else _FLOOR


def token_text(tokenizer: Any, token_id: int, as_ids: bool) -> str:
    """How a logprob token is spelled: its text, or `token_id:N` (`return_tokens_as_token_ids`)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[Entry | None], top_n: int,
                        offset: int = 0, as_ids: bool = False) -> tuple[dict[str, list], int]:
    """OpenAI's completion `logprobs` object for `token_ids` (an entry may be None: a prompt's first
    token), and the text offset after the last token (where a streamed continuation's starts)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id, as_ids)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_clamp(entry[token_id]))
        items = list(entry.items())[:top_n + 1]
        out["top_logprobs"].append({token_text(tokenizer, i, as_ids): _clamp(lp) for i, lp in items})
    return out, offset


def _most_likely(entry: Entry, k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[Entry], top_n: int,
                  as_ids: bool = False) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content`: per generated token, its text, logprob, UTF-8 bytes and the
    `top_n` most likely tokens."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id, as_ids)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}

    return [{**item(t, entry[t]), "top_logprobs": [item(i, lp) for i, lp in _most_likely(entry, top_n)]}
            for t, entry in zip(token_ids, entries)]


def vllm_prompt_logprobs(tokenizer: Any, entries: Sequence[Entry | None], top_n: int,
                         as_ids: bool = False) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token
    `{token_id: {logprob, rank, decoded_token}}` for the prompt's own token and the `top_n` most likely.

    `rank` is the token's place among the `top_n` (1 = most likely); the prompt's own token, when it
    is not among them, has `rank` null: the engine reports the top tokens, not a full ranking.
    """
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(_most_likely(entry, top_n), start=1)}
        out.append({str(token_id): {"logprob": _clamp(lp), "rank": ranks.get(token_id),
                                    "decoded_token": token_text(tokenizer, token_id, as_ids)}
                    for token_id, lp in entry.items()})
    return out


def echo_entries(prompt_ids: Sequence[int], prompt_logprobs: Sequence[Entry | None] | None
                 ) -> list[Entry | None] | None:
    """The entries of the prompt's tokens (None first), or None when the engine gave none (an aborted
    request); checked against the prompt's length so a mismatch can never shift the tokens' logprobs."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(prompt_ids):
        return None
    return list(prompt_logprobs)

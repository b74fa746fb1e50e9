"""N-gram prompt lookup: draft tokens copied from where a sequence's own text repeats itself.

The sequence's last n tokens (its suffix n-gram) are looked up among its earlier tokens, prompt and
output alike; the tokens that followed the match are the draft. The longest n from
`prompt_lookup_max` down to `prompt_lookup_min` that matches wins, and among its matches the most
recent one (the nearest context). vLLM's n-gram proposer also takes the longest n-gram but, among
equally long matches, the earliest. No match: no draft, and the row decodes as usual at no cost.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to k tokens per sequence by prompt lookup; stateless, host only (numpy)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be positive, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None) -> list[int]:
        """The draft for a sequence whose tokens so far are `token_ids`: at most `min(k, max_tokens)`
        tokens (fewer when the match is near the end), empty when no suffix n-gram recurs."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = tokens.shape[0]
        if limit <= 0 or total <= self.min_n:
            return []
        last = total - 1
        # Candidate match ends: earlier positions holding the last token, each with at least one token after it.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if ends.size == 0:
            return []
        # Grow every candidate's match backwards, one position at a time, while it still matches the suffix.
        length = np.ones(ends.shape[0], dtype=np.int64)
        alive = np.ones(ends.shape[0], dtype=bool)
        for offset in range(1, min(self.max_n, total - 1)):
            reach = ends - offset
            ok = alive & (reach >= 0)
            ok[ok] = tokens[reach[ok]] == tokens[last - offset]
            length += ok
            alive = ok
            if not alive.any():
                break
        longest = int(length.max())
        if longest < self.min_n:
            return []
        end = int(ends[np.flatnonzero(length == longest)[-1]])  # the most recent of the longest matches
        return tokens[end + 1:end + 1 + limit].tolist()

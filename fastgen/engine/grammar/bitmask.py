"""Token bitmasks: one int32 word per 32 token ids, bit set = the token is allowed (xgrammar's and
llguidance's shared layout), filled on the host and applied to the logits on their device."""

from __future__ import annotations

import torch
from torch import Tensor

from fastgen.engine.grammar.backend import installed


def allocate_bitmask(num_rows: int, vocab_size: int) -> Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32, every token allowed (rows without a grammar stay so)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask_(scores: Tensor, bitmask: Tensor, rows: list[int] | None = None) -> Tensor:
    """Set `scores[r, t]` to -inf where bit t of `bitmask[r]` is clear, for `rows` (None: all); in
    place, returns `scores`.

    On a GPU with xgrammar installed, xgrammar's CUDA kernel (whichever backend filled the mask: the
    layout is the same). Elsewhere tensor ops: each mask byte looks up its 8 scores' caps (+inf or
    -inf) in a 256-row table, and each score becomes the lesser of itself and its cap. On the CPU
    that is ~5x faster than xgrammar's scalar CPU kernel ([16, 49152] fp32: 0.3 against 1.6 ms,
    2 cores), and far faster than unpacking the bits with shifts (~60 ms).
    """
    num_rows, vocab = scores.shape
    if bitmask.shape[0] != num_rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover scores {tuple(scores.shape)}")
    if scores.device.type == "cuda" and installed("xgrammar") and scores.dtype == torch.float32:
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(scores, bitmask.to(scores.device, non_blocking=True), indices=rows)
        return scores
    words = bitmask if rows is None else bitmask[rows]
    # int32 words are little-endian in memory on every platform torch runs on: byte k holds bits 8k..8k+7.
    table = _byte_caps(scores.dtype, scores.device)
    caps = table.index_select(0, words.to(scores.device).view(torch.uint8).view(-1).int())  # 5x faster than table[...]
    caps = caps.view(words.shape[0], -1)[:, :vocab]
    if rows is None:
        return torch.minimum(scores, caps, out=scores)
    scores[rows] = torch.minimum(scores[rows], caps)
    return scores


def _byte_caps(dtype: torch.dtype, device: torch.device) -> Tensor:
    """[256, 8]: row b holds +inf where bit j of byte b is set, else -inf (a few KB, built per call)."""
    bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
    return torch.full((256, 8), float("inf"), dtype=dtype, device=device).masked_fill_(bits == 0, float("-inf"))

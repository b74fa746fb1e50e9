"""A float64 paged-attention oracle, written for obviousness rather than speed.

It takes the op's own arguments and does what the contract says, one step at a time, in Python
loops: write each real token's K/V to its slot, then for each sequence gather its keys position by
position through its block table, and for each query token and head take the keys the rules let
it see (causal, sliding window, attention chunk), softcap the scores, softmax in float64 (a sink logit, if any, joining
the denominator) and average the values.
Nothing in it is shared with `fastgen.ops`, so an op is checked against the rules, not against
another implementation of them. Small shapes only.
"""

from __future__ import annotations

import math

import torch


def paged_attention_oracle(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float64 output `[tokens, Hq, D]`, K cache after the write, V cache after the write) of one
    `fastgen::paged_attention` call; the caches passed in are left untouched.

    Sequence `s` owns query rows `query_start_loc[s] : query_start_loc[s + 1]`, the last positions of
    its `seq_lens[s]` tokens; rows no sequence owns (padding) are zero. Query position `i` sees key
    position `j` iff `j <= i` and, with a window, `i - j < sliding_window`, and with chunks,
    `j // attention_chunk == i // attention_chunk`. With `sinks`, head `h`'s
    softmax denominator holds one more term, `exp(sinks[h])`, that weighs no value.
    """
    k_after, v_after = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:  # -1: a padding token, written nowhere
            k_after[slot // block_size, slot % block_size] = key[token]
            v_after[slot // block_size, slot % block_size] = value[token]

    num_q_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for s, length in enumerate(seq_lens.tolist()):
        first, last = starts[s], starts[s + 1]
        if length == 0 or first == last:
            continue
        blocks = block_tables[s].tolist()
        keys = [k_after[blocks[p // block_size], p % block_size].double() for p in range(length)]
        values = [v_after[blocks[p // block_size], p % block_size].double() for p in range(length)]
        context = length - (last - first)
        for row in range(first, last):
            i = context + (row - first)
            visible = [j for j in range(i + 1) if (sliding_window <= 0 or i - j < sliding_window)
                       and (attention_chunk <= 0 or j // attention_chunk == i // attention_chunk)]
            for h in range(num_q_heads):
                kv = h // group
                q = query[row, h].double()
                scores = []
                for j in visible:
                    score = float(q @ keys[j][kv]) * scale
                    if softcap > 0:
                        score = softcap * math.tanh(score / softcap)
                    scores.append(score)
                sink = [] if sinks is None else [float(sinks[h])]
                top = max(scores + sink)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights) + sum(math.exp(x - top) for x in sink)
                out[row, h] = sum(w / total * values[j][kv] for w, j in zip(weights, visible))
    return out, k_after, v_after

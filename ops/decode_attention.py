"""Attention of one-token queries (decode rows) over their KV blocks, block by block.

Each (row, block) pair is attended on its own, as one batch entry of a single attention call, and
the partial results of a row are merged through their log-sum-exp (the split-K merge of
flash-decoding). No row pays for another's length, nothing is padded beyond the last block, and the
blocks are read where they lie in the cache instead of being copied. On a 2-core EPYC (fp32, 9/3
heads of 64, 128-token head-major blocks, contexts 200-450, shuffled blocks) one layer's decode
attention measured 15.5 -> 5.6 ms at 32 rows and 43 -> 17.6 ms at 128 rows against the padded,
length-grouped SDPA calls over gathered copies that this replaced.
"""

from __future__ import annotations

import torch

from fastgen.ops.kv_cache import gather_blocks


def attend_decode_rows(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: list[int],
    query_rows: list[int],
    scale: float,
    sliding_window: int,
    softcap: float,
    out: torch.Tensor,
) -> None:
    """Attend the single query token of each of `rows` over its blocks and write it into `out`.

    `rows` index `block_tables`/`seq_lens`; `query_rows[i]` is row `rows[i]`'s token in `query`
    (`[T, num_q_heads, head_dim]`) and `out`. The K/V of this step must already be in the cache.
    """
    if len(rows) <= _FEW_ROWS:
        _attend_rows_one_by_one(query, k_cache, v_cache, block_tables, seq_lens, rows, query_rows, scale,
                                sliding_window, softcap, out)
        return
    device = query.device
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    row_index = torch.tensor(rows, device=device)
    token_index = torch.tensor(query_rows, device=device)
    lens = seq_lens.index_select(0, row_index).long()
    num_blocks = (lens + block_size - 1) // block_size
    columns = torch.arange(int(num_blocks.max()), device=device)
    used = columns < num_blocks[:, None]
    first_pos = torch.zeros_like(lens)
    if sliding_window > 0:
        # Same rule as transformers' sliding window: key visible iff query - key < window.
        first_pos = (lens - sliding_window).clamp_min(0)
        used &= columns >= (first_pos // block_size)[:, None]
    owner, position = used.nonzero(as_tuple=True)
    blocks = block_tables.index_select(0, row_index)[owner, position].long()

    slot = position[:, None] * block_size + torch.arange(block_size, device=device)
    valid = (slot < lens[owner, None]) & (slot >= first_pos[owner, None])
    mask = torch.zeros(valid.shape, dtype=query.dtype, device=device).masked_fill_(~valid, float("-inf"))
    # The query heads sharing a KV head become query rows of that head, so each K/V head is read once.
    q = query.index_select(0, token_index).view(len(rows), num_kv_heads, group, head_dim).index_select(0, owner)
    partial = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=device)
    in_place = _attend_in_place(q, k_cache, v_cache, blocks, mask, scale, softcap, partial, lse)
    _attend_copies(q, k_cache, v_cache, blocks, valid, mask, (~in_place).nonzero().squeeze(1), scale, softcap,
                   partial, lse)
    if partial.shape[0] == len(rows):  # one block per row: nothing to merge
        merged = partial
    else:
        merged = _merge(partial, lse, owner, len(rows))
    out.index_copy_(0, token_index, merged.reshape(len(rows), -1, head_dim).to(out.dtype))


# At most this many rows are attended one by one: the batched path's ~70 small tensor ops per layer cost
# ~1 ms, more than a few rows' own gathers and attention calls (measured on a 2-core EPYC, fp32, rows of
# 3 blocks: 1 row 0.38 vs 1.03 ms, 2 rows 0.71 vs 1.14, 4 rows 1.15 vs 1.18, 8 rows 2.31 vs 1.60).
_FEW_ROWS = 3


def _attend_rows_one_by_one(query, k_cache, v_cache, block_tables, seq_lens, rows: list[int], query_rows: list[int],
                            scale: float, sliding_window: int, softcap: float, out) -> None:
    """Each row's query over a copy of exactly its visible keys (the window's, if any): no mask, no merge."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    for row, token in zip(rows, query_rows):
        seq_len = int(seq_lens[row])
        first = max(0, seq_len - sliding_window) if sliding_window > 0 else 0
        blocks = block_tables[row, first // block_size: -(-seq_len // block_size)].long()
        start, stop = first - first // block_size * block_size, seq_len - first // block_size * block_size
        # [blocks, block_size, heads, dim] -> [heads, blocks x block_size, dim]: one copy whatever the storage order.
        keys, values = (gather_blocks(cache, blocks).permute(2, 0, 1, 3).reshape(num_kv_heads, -1, head_dim)
                        [None, :, start:stop] for cache in (k_cache, v_cache))
        q = query[token].view(1, num_kv_heads, -1, head_dim)
        out[token] = _attend_with_lse(q, keys, values, None, scale, softcap)[0].reshape(-1, head_dim).to(out.dtype)


# A range of the cache is attended in place when it holds at most about twice the blocks wanted from it
# (every block of the range is computed, wanted or not).
_RANGE_SLACK = 2


def _attend_in_place(q, k_cache, v_cache, blocks, mask, scale: float, softcap: float, partial, lse) -> torch.Tensor:
    """Attend pairs straight from the cache, without copying their blocks: the cache rows `lo:hi`
    spanning the blocks are one batch of a single attention call, each block paired with its row's
    query (zeros elsewhere) and its additive `mask` (`[pairs, block_size]`, -inf at invalid slots).
    Returns which pairs were done.

    A block that several rows share (a common prefix) is done here for its first row only. The
    unwritten slots of a sequence's last block hold whatever an earlier owner left, and a NaN or inf
    there poisons its row's softmax even where masked (0 x inf): a pair whose result is not finite is
    left to the copies, which zero those slots.
    """
    if softcap > 0 or q.device.type != "cpu":  # the CPU flash kernel has no softcap
        return torch.zeros_like(blocks, dtype=torch.bool)
    order = torch.argsort(blocks, stable=True)
    ordered = blocks.index_select(0, order)
    done = torch.ones_like(blocks, dtype=torch.bool)
    done[order[1:]] = ordered[1:] != ordered[:-1]
    pick = done.nonzero().squeeze(1)
    chosen = blocks.index_select(0, pick)
    lo, hi = int(chosen.min()), int(chosen.max()) + 1
    if hi - lo > _RANGE_SLACK * pick.numel() + 16:
        return done & False
    offsets = chosen - lo
    query = q.new_zeros((hi - lo, *q.shape[1:])).index_copy_(0, offsets, q.index_select(0, pick))
    range_mask = q.new_zeros((hi - lo, mask.shape[1])).index_copy_(0, offsets, mask.index_select(0, pick))
    keys, values = k_cache[lo:hi].transpose(1, 2), v_cache[lo:hi].transpose(1, 2)
    out, range_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys, values, attn_mask=range_mask[:, None, None, :], scale=scale)
    out = out.index_select(0, offsets)
    # A sum is not finite iff some term is not (or it overflows: then the copy just redoes it); cheaper
    # than an elementwise isfinite over every output.
    finite = torch.isfinite(out.flatten(1).sum(1))
    done[pick] = finite
    partial.index_copy_(0, pick, out)
    lse.index_copy_(0, pick, range_lse.float().index_select(0, offsets))
    return done


# Pairs not done in place are attended over copies of their blocks, at most this many bytes of K (and of V)
# per call: small enough that the attention reads the copy back from the CPU's caches and that the copy
# reuses freed heap pages (glibc serves larger copies from fresh pages the kernel faults in on every call:
# one 33 MB copy per call measured 1.6 GB/s on a 2-core EPYC).
_COPY_BYTES = 2 << 20


def _attend_copies(q, k_cache, v_cache, blocks, valid, mask, pairs: torch.Tensor, scale: float, softcap: float,
                   partial, lse) -> None:
    """Attend `pairs` over copies of their blocks, the unwritten slots zeroed in the copy and masked."""
    per_call = max(1, _COPY_BYTES // (k_cache[0].numel() * k_cache.element_size()))
    for chunk in pairs.split(per_call):
        chunk_blocks = blocks.index_select(0, chunk)
        chunk_valid = valid.index_select(0, chunk)
        keys, values = gather_blocks(k_cache, chunk_blocks), gather_blocks(v_cache, chunk_blocks)
        keys.masked_fill_(~chunk_valid[:, :, None, None], 0)
        values.masked_fill_(~chunk_valid[:, :, None, None], 0)
        out, chunk_lse = _attend_with_lse(q.index_select(0, chunk), keys.transpose(1, 2), values.transpose(1, 2),
                                          mask.index_select(0, chunk)[:, None, None, :], scale, softcap)
        partial.index_copy_(0, chunk, out)
        lse.index_copy_(0, chunk, chunk_lse)


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` `[N, H, G, D]` over `k`/`v` `[N, H, L, D]` with additive `mask` `[N, 1, 1, L]`
    (None: every key): the normalised output and the float32 log-sum-exp of the scores `[N, H, G]`."""
    if softcap == 0 and q.device.type == "cpu":
        # The CPU flash kernel behind SDPA, called directly because SDPA drops the log-sum-exp.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
        return out, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


def _merge(partial: torch.Tensor, lse: torch.Tensor, owner: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Each row's softmax-weighted mean of its blocks' partial outputs `[N, H, G, D]` (flash-decoding's merge)."""
    index = owner.view(-1, 1, 1).expand_as(lse)
    peak = torch.full((num_rows, *lse.shape[1:]), float("-inf"), device=lse.device)
    peak.scatter_reduce_(0, index, lse, "amax", include_self=True)
    weight = torch.exp(lse - peak.index_select(0, owner))
    total = torch.zeros_like(peak).index_add_(0, owner, weight)
    merged = torch.zeros((num_rows, *partial.shape[1:]), device=partial.device)
    merged.index_add_(0, owner, partial.float() * weight[..., None])
    return merged / total[..., None]

"""Attention of one-token queries (decode rows) over their KV blocks, block by block.

Each (row, block) pair is attended on its own, as one batch entry of an attention call, and the
partial results of a row are merged through their log-sum-exp (the split-K merge of
flash-decoding). No row pays for another's length, nothing is padded beyond the last block, and the
blocks are read where they lie in the cache instead of being copied. On a 2-core EPYC (fp32, 9/3
heads of 64, 128-token head-major blocks, contexts 200-450, shuffled blocks) one layer's decode
attention measured 15.5 -> 5.6 ms at 32 rows and 43 -> 17.6 ms at 128 rows against the padded,
length-grouped SDPA calls over gathered copies that this replaced.

Which block each pair reads, where its result goes and which slots it masks depend only on the
step's block tables and sequence lengths, not on the layer: `plan_decode_rows` works them out once
(a `DecodePlan`) and `attend_planned` runs it over each layer's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgen.ops.kv_cache import gather_blocks


@dataclass(slots=True)
class CacheRange:
    """A stretch `lo:hi` of the cache attended in place: cache block `lo + i` is batch entry `i` of one
    attention call, with the query of the row that wants it (an arbitrary token where no row does:
    its result is dropped)."""

    lo: int
    """First cache block of the stretch."""
    hi: int
    """One past its last block."""
    tokens: torch.Tensor
    """int64 `[hi - lo]`: the query token of each block of the stretch."""
    mask: torch.Tensor
    """`[hi - lo, block_size]` additive mask (query dtype): 0 at visible slots, -inf elsewhere."""
    src: torch.Tensor
    """int64 `[k]`: the wanted blocks, as entries of the stretch (block `lo + src[j]`)."""
    dst: torch.Tensor
    """int64 `[k]`: where each wanted block's result goes in the plan's merge grid."""


@dataclass(slots=True)
class CopiedPairs:
    """Pairs attended over copies of their blocks: blocks that another row of the step also reads (a
    shared prefix, in place for its first row only), blocks too scattered for a stretch, and every
    pair where the in-place call is ruled out (softcap, a device other than the CPU)."""

    blocks: torch.Tensor
    """int64 `[C]`: the cache block of each pair."""
    tokens: torch.Tensor
    """int64 `[C]`: the query token of each pair."""
    mask: torch.Tensor
    """`[C, block_size]` additive mask, as in `CacheRange.mask`."""
    dst: torch.Tensor
    """int64 `[C]`: where each result goes in the merge grid."""


@dataclass(slots=True)
class DecodePlan:
    """How one step's decode rows are attended in every layer.

    Results land in a merge grid of `num_rows x width` cells (row-major): cell `(r, c)` holds the
    partial output of row r's c-th visible block; a row with fewer blocks leaves its last cells empty.
    """

    row_tokens: torch.Tensor
    """int64 `[R]`: each row's token in the query and output."""
    width: int
    """Cells per row of the merge grid: the most visible blocks of any row."""
    full: bool
    """Every cell of the grid is filled (no row has fewer blocks than `width`)."""
    ranges: list[CacheRange]
    """Stretches of the cache attended in place."""
    copies: CopiedPairs | None
    """The other pairs, None if there are none."""

    @property
    def num_rows(self) -> int:
        """R."""
        return self.row_tokens.shape[0]


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
    plans: dict | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int = 0,
) -> None:
    """Attend the single query token of each of `rows` over its blocks and write it into `out`.

    `rows` index `block_tables`/`seq_lens`; `query_rows[i]` is row `rows[i]`'s token in `query`
    (`[T, num_q_heads, head_dim]`) and `out`. The K/V of this step must already be in the cache.
    `plans`: this step's plans by their settings, shared by its layers (None: plan for this call only).
    `sinks` (`[num_q_heads]`): attention sinks, applied to each row's result through its log-sum-exp
    (`_sink_weight`). `attention_chunk` > 0: a row sees only the keys of its own chunk of that many
    positions (chunked local attention), like a window that restarts at every chunk start.
    """
    plans = {} if plans is None else plans
    block_size = k_cache.shape[1]
    if len(rows) <= _FEW_ROWS:
        key = ("few", block_size, sliding_window, attention_chunk)
        if key not in plans:
            plans[key] = _visible_spans(block_tables, seq_lens, rows, query_rows, block_size, sliding_window,
                                        attention_chunk)
        _attend_rows_one_by_one(query, k_cache, v_cache, plans[key], scale, softcap, out, sinks)
        return
    in_place = softcap == 0 and query.device.type == "cpu"  # the CPU flash kernel has no softcap
    key = ("batched", block_size, sliding_window, attention_chunk, in_place, query.dtype)
    if key not in plans:
        plans[key] = plan_decode_rows(block_tables, seq_lens, rows, query_rows, block_size, sliding_window, in_place,
                                      query.dtype, attention_chunk)
    attend_planned(plans[key], query, k_cache, v_cache, scale, softcap, out, sinks)


def _sink_weight(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """What a softmax normalised over the keys alone is multiplied by when a sink logit joins its
    denominator: sum / (sum + exp(sink)) = sigmoid(lse - sink), with `lse` `[..., kv_heads, group]` the
    float32 log-sum-exp of the scores and `sinks` `[kv_heads * group]`; shaped to scale `[..., D]` outputs."""
    return torch.sigmoid(lse - sinks.float().view(lse.shape[-2:]))[..., None]


# At most this many rows are attended one by one: the batched path's small tensor ops per layer cost more
# than a few rows' own copies and attention calls (measured on a 2-core EPYC, fp32, rows of 3 blocks, before
# either path was planned once per step: 1 row 0.38 vs 1.03 ms, 2 rows 0.71 vs 1.14, 4 rows 1.15 vs 1.18,
# 8 rows 2.31 vs 1.60).
_FEW_ROWS = 3

# A stretch of the cache ends where more than this many unwanted blocks lie between two wanted ones
# (each is computed, wanted or not: about what a separate attention call costs), and a stretch of fewer
# than `_MIN_RANGE` wanted blocks is left to the copies, which batch such stragglers into one call.
_MAX_GAP = 4
_MIN_RANGE = 4


def plan_decode_rows(block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: list[int], query_rows: list[int],
                     block_size: int, sliding_window: int, in_place: bool, dtype: torch.dtype,
                     attention_chunk: int = 0) -> DecodePlan:
    """The `DecodePlan` of `rows` (their tokens `query_rows`) for a cache of `block_size`-token blocks,
    masks in `dtype`; `in_place` False sends every pair to the copies."""
    device = block_tables.device
    row_index = torch.tensor(rows, device=device)
    lens = seq_lens.index_select(0, row_index).long()
    num_blocks = (lens + block_size - 1) // block_size
    first_pos = torch.zeros_like(lens)
    if sliding_window > 0:
        # Same rule as transformers' sliding window: key visible iff query - key < window.
        first_pos = (lens - sliding_window).clamp_min(0)
    if attention_chunk > 0:
        # Same rule as transformers' chunked attention: the query (position lens - 1) sees its own chunk only.
        first_pos = torch.maximum(first_pos, (lens - 1) // attention_chunk * attention_chunk)
    first_block = first_pos // block_size
    columns = torch.arange(int(num_blocks.max()), device=device)
    used = (columns < num_blocks[:, None]) & (columns >= first_block[:, None])
    owner, position = used.nonzero(as_tuple=True)
    blocks = block_tables.index_select(0, row_index)[owner, position].long()
    slot = position[:, None] * block_size + torch.arange(block_size, device=device)
    valid = (slot < lens[owner, None]) & (slot >= first_pos[owner, None])
    mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))
    row_tokens = torch.tensor(query_rows, device=device)
    tokens = row_tokens.index_select(0, owner)
    cell = position - first_block.index_select(0, owner)
    width = int(cell.max()) + 1
    dst = owner * width + cell

    ranges: list[CacheRange] = []
    copied = torch.ones_like(blocks, dtype=torch.bool)
    if in_place:
        for pairs in _stretches(blocks):
            copied[pairs] = False
            lo, hi = int(blocks[pairs[0]]), int(blocks[pairs[-1]]) + 1
            src = blocks.index_select(0, pairs) - lo
            ranges.append(CacheRange(
                lo=lo, hi=hi,
                tokens=torch.zeros(hi - lo, dtype=torch.long, device=device).index_copy_(0, src, tokens[pairs]),
                mask=mask.new_zeros((hi - lo, block_size)).index_copy_(0, src, mask.index_select(0, pairs)),
                src=src, dst=dst.index_select(0, pairs)))
    rest = copied.nonzero().squeeze(1)
    copies = None
    if rest.numel():
        copies = CopiedPairs(blocks=blocks.index_select(0, rest), tokens=tokens.index_select(0, rest),
                             mask=mask.index_select(0, rest), dst=dst.index_select(0, rest))
    return DecodePlan(row_tokens=row_tokens, width=width,
                      full=owner.numel() == len(rows) * width, ranges=ranges, copies=copies)


def _stretches(blocks: torch.Tensor) -> list[torch.Tensor]:
    """The pairs read in place, as index tensors into `blocks`, one per stretch of the cache, each in
    block order: the first pair of every distinct block, cut where the gaps between blocks grow large."""
    order = torch.argsort(blocks, stable=True).tolist()
    block_ids = blocks.tolist()
    stretches, current, last = [], [], None
    for pair in order:
        block = block_ids[pair]
        if block == last:  # a block shared with an earlier row: that row reads it in place
            continue
        if last is not None and block - last > _MAX_GAP + 1:
            stretches.append(current)
            current = []
        current.append(pair)
        last = block
    stretches.append(current)
    return [torch.tensor(s, device=blocks.device) for s in stretches if len(s) >= _MIN_RANGE]


def attend_planned(plan: DecodePlan, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                   softcap: float, out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
    """Run `plan` over one layer's cache: every row's output written into `out` at its token (scaled for
    `sinks`, if any)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    cells = plan.num_rows * plan.width
    shape = (cells, num_kv_heads, group, head_dim)
    # Empty cells must weigh nothing in the merge: a zero output at a log-sum-exp of -inf.
    partial = query.new_empty(shape) if plan.full else query.new_zeros(shape)
    lse = torch.full(shape[:3], float("-inf"), device=query.device)
    for stretch in plan.ranges:
        result, result_lse = _attend_in_place(stretch, query, k_cache, v_cache, scale, group)
        partial.index_copy_(0, stretch.dst, result)
        lse.index_copy_(0, stretch.dst, result_lse)
    if plan.copies is not None:
        c = plan.copies
        result, result_lse = _attend_copies(query, k_cache, v_cache, c.blocks, c.tokens, c.mask, scale, softcap)
        partial.index_copy_(0, c.dst, result)
        lse.index_copy_(0, c.dst, result_lse)
    if plan.width == 1:  # one block per row: nothing to merge
        merged, row_lse = partial, lse
    else:
        cell_lse = lse.view(plan.num_rows, plan.width, *shape[1:3])
        merged = _merge(partial.view(plan.num_rows, plan.width, *shape[1:]), cell_lse)
        row_lse = torch.logsumexp(cell_lse, dim=1) if sinks is not None else None
    if sinks is not None:
        merged = merged.float() * _sink_weight(row_lse, sinks)
    out.index_copy_(0, plan.row_tokens, merged.reshape(plan.num_rows, -1, head_dim).to(out.dtype))


def _attend_in_place(stretch: CacheRange, query, k_cache, v_cache, scale: float,
                     group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The wanted blocks of `stretch` attended straight from the cache (one CPU flash-attention call):
    their outputs `[k, kv_heads, group, head_dim]` and float32 log-sum-exps.

    The unwritten slots of a sequence's last block hold whatever an earlier owner left, and a NaN or
    inf there poisons its row's softmax even where masked (0 x inf): a block whose result is not
    finite is redone over a copy, which zeroes those slots.
    """
    n, num_kv_heads, head_dim = stretch.hi - stretch.lo, k_cache.shape[2], k_cache.shape[3]
    keys = k_cache[stretch.lo:stretch.hi].transpose(1, 2)
    values = v_cache[stretch.lo:stretch.hi].transpose(1, 2)
    # In place only without softcap on the CPU (see attend_decode_rows): `_attend_with_lse`'s flash branch.
    q = query.index_select(0, stretch.tokens).view(n, num_kv_heads, group, head_dim)
    result, result_lse = _attend_with_lse(q, keys, values, stretch.mask[:, None, None, :], scale, 0.0)
    result, result_lse = result.index_select(0, stretch.src), result_lse.index_select(0, stretch.src)
    # A sum is not finite iff some term is not (or it overflows: then the copy just redoes it); one
    # check of the whole result, cheaper than an elementwise isfinite.
    if not bool(torch.isfinite(result.sum())):
        bad = (~torch.isfinite(result.flatten(1).sum(1))).nonzero().squeeze(1)
        wanted = stretch.src.index_select(0, bad)
        redone, redone_lse = _attend_copies(query, k_cache, v_cache, wanted + stretch.lo,
                                            stretch.tokens.index_select(0, wanted),
                                            stretch.mask.index_select(0, wanted), scale, 0.0)
        result.index_copy_(0, bad, redone)
        result_lse.index_copy_(0, bad, redone_lse)
    return result, result_lse


def _visible_spans(block_tables, seq_lens, rows: list[int], query_rows: list[int], block_size: int,
                   sliding_window: int, attention_chunk: int = 0) -> list[tuple[int, list[int], int, int]]:
    """Per row: its token, the cache blocks holding its visible keys (the window's and its attention
    chunk's, if any), and where those keys start and stop in the blocks' concatenation."""
    tables, lens = block_tables.tolist(), seq_lens.tolist()
    spans = []
    for row, token in zip(rows, query_rows):
        seq_len = lens[row]
        first = max(0, seq_len - sliding_window) if sliding_window > 0 else 0
        if attention_chunk > 0:
            first = max(first, (seq_len - 1) // attention_chunk * attention_chunk)
        first_block = first // block_size
        blocks = tables[row][first_block: -(-seq_len // block_size)]
        spans.append((token, blocks, first - first_block * block_size, seq_len - first_block * block_size))
    return spans


def _attend_rows_one_by_one(query, k_cache, v_cache, spans: list[tuple[int, list[int], int, int]], scale: float,
                            softcap: float, out, sinks: torch.Tensor | None = None) -> None:
    """Each row's query over exactly its visible keys (`_visible_spans`): no mask, no merge. The keys of a
    row within one block are read where they lie; those of a longer row are copied into one stretch."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for token, blocks, start, stop in spans:
        if len(blocks) == 1:
            # [heads, block_size, dim] is a view of the block (contiguous in the head-major layout), and the
            # slice stops at the row's last key: no unwritten slot is read.
            keys, values = (cache[blocks[0]].transpose(0, 1)[None, :, start:stop] for cache in (k_cache, v_cache))
        else:
            keys, values = (torch.cat([cache[b].transpose(0, 1) for b in blocks], dim=1)[None, :, start:stop]
                            for cache in (k_cache, v_cache))
        q = query[token].view(1, num_kv_heads, -1, head_dim)
        result, lse = _attend_with_lse(q, keys, values, None, scale, softcap)
        if sinks is not None:
            result = result.float() * _sink_weight(lse, sinks)
        result = result.view(-1, head_dim)
        out[token] = result if result.dtype == out.dtype else result.to(out.dtype)


# Pairs not done in place are attended over copies of their blocks, at most this many bytes of K (and of V)
# per call: small enough that the attention reads the copy back from the CPU's caches and that the copy
# reuses freed heap pages (glibc serves larger copies from fresh pages the kernel faults in on every call:
# one 33 MB copy per call measured 1.6 GB/s on a 2-core EPYC).
_COPY_BYTES = 2 << 20


def _attend_copies(query, k_cache, v_cache, blocks: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                   scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (`blocks[i]` attended by the query of token `tokens[i]`, masked by `mask[i]`) over copies of
    their blocks, the masked slots zeroed in the copy: outputs `[C, kv_heads, group, head_dim]` and
    float32 log-sum-exps `[C, kv_heads, group]`."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    per_call = max(1, _COPY_BYTES // (k_cache[0].numel() * k_cache.element_size()))
    outs, lses = [], []
    for start in range(0, blocks.numel(), per_call):
        chunk = slice(start, start + per_call)
        chunk_mask = mask[chunk]
        hidden = (chunk_mask != 0)[:, :, None, None]
        keys = gather_blocks(k_cache, blocks[chunk]).masked_fill_(hidden, 0)
        values = gather_blocks(v_cache, blocks[chunk]).masked_fill_(hidden, 0)
        q = query.index_select(0, tokens[chunk]).view(keys.shape[0], num_kv_heads, -1, head_dim)
        result, result_lse = _attend_with_lse(q, keys.transpose(1, 2), values.transpose(1, 2),
                                              chunk_mask[:, None, None, :], scale, softcap)
        outs.append(result)
        lses.append(result_lse)
    return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` `[N, H, G, D]` over `k`/`v` `[N, H, L, D]` with additive `mask` `[N, 1, 1, L]`
    (None: every key): the normalised output and the float32 log-sum-exp of the scores `[N, H, G]`."""
    if softcap == 0 and q.device.type == "cpu":
        out, lse = _flash_one_row(q.flatten(1, 2), k, v, mask, scale)
        return out.view(q.shape), lse.view(q.shape[:3]).float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


def _flash_one_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel behind SDPA (called directly: SDPA drops the log-sum-exp) for one query token per
    batch entry, `q` `[N, Hq, D]`, over `k`/`v` `[N, Hkv, L, D]` (GQA: Hq a multiple of Hkv), masked by `mask`
    `[N, 1, 1, L]`: outputs `[N, Hq, 1, D]` and log-sum-exps `[N, Hq, 1]` (the kernel's dtype).

    Each query head is its own one-row query, although the heads sharing a KV head could be one query of
    `Hq / Hkv` rows that reads the head once: torch 2.13's kernel takes a much faster path for one-row
    queries. 381 blocks of 128 slots x 3 KV heads of 64, bf16, 9 query heads, 2-core AMX Xeon, each layer's
    cache cold: 2.9 ms a layer as 9 one-row heads against 3.8 ms as 3 heads of 3 rows (one-row queries of 3
    heads alone: 1.8 ms, near the machine's streaming reads).
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.unsqueeze(2), k, v, attn_mask=mask,
                                                                        scale=scale)


def _merge(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Each row's softmax-weighted mean of its cells' partial outputs `[R, W, H, G, D]`, whose log-sum-exps
    are `lse` `[R, W, H, G]` (flash-decoding's merge). An empty cell's -inf weighs 0; every row has a cell.

    The weights are normalised first (one softmax over the small `lse`), so the `[R, W, H, G, D]` product
    needs no division after its sum: 117 -> 82 us at 128 rows of 4 cells of 9 heads of 64 (bf16 partials).
    """
    return (partial.float() * torch.softmax(lse, dim=1)[..., None]).sum(1)

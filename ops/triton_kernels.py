"""Triton kernels for the paged KV cache: the KV write, the unified ragged attention, the split-KV reduce.

Import this module only when a kernel is about to launch (`fastgen.ops.triton_attention` does):
`triton.jit` decides at decoration time whether a kernel runs compiled or through the interpreter,
so `TRITON_INTERPRET=1` is honoured as long as it is set before the first Triton attention call.

Work split of the attention kernel (the ideas of vLLM's unified kernel, written anew here):
- program axis 0 walks "query blocks": sequence `s` owns the `cdiv(query_len_s, BLOCK_Q)` indices
  starting at `query_start_loc[s] // BLOCK_Q + s`. Those ranges never overlap and all lie below
  `num_tokens // BLOCK_Q + num_seqs`, a bound the host knows without reading device memory, so
  the launch never syncs and can be captured in a CUDA graph. A program finds its sequence by a
  binary search over `query_start_loc` and returns at once if it owns nothing (padding).
- program axis 1 is the KV head; the `GROUP` query heads sharing it are packed into the M rows of
  the tile (row `m` = query token `m // GROUP`, head `m % GROUP`), so a decode step with one token
  still gives `tl.dot` a full M dimension.
- program axis 2 is the KV split: with `NUM_SPLITS > 1` each program attends over one contiguous
  share of its key tiles and stores an unnormalised partial result that `reduce_splits_kernel`
  merges. Decode with few sequences and long contexts thus still fills the GPU.
Softmax runs online in fp32 in the log2 domain; key tiles outside the causal range, the
sliding window or the query block's attention chunks are never visited.

The kernels call only `tl` builtins, never the jit functions of `triton.language.standard`
(`tl.cdiv`, `tl.zeros`, `tl.max`, `tl.sum`, ...): those are decorated when triton is first
imported (torch._dynamo imports it), and if that happened before TRITON_INTERPRET=1 was set the
interpreter cannot call them. Hence the written-out ceil divisions and `tl.reduce` with local
combine functions.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_tokens, block_size, num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_T: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """One program per `BLOCK_T` tokens: copy each token's K and V (all KV heads) into its slot; slot < 0 is padding."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    blocks = slots // block_size
    offsets = slots % block_size
    # Columns run over (head, dim) pairs so one 2-D tile covers every KV head of a token.
    cols = tl.arange(0, HEADS_PAD * HEAD_DIM_PAD)
    heads = cols // HEAD_DIM_PAD
    dims = cols % HEAD_DIM_PAD
    mask = (slots >= 0)[:, None] & ((heads < num_kv_heads) & (dims < head_dim))[None, :]
    k = tl.load(key_ptr + tokens[:, None] * stride_kt + (heads * stride_kh + dims)[None, :], mask=mask)
    v = tl.load(value_ptr + tokens[:, None] * stride_vt + (heads * stride_vh + dims)[None, :], mask=mask)
    k_dst = k_cache_ptr + (blocks * stride_kcb + offsets * stride_kcs)[:, None] + (heads * stride_kch + dims)[None, :]
    v_dst = v_cache_ptr + (blocks * stride_vcb + offsets * stride_vcs)[:, None] + (heads * stride_vch + dims)[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _locate(query_start_loc_ptr, seq_lens_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    """This program's sequence, the first query index of its block, the query length and seq_len.

    The sequence is the last one whose first query block (`query_start_loc[s] // BLOCK_Q + s`)
    is <= this program's index: a binary search, since that start never decreases with `s`.
    """
    q_block = tl.program_id(0)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    block_first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    seq_len = tl.load(seq_lens_ptr + seq)
    return seq, q_start, block_first, query_len, seq_len


@triton.jit
def paged_attention_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    num_seqs, num_q_heads, scale, softcap, sliding_window, attention_chunk, block_size, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    """Causal attention of one query block of one sequence, one KV head's query heads, one KV split.

    With `USE_CHUNK`, a query sees only the keys of its own chunk of `attention_chunk` positions (chunks
    counted from position 0: Llama 4's chunked local attention).

    With `USE_SINKS`, each query head's sink logit (`sinks_ptr[head]`) joins the softmax's denominator
    when the result is normalised (here, or in `reduce_splits_kernel` when the KV is split)."""
    seq, q_start, block_first, query_len, seq_len = _locate(query_start_loc_ptr, seq_lens_ptr, num_seqs, BLOCK_Q)
    if (block_first >= query_len) | (seq_len <= 0):
        return
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_index = block_first + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (q_index < query_len)
    tokens = (q_start + q_index).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < head_dim
    q = tl.load(query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + q_index

    # Keys this block can see: up to its last query's position, from its first query's window start.
    kv_end = context_len + tl.minimum(block_first + BLOCK_Q, query_len)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(context_len + block_first - sliding_window + 1, 0)
    if USE_CHUNK:
        # The block's first query has the earliest chunk start; later queries mask the rest of it below.
        kv_begin = tl.maximum(kv_begin, (context_len + block_first) // attention_chunk * attention_chunk)
    tile_begin = kv_begin // TILE_N
    tile_end = (kv_end + TILE_N - 1) // TILE_N
    if NUM_SPLITS > 1:
        per_split = (tile_end - tile_begin + NUM_SPLITS - 1) // NUM_SPLITS
        tile_begin = tile_begin + split * per_split
        tile_end = tl.minimum(tile_begin + per_split, tile_end)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_begin, tile_end):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = keys < kv_end
        block = tl.load(table_row + keys // block_size, mask=key_ok, other=0).to(tl.int64)
        offset = keys % block_size
        k = tl.load(k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_ks + kv_head * stride_kh
                    + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_DOT:
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        if USE_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly to +-1 at both ends in fp32.
            capped = scores * scale / softcap
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)) * LOG2E
        else:
            scores = scores * (scale * LOG2E)
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - sliding_window)
        if USE_CHUNK:
            visible = visible & (keys[None, :] >= (q_pos // attention_chunk * attention_chunk)[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.reduce(scores, 1, _maximum))
        # A row with nothing visible yet keeps max -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.math.exp2(scores - safe_max[:, None])
        alpha = tl.math.exp2(row_max - safe_max)
        row_sum = row_sum * alpha + tl.reduce(p, 1, _add)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max

    if NUM_SPLITS == 1:
        if USE_SINKS:
            # exp(sink) in the scale of the running sum (log2 domain, relative to the row max); a row
            # that saw no key has max -inf and acc 0, and stays 0.
            sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            row_sum = row_sum + tl.math.exp2(sink - row_max)
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (tokens * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, row_max, mask=row_ok)
        tl.store(part_sum_ptr + part, row_sum, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    num_seqs, num_q_heads, head_dim, stride_ot, stride_oh,
    HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_SINKS: tl.constexpr,
):
    """Merge the partial results of the KV splits; same grid (axes 0, 1) and rows as the attention kernel."""
    seq, q_start, block_first, query_len, seq_len = _locate(query_start_loc_ptr, seq_lens_ptr, num_seqs, BLOCK_Q)
    if (block_first >= query_len) | (seq_len <= 0):
        return
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    q_index = block_first + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (q_index < query_len)
    tokens = (q_start + q_index).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    base = (tokens * num_q_heads + heads) * NUM_SPLITS

    total_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        total_max = tl.maximum(total_max, tl.load(part_max_ptr + base + split, mask=row_ok, other=float("-inf")))
    safe_max = tl.where(total_max == float("-inf"), 0.0, total_max)
    total_sum = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        weight = tl.math.exp2(tl.load(part_max_ptr + base + split, mask=row_ok, other=float("-inf")) - safe_max)
        total_sum += weight * tl.load(part_sum_ptr + base + split, mask=row_ok, other=0.0)
        part = tl.load(part_acc_ptr + (base + split)[:, None] * HEAD_DIM_PAD + dims[None, :], mask=row_ok[:, None],
                       other=0.0)
        acc += weight[:, None] * part
    if USE_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        total_sum += tl.math.exp2(sink - safe_max)
    out = acc / tl.where(total_sum == 0.0, 1.0, total_sum)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < head_dim)[None, :])

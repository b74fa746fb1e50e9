"""Paged attention over a blocked KV cache, as one `torch.library` custom op.

The op both writes this step's K/V into the cache (through `slot_mapping`) and attends each
sequence's query tokens over its blocks (through `block_tables`). Keeping both inside one opaque
op lets `torch.compile(fullgraph=True)` fuse everything around it and lets a CUDA graph capture
the whole step. The implementation here, `torch_paged_attention`, is the CPU path: plain torch,
tuned for the CPU (one-token rows attended block by block, all in one call, by
`fastgen.ops.decode_attention`). The Triton kernel (`fastgen.ops.triton_attention`) serves CUDA
tensors; both are tested against a float64 oracle.

Four ops share one signature: `fastgen::paged_attention` picks by device (Triton on CUDA, torch
elsewhere), `fastgen::paged_attention_torch` is always the torch path,
`fastgen::paged_attention_triton` always Triton (on the CPU only through `TRITON_INTERPRET=1`) and
`fastgen::paged_attention_cpu` the torch path with its decode rows on fastgen's C++ CPU kernel.

KV-cache layout (per layer, K and V separately): `[num_blocks, block_size, num_kv_heads, head_dim]` by
shape, any storage order (`fastgen.ops.kv_cache`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from fastgen.ops.cpu_kernels.decode import MAX_QUERY_LEN, plan_kernel_step
from fastgen.ops.decode_attention import attend_decode_rows
from fastgen.ops.kv_cache import gather_blocks, kv_slots, write_kv_cache
from fastgen.ops.triton_attention import triton_paged_attention

if TYPE_CHECKING:
    from fastgen.ops.attention_metadata import AttentionMetadata


def _attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    plans: dict | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int = 0,
) -> torch.Tensor:
    """Causal attention of `q` `[Q, Hq, D]`, the last Q positions, over `k`/`v` `[L, Hkv, D]`. `plans`:
    the step's plans (`torch_paged_attention`), where the mask is kept for the step's other layers.
    `sinks`: per query head, a logit in the softmax's denominator only (`torch_paged_attention`).
    `attention_chunk` > 0: position 0 of `k` starts a chunk (the caller cuts `k` at a chunk start)."""
    num_q, num_ctx = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    explicit = softcap > 0 or sinks is not None  # scores SDPA cannot give: computed one by one
    unmasked = ((sliding_window <= 0 or sliding_window >= num_ctx)
                and (attention_chunk <= 0 or attention_chunk >= num_ctx))
    if not explicit and unmasked:
        # A query block over exactly its own keys is SDPA's `is_causal`: no mask tensor, and its
        # flash kernel skips the masked tiles.
        if num_q == num_ctx:
            return F.scaled_dot_product_attention(qh, kh, vh, scale=scale, is_causal=True,
                                                  enable_gqa=True)[0].transpose(0, 1)
    # SDPA takes the additive mask as is, where it would turn a bool one into that every call; built
    # once a step, the masks of a 200-token chunk over 1200 positions cost 870 against 1025 us a call
    # (bf16, 8/2 heads of 64, 2-core AMX Xeon).
    additive = None if explicit else q.dtype
    key = ("causal_mask", num_q, num_ctx, sliding_window, attention_chunk, additive)
    plans = {} if plans is None else plans
    if key not in plans:
        plans[key] = _causal_mask(num_q, num_ctx, sliding_window, q.device, additive, attention_chunk)
    return _attend_heads(qh, kh, vh, plans[key], scale, softcap, sinks)[0].transpose(0, 1)


def _causal_mask(num_q: int, num_ctx: int, sliding_window: int, device: torch.device,
                 additive: torch.dtype | None, attention_chunk: int = 0) -> torch.Tensor:
    """`[1, 1, Q, L]`: which of `num_ctx` keys each of the last `num_q` positions sees (`sliding_window` 0 =
    all earlier ones; `attention_chunk` > 0: only those of its own chunk of that many positions, chunks
    starting at key 0), as bools or, with `additive` a dtype, 0 where visible and -inf elsewhere."""
    q_pos = torch.arange(num_ctx - num_q, num_ctx, device=device).unsqueeze(1)
    k_pos = torch.arange(num_ctx, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window > 0:
        # Same rule as transformers' sliding-window overlay: key visible iff q - k < window.
        mask = mask & (k_pos > q_pos - sliding_window)
    if attention_chunk > 0:
        # Same rule as transformers' chunked overlay: key visible iff it lies in the query's chunk.
        mask = mask & (k_pos // attention_chunk == q_pos // attention_chunk)
    if additive is not None:
        mask = torch.zeros(mask.shape, dtype=additive, device=device).masked_fill_(~mask, float("-inf"))
    return mask[None, None]


def _attend_heads(qh, kh, vh, mask, scale: float, softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`qh` `[B, Hq, Q, D]` attends `kh`/`vh` `[B, Hkv, L, D]` (GQA) where `mask` (broadcast to `[B, 1, Q, L]`) is
    True, or, with no softcap and no sinks, adds `mask` (0 or -inf) to the scores."""
    if softcap > 0 or sinks is not None:
        group = qh.shape[1] // kh.shape[1]
        kh = kh.repeat_interleave(group, dim=1).float()
        vh = vh.repeat_interleave(group, dim=1).float()
        scores = torch.matmul(qh.float(), kh.transpose(2, 3)) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            return torch.matmul(torch.softmax(scores, dim=-1), vh).to(qh.dtype)
        # The sink is one more logit per head in the denominator, with no value: its probability is dropped.
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs, vh).to(qh.dtype)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)


def torch_paged_attention(
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
    step_plans: dict | None = None,
    kernels: bool = False,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each sequence's blocks (plain torch: the
    CPU path, and the backend "torch" anywhere).

    `query` is `[T, num_q_heads, head_dim]`, `key`/`value` `[T, num_kv_heads, head_dim]`; the
    metadata is that of `AttentionMetadata`. `sliding_window` 0 means full attention; `softcap`
    0 means no tanh soft-capping of the scores. `sinks` (`[num_q_heads]`, None = none): attention
    sinks (gpt-oss), one learned logit per query head added to the softmax's denominator and to no
    value, so a head may attend to nothing: out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)).
    `attention_chunk` > 0 (Llama 4's chunked local attention): positions are cut into chunks of that
    many from position 0, and a query sees only the earlier keys of its own chunk (0 = no chunks).
    Returns `[T, num_q_heads, head_dim]`, zeros for padded tokens. `step_plans`
    (`AttentionMetadata.step_plans`): what the first layer of a step works out from the metadata,
    kept for the other layers; None works it out for this call only. `kernels`: the rows of sequences
    with at most `MAX_QUERY_LEN` query tokens, and of longer chunks within the kernel's bound
    (`chunk_pairs_limit`: every chunk with AVX512-BF16), go to the C++ CPU kernel where it serves
    the call (`cpu_paged_attention`), which writes the K/V too.
    """
    plans = (_tensor_step_plans(slot_mapping, block_tables, query_start_loc, seq_lens) if step_plans is None
             else step_plans)
    out, max_query_len = None, 0
    if kernels:
        if "kernel" not in plans:
            plans["kernel"] = plan_kernel_step(block_tables, seq_lens, query_start_loc)
        step = plans["kernel"]
        if step is not None:
            # The K/V write, the attention and the zeroed rows in one call: a decode step's layer ends here.
            out = step.op(query, key, value, k_cache, v_cache, slot_mapping, *step.metadata, scale, sliding_window,
                          softcap, sinks, attention_chunk, step.max_query_len)
            if out is not None:
                if step.every_row:
                    return out
                max_query_len = step.max_query_len
    # The CPU flash kernel reads each head's vector as if its elements were adjacent, whatever the
    # strides say (torch 2.13: a query with a last-dim stride of 2 gave wrong outputs, no error).
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if "offsets" not in plans:
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        # One query token (a decode, or a one-token prompt chunk): attended block by block, all rows at once.
        single = [s for s, n in enumerate(lens) if n > 0 and starts[s + 1] - starts[s] == 1]
        # The others, each attended on its own; listed once a step, not found again by every layer among
        # up to hundreds of decode rows.
        chunks = [(s, starts[s], starts[s + 1], n) for s, n in enumerate(lens)
                  if n > 0 and starts[s + 1] - starts[s] > 1]
        plans["offsets"] = starts, single, chunks
    starts, single, chunks = plans["offsets"]
    block_size = k_cache.shape[1]
    if out is None:  # else the kernel wrote every token's K/V and attended the queries up to max_query_len
        if "slots" not in plans:
            plans["slots"] = kv_slots(slot_mapping, block_size)
        # Every token's K/V is written before any sequence attends: a sequence admitted with a prefix-cache
        # hit may read blocks that another sequence of the same step is filling right now.
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping, plans["slots"])
        out = torch.zeros_like(query)
        if single:
            attend_decode_rows(query, k_cache, v_cache, block_tables, seq_lens, single, [starts[s] for s in single],
                               scale, sliding_window, softcap, out, plans, sinks, attention_chunk)
    for s, q_start, q_end, seq_len in chunks:
        if q_end - q_start <= max_query_len:
            continue  # attended by the kernel above
        # With chunked attention no query of this step sees a key before its first query's chunk: the
        # keys start there, a chunk start, so the mask's chunks (counted from key 0) stay the real ones.
        first = (seq_len - (q_end - q_start)) // attention_chunk * attention_chunk if attention_chunk > 0 else 0
        if seq_len - first == q_end - q_start:
            # No earlier visible context (a prompt's first chunk): its K/V are this step's, no gather needed.
            k = key[q_start:q_end].to(k_cache.dtype)
            v = value[q_start:q_end].to(v_cache.dtype)
        else:
            first_block = first // block_size
            blocks = block_tables[s, first_block: -(-seq_len // block_size)].long()
            keep = slice(first - first_block * block_size, seq_len - first_block * block_size)
            k = gather_blocks(k_cache, blocks).flatten(0, 1)[keep]
            v = gather_blocks(v_cache, blocks).flatten(0, 1)[keep]
        out[q_start:q_end] = _attend_one(query[q_start:q_end], k, v, scale, sliding_window, softcap, plans, sinks,
                                         attention_chunk)
    return out


def _tensor_step_plans(slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor) -> dict:
    """The step plans of the step `slot_mapping` belongs to, for a call without `AttentionMetadata` (a
    compiled layer's call of the op): kept on that tensor, which each layer of the step is handed and which
    no two steps share (every step's inputs are new tensors, or new views of the static buffers), so the
    step's first layer works them out for all (SmolLM2's 30 layers: ~1 ms of a 19 ms int4 decode step).
    They stand only while the call's other metadata tensors are the same objects as the first layer's."""
    kept = slot_mapping.__dict__.get("_fastgen_step_plans")
    if kept is None or kept[0] is not query_start_loc or kept[1] is not seq_lens or kept[2] is not block_tables:
        kept = slot_mapping.__dict__["_fastgen_step_plans"] = (query_start_loc, seq_lens, block_tables, {})
    return kept[3]


def cpu_paged_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """`torch_paged_attention` with `kernels=True` (the backend "cpu"): the rows of every sequence with at
    most `MAX_QUERY_LEN` query tokens (decode rows, speculative verification rows, short prompt chunks), and
    of longer chunks within the kernel's bound (`chunk_pairs_limit`), attended by fastgen's C++ CPU kernel in
    one call (`fastgen.ops.cpu_kernels`); the other chunks, and every row where the kernel is off, unbuilt or
    does not take the call's shapes, stay on the torch path."""
    return torch_paged_attention(*args, **kwargs, kernels=True)


# Registered through `torch.library.Library` rather than `torch.library.custom_op`: the latter wraps
# every call in Python autograd / inplace-view handling that measured ~80-110 us per call against
# ~7-11 us here, paid once per layer per step. The step runs under inference mode, so no autograd
# kernel is needed. The Library object owns the registrations; it lives as long as this module.
_SCHEMA = ("(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
           "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window=0, "
           "float softcap=0.0, Tensor? sinks=None, int attention_chunk=0) -> Tensor")
_LIBRARY = torch.library.Library("fastgen", "DEF")
_LIBRARY.define("paged_attention" + _SCHEMA)
_LIBRARY.define("paged_attention_torch" + _SCHEMA)
_LIBRARY.define("paged_attention_triton" + _SCHEMA)
_LIBRARY.define("paged_attention_cpu" + _SCHEMA)
# `paged_attention` picks by device: Triton on CUDA, the torch path elsewhere.
_LIBRARY.impl("paged_attention", torch_paged_attention, "CompositeExplicitAutograd")
_LIBRARY.impl("paged_attention", triton_paged_attention, "CUDA")
_LIBRARY.impl("paged_attention_torch", torch_paged_attention, "CompositeExplicitAutograd")
# On the CPU only through `TRITON_INTERPRET=1`.
_LIBRARY.impl("paged_attention_triton", triton_paged_attention, "CompositeExplicitAutograd")
_LIBRARY.impl("paged_attention_cpu", cpu_paged_attention, "CompositeExplicitAutograd")

paged_attention = torch.ops.fastgen.paged_attention
"""`fastgen::paged_attention`: `torch_paged_attention`'s contract; CUDA tensors take the Triton kernel."""
paged_attention_torch = torch.ops.fastgen.paged_attention_torch
"""`fastgen::paged_attention_torch`: always `torch_paged_attention` (backend "torch")."""
paged_attention_triton = torch.ops.fastgen.paged_attention_triton
"""`fastgen::paged_attention_triton`: always the Triton kernel (backend "triton"); see `triton_paged_attention`."""
paged_attention_cpu = torch.ops.fastgen.paged_attention_cpu
"""`fastgen::paged_attention_cpu`: `cpu_paged_attention`, decode rows on the C++ CPU kernel (backend "cpu")."""


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    attn_metadata: "AttentionMetadata",
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk: int = 0,
) -> torch.Tensor:
    """What model code calls: paged attention of one layer through `attn_metadata.backend`."""
    md = attn_metadata
    torch_path = md.backend == "torch" or (md.backend == "auto" and query.device.type != "cuda")
    if (torch_path or md.backend == "cpu") and not torch.compiler.is_compiling():
        # Eager: straight to the implementation, which keeps what one layer works out from the metadata
        # for the step's other layers (a compiled graph calls the op, which works it out per layer). Named
        # as the op in profiles, so traces read the same either way; the name is only recorded while a
        # profiler runs (~10 us a layer otherwise).
        args = (query, key, value, kv_cache[0], kv_cache[1], md.slot_mapping, md.block_tables, md.seq_lens,
                md.query_start_loc, scale, sliding_window, softcap, sinks, attention_chunk, md.step_plans)
        impl, name = (torch_paged_attention, "paged_attention_torch") if torch_path else (cpu_paged_attention,
                                                                                          "paged_attention_cpu")
        if not torch.autograd._profiler_enabled():
            return impl(*args)
        with torch.profiler.record_function(f"fastgen::{name}"):
            return impl(*args)
    if attn_metadata.backend == "auto":
        op = paged_attention
    elif attn_metadata.backend == "torch":
        op = paged_attention_torch
    elif attn_metadata.backend == "triton":
        op = paged_attention_triton
    elif attn_metadata.backend == "cpu":
        op = paged_attention_cpu
    else:
        raise ValueError(f"unknown attention backend {attn_metadata.backend!r} (supported: auto, torch, triton, cpu)")
    return op(
        query, key, value, kv_cache[0], kv_cache[1], md.slot_mapping, md.block_tables, md.seq_lens,
        md.query_start_loc, scale, sliding_window, softcap, sinks, attention_chunk,
    )


def _fake(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
          sliding_window=0, softcap=0.0, sinks=None, attention_chunk=0):
    return torch.empty_like(query)


for _name in ("paged_attention", "paged_attention_torch", "paged_attention_triton", "paged_attention_cpu"):
    torch.library.register_fake(f"fastgen::{_name}", _fake, lib=_LIBRARY)

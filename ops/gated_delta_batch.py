"""Gated DeltaNet over the engine's flat ragged batch: one call per layer and step, each sequence on
its own slot of the layer's state pools.

A step lays out `S` sequence rows as paged attention sees them (`query_start_loc`, `seq_lens`) plus
`state_slots[S]`, the slot each sequence's recurrent state lives in. Per row, from the sizes alone:
- no queries, or seq_len 0: a padding row, skipped (its tokens' outputs are zeros);
- one query after earlier tokens (`seq_lens - queries > 0`): a decode row. All decode rows go
  through the batched one-step update together (`causal_conv1d_decode`,
  `recurrent_gated_delta_step`), reading and writing their slots in place;
- anything else is a prompt chunk: the chunked scan (`causal_conv1d_prefill`,
  `chunk_gated_delta_rule`) from the slot's state, or from zeros when the chunk starts the
  sequence (no tokens before it), so neither a fresh sequence nor one recomputed after preemption
  ever reads a stale slot. The state after its last token is written back.

On CUDA the decode rows take the Triton kernel (`fastgen.ops.triton_gated_delta`); prompt chunks
run the torch scan everywhere. Registered as the op `fastgen::gated_delta_net`, which a compiled decoder layer calls as one opaque
node (the per-row split reads the sizes on the host), the way paged attention is called.
"""

from __future__ import annotations

import torch

from fastgen.ops.gated_delta import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    recurrent_gated_delta_step,
)


def _split_heads(mixed: torch.Tensor, num_k_heads: int, k_head_dim: int, num_v_heads: int, v_head_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k `[rows, num_k_heads, k_head_dim]` and v `[rows, num_v_heads, v_head_dim]` of the conv's output."""
    key_dim = num_k_heads * k_head_dim
    q, k, v = mixed.split([key_dim, key_dim, num_v_heads * v_head_dim], dim=-1)
    rows = mixed.shape[0]
    return (q.reshape(rows, num_k_heads, k_head_dim), k.reshape(rows, num_k_heads, k_head_dim),
            v.reshape(rows, num_v_heads, v_head_dim))


def torch_gated_delta_net(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    num_k_heads: int,
    k_head_dim: int,
    num_v_heads: int,
    v_head_dim: int,
) -> torch.Tensor:
    """The token mixer of one Gated DeltaNet layer over a step (SiLU after the conv, q/k L2-normalised).

    mixed_qkv: `[T, conv_dim]` the q|k|v projection before the conv; g, beta: `[T, num_v_heads]`
    (`gating`); conv_weight: `[conv_dim, conv_kernel]`; conv_pool: `[num_slots, conv_dim,
    conv_kernel - 1]`; state_pool: `[num_slots, num_v_heads, k_head_dim, v_head_dim]` fp32. Returns
    `[T, num_v_heads, v_head_dim]` in mixed_qkv's dtype, zeros on padded tokens. The slots of the
    step's sequences are advanced in place.
    """
    if query_start_loc.dim() != 1 or seq_lens.shape != state_slots.shape or \
            query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"query_start_loc must be [S + 1] and seq_lens, state_slots [S], got "
                         f"{tuple(query_start_loc.shape)}, {tuple(seq_lens.shape)}, {tuple(state_slots.shape)}")
    starts, lens, slots = query_start_loc.tolist(), seq_lens.tolist(), state_slots.tolist()
    out = mixed_qkv.new_zeros(mixed_qkv.shape[0], num_v_heads, v_head_dim)
    heads = (num_k_heads, k_head_dim, num_v_heads, v_head_dim)
    decode_rows: list[int] = []
    decode_slots: list[int] = []
    for row, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        queries = end - start
        if queries == 0 or lens[row] == 0:  # padding (an all-padding step puts its tokens in a seq_len-0 row)
            continue
        slot = slots[row]
        if not 0 <= slot < state_pool.shape[0]:
            raise ValueError(f"sequence row {row} has state slot {slot}, outside the pool's {state_pool.shape[0]}")
        continued = lens[row] > queries
        if queries == 1 and continued:
            decode_rows.append(start)
            decode_slots.append(slot)
            continue
        conv_out, window = causal_conv1d_prefill(mixed_qkv[start:end], conv_pool[slot] if continued else None,
                                                 conv_weight)
        conv_pool[slot].copy_(window)
        q, k, v = _split_heads(conv_out, *heads)
        chunk_out, state = chunk_gated_delta_rule(q, k, v, g[start:end], beta[start:end],
                                                  state_pool[slot] if continued else None)
        state_pool[slot].copy_(state)
        out[start:end] = chunk_out
    if decode_rows:
        rows = torch.tensor(decode_rows, device=mixed_qkv.device)
        row_slots = torch.tensor(decode_slots, device=mixed_qkv.device)
        conv_out = causal_conv1d_decode(mixed_qkv.index_select(0, rows), conv_pool, row_slots, conv_weight)
        q, k, v = _split_heads(conv_out, *heads)
        step = recurrent_gated_delta_step
        if mixed_qkv.device.type == "cuda":
            from fastgen.ops.triton_gated_delta import triton_recurrent_gated_delta_step as step  # Triton on first use
        out[rows] = step(q, k, v, g.index_select(0, rows), beta.index_select(0, rows), state_pool, row_slots)
    return out


# Registered like `fastgen::paged_attention` (see there for why `torch.library.Library`).
_SCHEMA = ("(Tensor mixed_qkv, Tensor g, Tensor beta, Tensor conv_weight, Tensor(a!) conv_pool, "
           "Tensor(b!) state_pool, Tensor query_start_loc, Tensor seq_lens, Tensor state_slots, int num_k_heads, "
           "int k_head_dim, int num_v_heads, int v_head_dim) -> Tensor")
_LIBRARY = torch.library.Library("fastgen", "FRAGMENT")
_LIBRARY.define("gated_delta_net" + _SCHEMA)
_LIBRARY.impl("gated_delta_net", torch_gated_delta_net, "CompositeExplicitAutograd")


def _fake(mixed_qkv, g, beta, conv_weight, conv_pool, state_pool, query_start_loc, seq_lens, state_slots,
          num_k_heads, k_head_dim, num_v_heads, v_head_dim):
    return mixed_qkv.new_empty(mixed_qkv.shape[0], num_v_heads, v_head_dim)


torch.library.register_fake("fastgen::gated_delta_net", _fake, lib=_LIBRARY)

gated_delta_net = torch.ops.fastgen.gated_delta_net
"""`fastgen::gated_delta_net`: `torch_gated_delta_net`'s contract, as one op a compiled layer calls."""

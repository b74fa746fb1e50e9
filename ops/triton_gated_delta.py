"""Triton kernel of Gated DeltaNet's decode step: one token of the delta rule for each decode row, on
its sequence's state slot, in one launch.

The torch path (`fastgen.ops.gated_delta.recurrent_gated_delta_step`) gathers the rows' states,
runs several elementwise ops and two einsums over `[rows, heads, k_head_dim, v_head_dim]`
temporaries and scatters the states back: each op a kernel launch and a round trip of the states
through memory. Here one program per (row, value head) loads its state tile once, applies the
decay, the delta-rule write and the readout in registers, and stores the state and the output:
the state is read and written once, which is all a decode step of this layer has to move.

Import this module only when the kernel is about to launch (`fastgen.ops.gated_delta_batch` does):
`triton.jit` decides at decoration time whether it runs compiled or through the interpreter, so
`TRITON_INTERPRET=1` is honoured as long as it is set before then. The kernel calls only `tl`
builtins (see `fastgen.ops.triton_kernels` for why), hence the local combine function.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgen.ops.gated_delta import L2NORM_EPS


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def recurrent_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr,
    heads_per_k, k_head_dim, v_head_dim, scale, eps,
    stride_qr, stride_qh, stride_vr, stride_vh, stride_gr, stride_sr, stride_sh, stride_sk, stride_or, stride_oh,
    USE_L2NORM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
):
    """Program (row, value head): advance that head's state in the row's slot by one token, write the output."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    k_head = head // heads_per_k
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    mask_k = dk < k_head_dim
    mask_v = dv < v_head_dim
    q = tl.load(q_ptr + row * stride_qr + k_head * stride_qh + dk, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_qr + k_head * stride_qh + dk, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * stride_vr + head * stride_vh + dv, mask=mask_v, other=0.0).to(tl.float32)
    if USE_L2NORM:
        q = q / tl.sqrt(tl.reduce(q * q, 0, _add) + eps)
        k = k / tl.sqrt(tl.reduce(k * k, 0, _add) + eps)
    q = q * scale
    g = tl.load(g_ptr + row * stride_gr + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_gr + head).to(tl.float32)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    tile = state_ptr + slot * stride_sr + head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    tile_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(tile, mask=tile_mask, other=0.0) * tl.exp(g)
    predicted = tl.reduce(state * k[:, None], 0, _add)
    write = beta * (v - predicted)
    state = state + k[:, None] * write[None, :]
    tl.store(tile, state, mask=tile_mask)
    out = tl.reduce(state * q[:, None], 0, _add)
    tl.store(out_ptr + row * stride_or + head * stride_oh + dv, out, mask=mask_v)


def triton_recurrent_gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """`recurrent_gated_delta_step`'s contract (same shapes, the pool advanced in place), in one launch.

    The state pool must be fp32 and contiguous in its last two dimensions, as the engine allocates it.
    """
    rows, num_v_heads, v_head_dim = v.shape
    num_k_heads, k_head_dim = q.shape[1], q.shape[2]
    if state_pool.dtype != torch.float32 or state_pool.stride(-1) != 1 or state_pool.stride(-2) != v_head_dim:
        raise ValueError("the Triton decode step needs an fp32 state pool contiguous in its last two dimensions")
    if q.shape != k.shape or num_v_heads % num_k_heads:
        raise ValueError(f"q and k must be [rows, num_k_heads, k_head_dim] with num_v_heads ({num_v_heads}) a "
                         f"multiple of num_k_heads, got {tuple(q.shape)} and {tuple(k.shape)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(rows, num_v_heads, v_head_dim, dtype=torch.float32, device=v.device)
    if rows:
        recurrent_step_kernel[(rows, num_v_heads)](
            q, k, v, g, beta, state_pool, state_slots.contiguous(), out,
            num_v_heads // num_k_heads, k_head_dim, v_head_dim, k_head_dim ** -0.5, L2NORM_EPS,
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0),
            state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), out.stride(0), out.stride(1),
            USE_L2NORM=use_qk_l2norm, DK=triton.next_power_of_2(k_head_dim), DV=triton.next_power_of_2(v_head_dim))
    return out.to(v.dtype)

"""Gated DeltaNet's recurrence (the linear-attention layers of Qwen3.5 and Qwen3-Next), in torch.

A Gated DeltaNet layer keeps two fixed-size states per sequence instead of a growing KV cache:

- the causal conv window: the last `conv_kernel - 1` inputs of its depthwise conv1d, shape
  `[conv_dim, conv_kernel - 1]` per sequence, where `conv_dim = 2 * num_k_heads * k_head_dim +
  num_v_heads * v_head_dim` (q, k and v go through the conv together), in the model's dtype;
- the delta-rule state matrix per value head, shape `[num_v_heads, k_head_dim, v_head_dim]` per
  sequence, kept in fp32 (the recurrence multiplies it by a decay every token, so low-precision
  storage would compound its rounding).

A pool of them for `num_slots` sequences is `[num_slots, conv_dim, conv_kernel - 1]` and
`[num_slots, num_v_heads, k_head_dim, v_head_dim]` per layer (`conv_state_shape`,
`recurrent_state_shape`). HF's cache keeps `conv_kernel` columns; its oldest one never reaches an
output, so the window here is one shorter and equal to HF's last `conv_kernel - 1` columns.

The recurrence per value head, with q and k L2-normalised and q scaled by `k_head_dim ** -0.5`:
`S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T` and `o_t = S_t^T q_t`
(`S` is `[k_head_dim, v_head_dim]`). A prompt chunk runs it chunk by chunk in closed form (the
WY/UT form: one triangular solve per chunk turns its sequential updates into matmuls) from the
sequence's state and returns the state after its last token; a decode row applies it once. Each
query/key head serves `num_v_heads // num_k_heads` consecutive value heads, as in HF.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
"""The epsilon of the q/k L2 norm, as HF (and the FLA kernels it follows) add it under the root."""


def conv_state_shape(conv_dim: int, conv_kernel: int) -> tuple[int, int]:
    """One sequence's causal conv window of one layer: `(conv_dim, conv_kernel - 1)`."""
    if conv_kernel < 1:
        raise ValueError(f"conv_kernel must be at least 1, got {conv_kernel}")
    return (conv_dim, conv_kernel - 1)


def recurrent_state_shape(num_v_heads: int, k_head_dim: int, v_head_dim: int) -> tuple[int, int, int]:
    """One sequence's delta-rule state of one layer: `(num_v_heads, k_head_dim, v_head_dim)`, fp32."""
    return (num_v_heads, k_head_dim, v_head_dim)


def gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The log decay `g = -exp(A_log) * softplus(a + dt_bias)` and write strength `beta = sigmoid(b)`.

    `a` and `b` are the layer's `[tokens, num_v_heads]` projections; `g` is computed in fp32 (in
    fp16 `exp(A_log)` can overflow), `beta` keeps `b`'s dtype. Both as HF's layer derives them.
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q and k expanded to the value heads, normalised, q scaled: `[..., num_v_heads, k_head_dim]`."""
    num_k_heads = k.shape[-2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
    q, k = q.float(), k.float()
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [tokens, num_k_heads, k_head_dim], got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be [tokens, num_v_heads, v_head_dim] with q's tokens, got {tuple(v.shape)}")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"g and beta must be [tokens, num_v_heads] = {tuple(v.shape[:2])}, got "
                         f"{tuple(g.shape)} and {tuple(beta.shape)}")


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's prompt chunk, continuing from `initial_state`.

    q, k: `[tokens, num_k_heads, k_head_dim]`; v: `[tokens, num_v_heads, v_head_dim]`; g (log decay,
    <= 0) and beta: `[tokens, num_v_heads]`; initial_state: `[num_v_heads, k_head_dim, v_head_dim]`
    (zeros when None: the sequence's first chunk). Returns the output `[tokens, num_v_heads,
    v_head_dim]` in v's dtype and the fp32 state after the last token, so a prompt split over
    SplitFuse chunks gives the same outputs as the whole prompt at once. `chunk_size` is the scan's
    block (a trade of matmul size against the triangular solve), not the engine's chunk.
    """
    _check_shapes(q, k, v, g, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    tokens, num_v_heads, v_head_dim = v.shape
    k_head_dim, out_dtype = q.shape[-1], v.dtype
    if initial_state is None:
        state = v.new_zeros((num_v_heads, k_head_dim, v_head_dim), dtype=torch.float32)
    elif tuple(initial_state.shape) != (num_v_heads, k_head_dim, v_head_dim):
        raise ValueError(f"initial_state must be {(num_v_heads, k_head_dim, v_head_dim)}, got "
                         f"{tuple(initial_state.shape)}")
    else:
        state = initial_state.float()
    q, k = _prepare_qk(q, k, num_v_heads, use_qk_l2norm)
    # Heads lead from here on: every chunk is a batch of per-head matmuls.
    q, k = q.transpose(0, 1), k.transpose(0, 1)
    v = v.float().transpose(0, 1)
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    out = torch.empty_like(v)
    for start in range(0, tokens, chunk_size):
        end = min(start + chunk_size, tokens)
        n = end - start
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        bc = beta[:, start:end, None]
        log_decay = g[:, start:end].cumsum(dim=-1)  # log of the decay from the chunk's start through token i
        # decay[i, j]: the decay from token j (exclusive) to token i (inclusive); zero above the diagonal,
        # where the difference would be positive and could overflow before it is masked.
        causal = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        decay = (log_decay[:, :, None] - log_decay[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        # The writes u_i = beta_i (v_i - decayed state^T k_i) depend on the chunk's earlier writes through
        # (I + A) U = beta V - beta exp(log_decay) K S0 with A strictly lower triangular: one solve.
        system = (bc * kc) @ kc.transpose(-1, -2) * decay
        system = system.tril(-1) + torch.eye(n, dtype=system.dtype, device=system.device)
        rhs = torch.cat([bc * vc, bc * log_decay.exp()[..., None] * kc], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        writes = solved[..., :v_head_dim] - solved[..., v_head_dim:] @ state
        attn = qc @ kc.transpose(-1, -2) * decay
        out[:, start:end] = (log_decay.exp()[..., None] * qc) @ state + attn @ writes
        to_end = (log_decay[:, -1:] - log_decay).exp()[..., None]
        state = state * log_decay[:, -1].exp()[:, None, None] + (to_end * kc).transpose(-1, -2) @ writes
    return out.transpose(0, 1).to(out_dtype), state


def recurrent_gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One token of the gated delta rule for each decode row, each on its own sequence's state.

    q, k: `[rows, num_k_heads, k_head_dim]`; v: `[rows, num_v_heads, v_head_dim]`; g, beta: `[rows,
    num_v_heads]`; state_pool: `[num_slots, num_v_heads, k_head_dim, v_head_dim]`; state_slots:
    `[rows]` integer slot of each row, distinct (two rows on one slot would race). Reads each row's
    state from its slot, advances it one token and writes it back in place; returns the output
    `[rows, num_v_heads, v_head_dim]` in v's dtype.
    """
    _check_shapes(q, k, v, g, beta)
    rows, num_v_heads, v_head_dim = v.shape
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (num_v_heads, q.shape[-1], v_head_dim):
        raise ValueError(f"state_pool must be [num_slots, {num_v_heads}, {q.shape[-1]}, {v_head_dim}], got "
                         f"{tuple(state_pool.shape)}")
    if state_slots.shape != (rows,) or state_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_slots must be an integer tensor of shape ({rows},), got "
                         f"{state_slots.dtype} {tuple(state_slots.shape)}")
    slots = state_slots.long()
    q, k = _prepare_qk(q, k, num_v_heads, use_qk_l2norm)
    state = state_pool.index_select(0, slots).float() * g.float().exp()[..., None, None]
    predicted = torch.einsum("rhkv,rhk->rhv", state, k)
    write = beta.float()[..., None] * (v.float() - predicted)
    state = state + k[..., :, None] * write[..., None, :]
    state_pool.index_copy_(0, slots, state.to(state_pool.dtype))
    return torch.einsum("rhkv,rhk->rhv", state, q).to(v.dtype)


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported conv activation {activation!r}: Gated DeltaNet uses 'silu' (or None)")


def causal_conv1d_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal conv over one sequence's prompt chunk, continuing from its window.

    x: `[tokens, conv_dim]`; conv_state: `[conv_dim, conv_kernel - 1]`, the inputs before the chunk
    (zeros when None: the sequence's first chunk); weight: `[conv_dim, conv_kernel]` (an `nn.Conv1d`
    weight `[conv_dim, 1, conv_kernel]` squeezed). Returns the activated output `[tokens, conv_dim]`
    in x's dtype and the window after the chunk `[conv_dim, conv_kernel - 1]` in x's dtype.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [tokens, conv_dim] and weight [conv_dim, conv_kernel], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    window = conv_state_shape(x.shape[1], weight.shape[1])
    if conv_state is None:
        conv_state = x.new_zeros(window)
    elif tuple(conv_state.shape) != window:
        raise ValueError(f"conv_state must be {window}, got {tuple(conv_state.shape)}")
    seq = torch.cat([conv_state.to(x.dtype), x.transpose(0, 1)], dim=-1)  # [conv_dim, kernel - 1 + tokens]
    out = F.conv1d(seq.to(weight.dtype)[None], weight[:, None], bias, groups=x.shape[1])[0]
    new_state = seq[:, seq.shape[1] - window[1]:]
    return _activate(out, activation).transpose(0, 1).to(x.dtype), new_state.clone()


def causal_conv1d_decode(
    x: torch.Tensor,
    conv_state_pool: torch.Tensor,
    conv_slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token of the causal conv for each decode row, each on its own sequence's window.

    x: `[rows, conv_dim]`; conv_state_pool: `[num_slots, conv_dim, conv_kernel - 1]`; conv_slots:
    `[rows]` integer, distinct; weight: `[conv_dim, conv_kernel]`. Shifts each row's window by its
    token in place and returns the activated output `[rows, conv_dim]` in x's dtype.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [rows, conv_dim] and weight [conv_dim, conv_kernel], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    window = conv_state_shape(x.shape[1], weight.shape[1])
    if conv_state_pool.dim() != 3 or tuple(conv_state_pool.shape[1:]) != window:
        raise ValueError(f"conv_state_pool must be [num_slots, {window[0]}, {window[1]}], got "
                         f"{tuple(conv_state_pool.shape)}")
    if conv_slots.shape != (x.shape[0],) or conv_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"conv_slots must be an integer tensor of shape ({x.shape[0]},), got "
                         f"{conv_slots.dtype} {tuple(conv_slots.shape)}")
    slots = conv_slots.long()
    seq = torch.cat([conv_state_pool.index_select(0, slots).to(x.dtype), x[..., None]], dim=-1)
    out = (seq.to(weight.dtype) * weight).sum(dim=-1)
    if bias is not None:
        out = out + bias
    conv_state_pool.index_copy_(0, slots, seq[..., 1:].to(conv_state_pool.dtype))
    return _activate(out, activation).to(x.dtype)

"""Gated DeltaNet's recurrence (`fastgen.ops.gated_delta`) against HF's own torch path, in fp32.

The references are transformers' torch functions of Qwen3.5 and Qwen3-Next (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`, `causal_conv1d_update`). Inputs are random with
gates spread over a wide range, so state carried wrongly between chunks, slots or steps shows.
"""

import pytest
import torch

from fastgen.ops.gated_delta import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    conv_state_shape,
    gating,
    recurrent_gated_delta_step,
    recurrent_state_shape,
)

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
HF = [pytest.param(qwen3_5, id="qwen3_5"), pytest.param(qwen3_next, id="qwen3_next")]

ATOL = RTOL = 2e-5
# (num_k_heads, num_v_heads, k_head_dim, v_head_dim): equal heads, and grouped value heads as in Qwen3.5.
SHAPES = [(2, 2, 8, 8), (2, 4, 16, 8)]


def _inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hk, dk, generator=gen)
    k = torch.randn(tokens, hk, dk, generator=gen)
    v = torch.randn(tokens, hv, dv, generator=gen) * 2
    a = torch.randn(tokens, hv, generator=gen) * 2
    b = torch.randn(tokens, hv, generator=gen) * 2
    A_log = torch.rand(hv, generator=gen).mul(3).sub(2)  # decay rates exp(A_log) in (0.14, 2.7)
    dt_bias = torch.randn(hv, generator=gen)
    g, beta = gating(a, b, A_log, dt_bias)
    return q, k, v, g, beta


def _state(hv: int, dk: int, dv: int, seed: int) -> torch.Tensor:
    return torch.randn(recurrent_state_shape(hv, dk, dv), generator=torch.Generator().manual_seed(seed))


def _hf_chunk(hf, q, k, v, g, beta, state):
    """HF's chunked rule on one sequence (batch of one), our token-major layout in and out."""
    out, final = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def _close(ours, theirs):
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)


def test_gating_matches_hf_layer_formula():
    a, b = torch.randn(5, 4) * 3, torch.randn(5, 4)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    g, beta = gating(a, b, A_log, dt_bias)
    _close(g, -A_log.exp() * torch.nn.functional.softplus(a + dt_bias))
    _close(beta, torch.sigmoid(b))
    assert (g < 0).all()


@pytest.mark.parametrize("hf", HF)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_whole_sequence_matches_hf(hf, shape, with_state):
    hk, hv, dk, dv = shape
    q, k, v, g, beta = _inputs(45, hk, hv, dk, dv, seed=1)
    state = _state(hv, dk, dv, seed=2) if with_state else None
    ref_out, ref_state = _hf_chunk(hf, q, k, v, g, beta, state)
    assert ref_out.abs().max() > 0.1  # non-trivial outputs, so a dropped term shows
    for chunk_size in (64, 16, 7):  # one scan block, several with a ragged last, and HF's block size differing
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, chunk_size=chunk_size)
        _close(out, ref_out)
        _close(final, ref_state)


@pytest.mark.parametrize("hf", HF)
def test_chunked_prompt_carries_state(hf):
    hk, hv, dk, dv = SHAPES[1]
    q, k, v, g, beta = _inputs(70, hk, hv, dk, dv, seed=3)
    ref_out, ref_state = _hf_chunk(hf, q, k, v, g, beta, None)
    for cuts in ([1, 69], [16, 16, 16, 22], [5, 33, 2, 30], [64, 6]):
        state, outs, start = None, [], 0
        for n in cuts:
            sl = slice(start, start + n)
            out, state = chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], initial_state=state,
                                                chunk_size=16)
            outs.append(out)
            start += n
        _close(torch.cat(outs), ref_out)
        _close(state, ref_state)


@pytest.mark.parametrize("hf", HF)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_then_decode_steps(hf, shape):
    hk, hv, dk, dv = shape
    prompt, steps = 20, 6
    q, k, v, g, beta = _inputs(prompt + steps, hk, hv, dk, dv, seed=4)
    ref_out, ref_state = _hf_chunk(hf, q, k, v, g, beta, None)
    out, state = chunk_gated_delta_rule(q[:prompt], k[:prompt], v[:prompt], g[:prompt], beta[:prompt])
    pool = torch.zeros(3, *recurrent_state_shape(hv, dk, dv))
    pool[1] = state
    slot = torch.tensor([1])
    outs = [out]
    for t in range(prompt, prompt + steps):
        sl = slice(t, t + 1)
        outs.append(recurrent_gated_delta_step(q[sl], k[sl], v[sl], g[sl], beta[sl], pool, slot))
    _close(torch.cat(outs), ref_out)
    _close(pool[1], ref_state)
    assert (pool[0] == 0).all() and (pool[2] == 0).all()  # other slots untouched


@pytest.mark.parametrize("hf", HF)
def test_decode_step_matches_hf_recurrent(hf):
    hk, hv, dk, dv = SHAPES[1]
    q, k, v, g, beta = _inputs(4, hk, hv, dk, dv, seed=5)
    states = torch.stack([_state(hv, dk, dv, seed=10 + i) for i in range(4)])
    pool = states.clone()
    out = recurrent_gated_delta_step(q, k, v, g, beta, pool, torch.arange(4))
    # HF's batch of four sequences, one token each
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], initial_state=states.clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    _close(out, ref_out[:, 0])
    _close(pool, ref_state)


def test_mixed_slots_equal_each_row_alone():
    hk, hv, dk, dv = SHAPES[1]
    q, k, v, g, beta = _inputs(4, hk, hv, dk, dv, seed=6)
    pool = torch.stack([_state(hv, dk, dv, seed=20 + i) for i in range(7)])
    slots = torch.tensor([5, 0, 3, 6], dtype=torch.int32)
    batched = pool.clone()
    out = recurrent_gated_delta_step(q, k, v, g, beta, batched, slots)
    alone = pool.clone()
    for row, slot in enumerate(slots.tolist()):
        sl = slice(row, row + 1)
        row_out = recurrent_gated_delta_step(q[sl], k[sl], v[sl], g[sl], beta[sl], alone, torch.tensor([slot]))
        _close(out[row], row_out[0])
    _close(batched, alone)
    for untouched in (1, 2, 4):
        assert torch.equal(batched[untouched], pool[untouched])
    assert not torch.allclose(batched[5], pool[5])


def _conv_weights(conv_dim: int, kernel: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(conv_dim, kernel, generator=gen), torch.randn(conv_dim, generator=gen)


@pytest.mark.parametrize("hf", HF)
@pytest.mark.parametrize("bias", [False, True])
def test_conv_prefill_chunks_then_decode(hf, bias):
    conv_dim, kernel, tokens, steps = 12, 4, 23, 5
    weight, b = _conv_weights(conv_dim, kernel, seed=7)
    b = b if bias else None
    x = torch.randn(tokens + steps, conv_dim, generator=torch.Generator().manual_seed(8))
    ref = hf.causal_conv1d_fn(x.T[None], weight, b, activation="silu")[0].T
    assert ref.abs().max() > 0.1
    for cuts in ([tokens], [1, 2, 20], [3, 3, 17], [10, 13]):
        state, outs, start = None, [], 0
        for n in cuts:
            out, state = causal_conv1d_prefill(x[start:start + n], state, weight, b)
            outs.append(out)
            start += n
        assert state.shape == conv_state_shape(conv_dim, kernel)
        pool = torch.zeros(2, *conv_state_shape(conv_dim, kernel))
        pool[1] = state
        # HF's cache keeps `kernel` columns; its oldest never reaches an output
        hf_state = torch.cat([torch.zeros(1, conv_dim, 1), state[None].clone()], dim=-1)
        for t in range(tokens, tokens + steps):
            outs.append(causal_conv1d_decode(x[t:t + 1], pool, torch.tensor([1]), weight, b))
            hf_out = hf.causal_conv1d_update(x[t:t + 1, :, None], hf_state, weight, b, activation="silu")
            _close(outs[-1], hf_out[:, :, 0])
            _close(pool[1], hf_state[0, :, 1:])
        _close(torch.cat(outs), ref)
        assert (pool[0] == 0).all()


def test_conv_decode_mixed_slots():
    conv_dim, kernel = 6, 4
    weight, b = _conv_weights(conv_dim, kernel, seed=9)
    gen = torch.Generator().manual_seed(11)
    pool = torch.randn(5, *conv_state_shape(conv_dim, kernel), generator=gen)
    x = torch.randn(3, conv_dim, generator=gen)
    slots = torch.tensor([4, 1, 2])
    batched, alone = pool.clone(), pool.clone()
    out = causal_conv1d_decode(x, batched, slots, weight, b)
    for row, slot in enumerate(slots.tolist()):
        _close(out[row], causal_conv1d_decode(x[row:row + 1], alone, torch.tensor([slot]), weight, b)[0])
    _close(batched, alone)
    assert torch.equal(batched[0], pool[0]) and torch.equal(batched[3], pool[3])


def test_bad_inputs_are_refused():
    hk, hv, dk, dv = SHAPES[1]
    q, k, v, g, beta = _inputs(3, hk, hv, dk, dv, seed=12)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(hv, dv, dk + 1))
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        chunk_gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3])
    with pytest.raises(ValueError, match="state_slots"):
        recurrent_gated_delta_step(q, k, v, g, beta, torch.zeros(4, hv, dk, dv), torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_prefill(torch.zeros(3, 6), torch.zeros(6, 4), torch.zeros(6, 4))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_prefill(torch.zeros(3, 6), None, torch.zeros(6, 4), activation="gelu")


def test_flat_batch_op_equals_each_sequence_alone():
    """`fastgen::gated_delta_net` over one ragged step (a fresh prompt, a prompt's second chunk, two
    decode rows, an empty padding row and a seq_len-0 padding row) against the whole sequences run one
    by one through the conv and the chunked rule; slots nobody holds are left untouched."""
    from fastgen.ops.gated_delta_batch import gated_delta_net

    hk, hv, dk, dv, kernel = 2, 4, 8, 4, 4
    conv_dim = 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(conv_dim, kernel, generator=gen)
    # (tokens before this step, tokens this step) per sequence; sequence i lives in slot 4 - i.
    rows = [(0, 6), (5, 4), (9, 1), (1, 1)]
    total = [before + now for before, now in rows]
    xs = [torch.randn(n, conv_dim, generator=gen) for n in total]
    gs = [_inputs(n, hk, hv, dk, dv, seed=10 + i)[3:] for i, n in enumerate(total)]
    conv_pool = torch.full((5, conv_dim, kernel - 1), float("nan"))
    state_pool = torch.full((5, hv, dk, dv), float("nan"))

    def whole(i, end):
        out, window = causal_conv1d_prefill(xs[i][:end], None, weight)
        q, k, v = out.split([hk * dk, hk * dk, hv * dv], dim=-1)
        g, beta = gs[i]
        o, state = chunk_gated_delta_rule(q.reshape(end, hk, dk), k.reshape(end, hk, dk), v.reshape(end, hv, dv),
                                          g[:end], beta[:end])
        return o, window, state

    for i, (before, _) in enumerate(rows):  # what earlier steps left in each slot
        if before:
            _, conv_pool[4 - i], state_pool[4 - i] = whole(i, before)
    mixed = torch.cat([x[b:b + n] for x, (b, n) in zip(xs, rows)] + [torch.randn(3, conv_dim, generator=gen)])
    g = torch.cat([gi[0][b:b + n] for gi, (b, n) in zip(gs, rows)] + [torch.zeros(3, hv)])
    beta = torch.cat([gi[1][b:b + n] for gi, (b, n) in zip(gs, rows)] + [torch.zeros(3, hv)])
    starts = [0, 6, 10, 11, 12, 12, 15]  # then an empty row, then 3 tokens in a seq_len-0 row
    out = gated_delta_net(mixed, g, beta, weight, conv_pool, state_pool, torch.tensor(starts, dtype=torch.int32),
                          torch.tensor(total + [0, 0], dtype=torch.int32),
                          torch.tensor([4, 3, 2, 1, -1, -1], dtype=torch.int32), hk, dk, hv, dv)
    for i, (before, now) in enumerate(rows):
        expected, window, state = whole(i, before + now)
        _close(out[starts[i]:starts[i] + now], expected[before:])
        _close(conv_pool[4 - i], window)
        _close(state_pool[4 - i], state)
    assert out[12:].abs().sum() == 0 and conv_pool[0].isnan().all() and state_pool[0].isnan().all()

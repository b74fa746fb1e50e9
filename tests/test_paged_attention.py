"""`fastgen::paged_attention_torch` and `fastgen::paged_attention_triton` against the float64 oracle.

The oracle (`attention_oracle.py`) takes the op's own arguments and applies the contract in plain
Python loops: write each token's K/V to its slot, gather each sequence's keys position by position
through its block table, causal mask, sliding window, softcap, GQA, softmax in float64. Each test
builds real step inputs (shuffled blocks, block tables whose unused columns and padded rows point
at arbitrary blocks) over a KV cache that starts filled with NaN, so any read of a slot that was
never written, or a write to a wrong slot, shows up. The Triton kernel runs under the Triton
interpreter (`TRITON_INTERPRET=1`, set before any kernel is defined), on small shapes: it is slow.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are defined (lazily, on first launch)

from dataclasses import dataclass, field  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fastgen.ops  # noqa: E402  (registers the fastgen:: ops)
from fastgen.ops import allocate_kv_cache  # noqa: E402
from attention_oracle import paged_attention_oracle  # noqa: E402

OP = torch.ops.fastgen.paged_attention
"""The dispatching op: the torch path on the CPU."""
TORCH_OP = torch.ops.fastgen.paged_attention_torch
TRITON_OP = torch.ops.fastgen.paged_attention_triton


@dataclass
class _Seq:
    """A sequence's blocks and how many of its tokens are in the cache."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0


class _Harness:
    """A NaN-poisoned paged KV cache, shuffled block allocation, and op calls checked against the oracle."""

    def __init__(self, *, block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, window: int = 0, softcap: float = 0.0,
                 num_blocks: int = 64, seed: int = 0, shuffle: bool = True, layout: str = "head_major",
                 sinks: bool = False, chunk: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.block_size, self.head_dim = block_size, head_dim
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.dtype, self.window, self.softcap, self.chunk = dtype, window, softcap, chunk
        self.scale = head_dim**-0.5
        # The engine's layout (each block stored head-major), or plain contiguous: the ops take either.
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if layout == "head_major":
            self.k_cache, self.v_cache = (allocate_kv_cache(*shape, dtype, "cpu").fill_(float("nan")) for _ in "kv")
        else:
            self.k_cache, self.v_cache = (torch.full(shape, float("nan"), dtype=dtype) for _ in "kv")
        order = torch.randperm(num_blocks, generator=self.gen) if shuffle else torch.arange(num_blocks - 1, -1, -1)
        self.free = order.tolist()
        # Attention sinks: one logit per query head, of the scores' magnitude so they take a real share.
        self.sinks = 2 * torch.randn(num_q_heads, generator=self.gen) + 1 if sinks else None

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def step(self, chunks: list[tuple[_Seq, int]], pad_tokens: int = 0, pad_rows: int = 0, op=TORCH_OP) -> None:
        """Run one op call for `(seq, num_new)` chunks plus padding, and check outputs and cache."""
        args = self.step_args(chunks, pad_tokens, pad_rows)
        expected = paged_attention_oracle(*args)  # before the call writes the caches
        self.check(expected, args, op(*args), sum(n for _, n in chunks))

    def step_args(self, chunks: list[tuple[_Seq, int]], pad_tokens: int = 0, pad_rows: int = 0) -> tuple:
        """The op's arguments for `(seq, num_new)` chunks plus padding (the sequences grow by their chunks)."""
        num_real = sum(n for _, n in chunks)
        total = num_real + pad_tokens
        query = self._randn(total, self.num_q_heads, self.head_dim)
        key = self._randn(total, self.num_kv_heads, self.head_dim)
        value = self._randn(total, self.num_kv_heads, self.head_dim)
        slots, seq_lens, starts = [], [], [0]
        for seq, n in chunks:
            for pos in range(seq.length, seq.length + n):
                if pos // self.block_size == len(seq.blocks):
                    seq.blocks.append(self.free.pop())
                slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            seq.length += n
            seq_lens.append(seq.length)
            starts.append(starts[-1] + n)
        slots += [-1] * pad_tokens
        seq_lens += [0] * pad_rows
        starts += [num_real] * pad_rows
        max_blocks = max([len(seq.blocks) for seq, _ in chunks] + [1]) + 1
        # Unused columns and padded rows hold arbitrary (valid) block ids: the op must not read them.
        num_blocks = self.k_cache.shape[0]
        tables = torch.randint(0, num_blocks, (len(chunks) + pad_rows, max_blocks), generator=self.gen,
                               dtype=torch.int32)
        for row, (seq, _) in enumerate(chunks):
            tables[row, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        args = (query, key, value, self.k_cache, self.v_cache, torch.tensor(slots, dtype=torch.int64), tables,
                torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                self.scale, self.window, self.softcap, self.sinks, self.chunk)
        return args

    def check(self, expected: tuple, args: tuple, out: torch.Tensor, num_real: int) -> None:
        """`out` and the caches of `args` after the call against `expected`, the oracle's answer for `args`."""
        query, k_cache, v_cache = args[0], args[3], args[4]
        expected, expected_k, expected_v = expected
        assert out.shape == query.shape and out.dtype == self.dtype
        torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)
        assert torch.count_nonzero(out[num_real:]) == 0, "padded tokens must give zeros"
        tol = dict(rtol=2e-5, atol=2e-5) if self.dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(out.double(), expected, **tol)


def _run_batch(h: _Harness, kind: str, seed: int, pad_tokens: int = 0, pad_rows: int = 0, op=TORCH_OP) -> None:
    """Two op calls over a random batch of `kind` ("decode", "prefill" or "mixed"): the first writes
    the cached context (itself a prefill batch, checked like any other call), the second is the step."""
    rng = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=rng))

    span = 2 * h.block_size + 3  # guarantees sequences that cross block boundaries
    if kind == "decode":
        plan = [(rand(1, span), 1) for _ in range(rand(3, 6))] + [(span, 1)]
    elif kind == "prefill":
        plan = [(0, rand(1, span)) for _ in range(rand(2, 4))] + [(0, span), (0, 1)]
    else:  # decodes, chunked prefills with prior context, a block-aligned chunk, first chunks
        plan = [(rand(1, span), 1), (span, 1), (rand(1, span), rand(2, span)), (h.block_size, h.block_size),
                (0, rand(2, span)), (0, 1), (rand(1, span), 1)]
    seqs = [_Seq() for _ in plan]
    context = [(s, ctx) for s, (ctx, _) in zip(seqs, plan) if ctx > 0]
    if context:
        h.step(context, op=op)
    h.step([(s, new) for s, (_, new) in zip(seqs, plan)], pad_tokens=pad_tokens, pad_rows=pad_rows, op=op)


GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # (query heads, KV heads): MHA, GQA 2, GQA 4, MQA


# The torch op: the full sweep ---------------------------------------------------------------------


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_matches_oracle(kind, block_size, heads):
    h = _Harness(block_size=block_size, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                 seed=block_size + heads[0] + heads[1])
    _run_batch(h, kind, seed=100 * len(kind) + 10 * block_size + heads[0] + heads[1])


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_dims_and_dtypes(head_dim, dtype, layout):
    h = _Harness(block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype, seed=head_dim,
                 layout=layout)
    _run_batch(h, "mixed", seed=head_dim, pad_tokens=3, pad_rows=2)


@pytest.mark.parametrize("window", [1, 3, 5, 16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_sliding_window(window, block_size):
    h = _Harness(block_size=block_size, num_q_heads=4, num_kv_heads=2, head_dim=64, window=window, seed=window)
    _run_batch(h, "mixed", seed=window + block_size, pad_tokens=2, pad_rows=1)


@pytest.mark.parametrize("softcap", [1.0, 5.0])
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap(softcap, window, dtype):
    h = _Harness(block_size=4, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, window=window,
                 softcap=softcap, seed=int(softcap) + window)
    _run_batch(h, "mixed", seed=int(softcap * 10) + window, pad_tokens=1, pad_rows=1)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_sinks(kind, window):
    """Attention sinks (a logit per query head in the softmax's denominator only): prompt chunks, first
    chunks and many decode rows (merged block by block through their log-sum-exps)."""
    h = _Harness(block_size=4, num_q_heads=8, num_kv_heads=2, head_dim=32, window=window, sinks=True,
                 seed=len(kind) + window)
    _run_batch(h, kind, seed=3 * len(kind) + window, pad_tokens=2, pad_rows=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_sinks_few_decode_rows_softcap_and_dtypes(softcap, dtype):
    """Sinks on the rows attended one by one (up to three decode rows), with a softcap and in bf16."""
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=1, head_dim=32, dtype=dtype, softcap=softcap,
                 sinks=True, seed=17)
    seqs = [_Seq() for _ in range(3)]
    h.step([(s, n) for s, n in zip(seqs, [2, 9, 14])])
    for _ in range(3):
        h.step([(s, 1) for s in seqs], pad_tokens=1)
    h.step([(seqs[0], 1), (seqs[1], 6)])


@pytest.mark.parametrize("chunk, window", [(1, 0), (4, 0), (5, 0), (7, 3), (16, 0)])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_attention_chunk(kind, chunk, window):
    """Chunked local attention (Llama 4): a query sees only its own chunk of positions, which a chunk start
    resets (no sliding window equals it), for prompt chunks over earlier context, first chunks, and the
    decode rows both batched and attended one by one; with a window inside the chunks too."""
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32, window=window, chunk=chunk,
                 seed=chunk + len(kind))
    _run_batch(h, kind, seed=11 * chunk + len(kind), pad_tokens=2, pad_rows=1)


def test_attention_chunk_few_decode_rows_across_a_chunk_start():
    """Up to three decode rows, attended one by one, stepping over chunk starts one token at a time."""
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=1, head_dim=32, chunk=6, seed=23)
    seqs = [_Seq() for _ in range(2)]
    h.step([(seqs[0], 4), (seqs[1], 11)])
    for _ in range(4):
        h.step([(s, 1) for s in seqs], pad_tokens=1)
    h.step([(seqs[0], 5)])  # a prompt-like chunk that starts mid-chunk and crosses a chunk start


def _strided(t: torch.Tensor, how: str) -> torch.Tensor:
    """`t`'s values in a non-contiguous layout: every other element of a wider buffer ("gapped"), or
    token-minor as a transposed `[T, heads * dim]` matrix ("transposed", a permuted matmul's output)."""
    if how == "gapped":
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]
    else:
        wide = torch.empty(t.shape[1] * t.shape[2], t.shape[0], dtype=t.dtype).t().view(t.shape)
    return wide.copy_(t)


@pytest.mark.parametrize("how", ["gapped", "transposed"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_strided_inputs_equal_contiguous_ones(how, kind):
    # The CPU flash kernel ignores the last dimension's stride: the op must not hand it such a view.
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=7)
    rng = torch.Generator().manual_seed(3)
    lens = [int(torch.randint(1, 12, (), generator=rng)) for _ in range(5)]
    seqs = [_Seq() for _ in lens]
    h.step([(s, n) for s, n in zip(seqs, lens)])
    chunks = [(s, 1 if kind == "decode" or i % 2 else 5) for i, s in enumerate(seqs)]
    args = h.step_args(chunks)
    expected = paged_attention_oracle(*args)
    strided = tuple(_strided(t, how) for t in args[:3])
    assert all(not t.is_contiguous() for t in strided)
    h.check(expected, args, TORCH_OP(*strided, *args[3:]), sum(n for _, n in chunks))


def test_long_decode_chain_over_many_blocks():
    """Prefill in chunks, then decode token by token, the cache reused across calls."""
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=1, head_dim=64, window=7, seed=3)
    a, b = _Seq(), _Seq()
    h.step([(a, 5), (b, 2)])
    h.step([(a, 6), (b, 9)])
    for _ in range(6):
        h.step([(a, 1), (b, 1)], pad_tokens=2, pad_rows=2)


@pytest.mark.parametrize("window", [0, 5])
def test_decode_rows_share_prefix_blocks(window):
    """Rows whose block tables share the same full blocks (a prefix-cache hit), each attended block by
    block and merged; one context spans many blocks, one fits in its first."""
    h = _Harness(block_size=4, num_q_heads=6, num_kv_heads=2, head_dim=32, num_blocks=96, window=window, seed=9)
    a, lone = _Seq(), _Seq()
    h.step([(a, 13), (lone, 2)])
    forks = [_Seq(blocks=a.blocks[:3], length=12) for _ in range(3)]
    h.step([(f, n) for f, n in zip(forks, [1, 4, 7])])
    for _ in range(5):
        h.step([(a, 1), (lone, 1)] + [(f, 1) for f in forks], pad_tokens=1, pad_rows=1)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("contexts", [[5], [16], [5, 17], [1, 30, 9]], ids=["one_block", "full_block", "two",
                                                                            "three"])
def test_few_decode_rows_over_one_block_or_several(contexts, window):
    """Up to three decode rows are attended one by one: a row within one block reads that block where it
    lies (a view stopping at its last key: the NaN in the block's unwritten slots must not reach it), a
    longer row a copy of its blocks. Each step grows the rows by a token, across a block boundary too."""
    h = _Harness(block_size=16, num_q_heads=6, num_kv_heads=2, head_dim=32, window=window, seed=len(contexts))
    seqs = [_Seq() for _ in contexts]
    h.step([(s, n) for s, n in zip(seqs, contexts)])
    for _ in range(3):
        h.step([(s, 1) for s in seqs], pad_tokens=1)


@pytest.mark.parametrize("shuffle, num_blocks, stale", [(False, 48, "nan"), (False, 48, "finite"), (True, 400, "nan")],
                         ids=["in_order", "in_order_finite_stale", "scattered"])
def test_decode_blocks_read_in_place_and_from_copies(shuffle, num_blocks, stale, monkeypatch):
    """Blocks in a dense stretch of the cache are attended where they lie, masked to their valid slots.
    A last block whose unwritten slots hold NaN (as this harness's do) gives a non-finite result there
    and is redone over a copy, as is every block when they lie scattered over a large cache; with
    finite stale values everything is done in place. The answer is the oracle's in every case."""
    import fastgen.ops.decode_attention as module

    counts = {"in_place": 0, "copied": 0}
    in_place, copies = module._attend_in_place, module._attend_copies

    def count_in_place(stretch, *args):
        counts["in_place"] += stretch.src.numel()
        return in_place(stretch, *args)

    def count_copies(query, k_cache, v_cache, blocks, *rest):
        counts["copied"] += blocks.numel()
        return copies(query, k_cache, v_cache, blocks, *rest)

    monkeypatch.setattr(module, "_attend_in_place", count_in_place)
    monkeypatch.setattr(module, "_attend_copies", count_copies)
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32, num_blocks=num_blocks, seed=13,
                 shuffle=shuffle)
    if stale == "finite":  # an earlier owner's values, large enough to matter if a masked slot leaked
        h.k_cache.copy_(100 * h._randn(*h.k_cache.shape))
        h.v_cache.copy_(100 * h._randn(*h.v_cache.shape))
    seqs = [_Seq() for _ in range(6)]
    h.step([(s, n) for s, n in zip(seqs, [9, 14, 3, 21, 8, 12])])
    h.step([(seqs[3], 2)])  # a chunk over context whose blocks are consecutive: read as a view of the cache
    for _ in range(4):
        h.step([(s, 1) for s in seqs], pad_tokens=1, pad_rows=1)
    assert (counts["in_place"] > 0) == (not shuffle)
    assert (counts["copied"] > 0) == (stale == "nan")


@pytest.mark.parametrize("num_rows, planner", [(6, "plan_decode_rows"), (2, "_visible_spans")],
                         ids=["batched", "one_by_one"])
def test_layers_of_a_step_share_its_plans(num_rows, planner, monkeypatch):
    """Eager attention works a step's decode plan out once per setting and every layer reuses it: three
    layers over caches of their own (the second with a sliding window) through one metadata, each
    equal to the oracle, and two plans built (for many rows or for the few attended one by one)."""
    import fastgen.ops.decode_attention as module

    planned = []
    plan = getattr(module, planner)

    def count_plans(*args):
        planned.append(args[5])  # the sliding window
        return plan(*args)

    monkeypatch.setattr(module, planner, count_plans)
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32, num_blocks=64, seed=21)
    seqs = [_Seq() for _ in range(num_rows)]
    h.step([(s, n) for s, n in zip(seqs, [9, 14, 3, 21, 8, 12])])
    planned.clear()
    args = h.step_args([(s, 1) for s in seqs], pad_tokens=1, pad_rows=1)
    query, key, value, _, _, slots, tables, seq_lens, starts = args[:9]
    metadata = fastgen.ops.AttentionMetadata(slots, tables, seq_lens, starts)
    for layer, window in enumerate([0, 5, 0]):
        caches = (h.k_cache * (layer + 1), h.v_cache - layer)
        layer_args = (query, key, value, *caches, slots, tables, seq_lens, starts, h.scale, window, 0.0)
        expected = paged_attention_oracle(*layer_args)
        out = fastgen.ops.attention(query, key, value, caches, metadata, h.scale, window)
        h.check(expected, layer_args, out, len(seqs))
    assert planned == [0, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7])
def test_a_later_chunk_takes_the_steps_additive_mask_bit_for_bit(dtype, window):
    """A prompt chunk after earlier ones attends through an additive mask built once a step (kept in
    the step's plans for the other layers): bit for bit what SDPA gives with the bool mask."""
    from fastgen.ops.paged_attention import _attend_one

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, 32, generator=gen).to(dtype) for n, h in ((5, 4), (19, 2), (19, 2)))
    plans: dict = {}
    got = [_attend_one(q, k * layer, v, 0.17, window, 0.0, plans) for layer in (1, 2)]
    assert len(plans) == 1  # one mask for both layers
    q_pos, k_pos = torch.arange(14, 19)[:, None], torch.arange(19)[None, :]
    visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    for layer, out in zip((1, 2), got):
        expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], (k * layer).transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], attn_mask=visible[None, None],
                                                  scale=0.17, enable_gqa=True)[0].transpose(0, 1)
        assert torch.equal(out, expected)


# The Triton kernel, under the interpreter ---------------------------------------------------------

# (name, harness keywords, batch kind, pad tokens, pad rows): small shapes, the interpreter is slow.
TRITON_CASES = [
    ("mixed_gqa4_bs4", dict(block_size=4, num_q_heads=8, num_kv_heads=2, head_dim=32), "mixed", 3, 2),
    ("mixed_mqa_bs16", dict(block_size=16, num_q_heads=4, num_kv_heads=1, head_dim=32), "mixed", 2, 1),
    ("decode_mha", dict(block_size=4, num_q_heads=2, num_kv_heads=2, head_dim=32), "decode", 1, 1),
    ("head_dim_80", dict(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=80), "mixed", 0, 1),
    ("window_5", dict(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32, window=5), "mixed", 2, 1),
    ("softcap_window", dict(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32, window=6, softcap=5.0),
     "mixed", 1, 1),
    ("bf16", dict(block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16), "mixed", 2, 2),
    ("sinks_window", dict(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32, window=5, sinks=True),
     "mixed", 1, 1),
    ("attention_chunk_5", dict(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32, chunk=5), "mixed", 2, 1),
]


@pytest.mark.parametrize("harness_kw, kind, pad_tokens, pad_rows", [c[1:] for c in TRITON_CASES],
                         ids=[c[0] for c in TRITON_CASES])
def test_triton_kernel_matches_oracle(harness_kw, kind, pad_tokens, pad_rows):
    h = _Harness(**harness_kw, seed=len(kind) + pad_tokens)
    _run_batch(h, kind, seed=7 * pad_tokens + pad_rows, pad_tokens=pad_tokens, pad_rows=pad_rows, op=TRITON_OP)


# Both ops: padding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [TORCH_OP, TRITON_OP], ids=["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padded_entries_are_zero_and_write_nothing(dtype, op):
    """A decode bucket of 8 tokens / 8 rows holding 3 real decodes; the caches are checked slot by slot."""
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype, seed=11)
    seqs = [_Seq() for _ in range(3)]
    h.step([(s, n) for s, n in zip(seqs, [3, 4, 9])], pad_tokens=2, pad_rows=1, op=op)
    h.step([(s, 1) for s in seqs], pad_tokens=5, pad_rows=5, op=op)
    # Only the 3 + 4 + 9 + 3 slots ever written hold numbers; everything else is still poison.
    assert int((~h.k_cache.isnan()).all(-1).all(-1).sum()) == 19
    assert int((~h.v_cache.isnan()).all(-1).all(-1).sum()) == 19


@pytest.mark.parametrize("op", [TORCH_OP, TRITON_OP], ids=["torch", "triton"])
def test_all_padding_step(op):
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32, seed=5)
    h.step([], pad_tokens=4, pad_rows=2, op=op)
    assert h.k_cache.isnan().all() and h.v_cache.isnan().all()


# The oracle's own controls --------------------------------------------------------------------------


def _oracle_one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                         softcap: float = 0.0, sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """The oracle on one whole sequence (`[L, H, D]` each) held in a single block."""
    length, num_kv_heads, head_dim = k.shape
    cache = torch.full((1, length, num_kv_heads, head_dim), float("nan"), dtype=k.dtype)
    out, _, _ = paged_attention_oracle(q, k, v, cache, cache.clone(), torch.arange(length),
                                       torch.zeros(1, 1, dtype=torch.int32), torch.tensor([length]),
                                       torch.tensor([0, length]), head_dim**-0.5, window, softcap, sinks,
                                       chunk)
    return out


def test_oracle_equals_sdpa_and_its_rules_change_the_answer():
    """Controls: with no window or softcap the oracle is causal SDPA (float64, KV heads repeated over their
    query heads); a window and a softcap each change its answer, so the tests above would notice an op
    that ignored them; a window of 1 leaves each query only its own value."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 16, generator=gen, dtype=torch.float64) * 3
    k, v = (torch.randn(6, 2, 16, generator=gen, dtype=torch.float64) * 3 for _ in range(2))
    plain = _oracle_one_sequence(q, k, v)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, dim=1).transpose(0, 1),
                                          v.repeat_interleave(2, dim=1).transpose(0, 1), is_causal=True)
    torch.testing.assert_close(plain, sdpa.transpose(0, 1))
    assert not torch.allclose(plain, _oracle_one_sequence(q, k, v, window=3), atol=1e-3)
    assert not torch.allclose(plain, _oracle_one_sequence(q, k, v, softcap=1.0), atol=1e-3)
    torch.testing.assert_close(_oracle_one_sequence(q, k, v, window=1), v.repeat_interleave(2, dim=1))
    # Chunks of 3: the first chunk's queries are plain causal, the second's restart (position 3 sees only
    # itself), which no sliding window gives.
    chunked = _oracle_one_sequence(q, k, v, chunk=3)
    torch.testing.assert_close(chunked[:3], plain[:3])
    torch.testing.assert_close(chunked[3], v[3].repeat_interleave(2, dim=0))
    assert all(not torch.allclose(chunked, _oracle_one_sequence(q, k, v, window=w), atol=1e-3) for w in range(1, 7))
    # A sink shrinks each output by the sink's share of the denominator: exp(sink) / (exp(sink) + sum)
    # is 1/2 for the first position (one key, of score q.k) when sink = its score.
    sinks = torch.tensor([0.5, -1.0, 2.0, 100.0], dtype=torch.float64)
    with_sinks = _oracle_one_sequence(q, k, v, sinks=sinks)
    assert not torch.allclose(plain, with_sinks, atol=1e-3)
    assert with_sinks[:, 3].abs().max() < 1e-6  # a huge sink takes (nearly) everything
    first = (q[0] * k[0].repeat_interleave(2, dim=0)).sum(-1) * 16**-0.5
    torch.testing.assert_close(_oracle_one_sequence(q[:1], k[:1], v[:1], sinks=first)[0],
                               v[0].repeat_interleave(2, dim=0) / 2)


# Registration -----------------------------------------------------------------------------------------


def test_registered_as_torch_ops():
    for op in (OP, TORCH_OP, TRITON_OP):
        assert isinstance(op, torch._ops.OpOverloadPacket)
        schema = op.default._schema
        writes = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert writes == {"k_cache", "v_cache"}
    # On the CPU the dispatching op is the torch path, bit for bit.
    h1 = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=1)
    h2 = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=1)
    s1, s2 = _Seq(), _Seq()
    h1.step([(s1, 6)], op=OP)
    h2.step([(s2, 6)], op=TORCH_OP)
    torch.testing.assert_close(h1.k_cache, h2.k_cache, rtol=0, atol=0, equal_nan=True)


def _opcheck_args():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16)
    return (torch.randn(7, 4, 16, generator=gen), torch.randn(7, 2, 16, generator=gen),
            torch.randn(7, 2, 16, generator=gen), k_cache, v_cache,
            torch.tensor([8, 9, 10, 20, 21, 22, -1]), torch.tensor([[2, 7], [5, 7], [0, 0]], dtype=torch.int32),
            torch.tensor([3, 3, 0], dtype=torch.int32), torch.tensor([0, 3, 6, 6], dtype=torch.int32), 0.25, 0, 0.0)


def test_opcheck():
    """torch.library's own checks: schema vs real mutation, fake impl, autograd registration, AOT dispatch."""
    result = torch.library.opcheck(OP.default, _opcheck_args())
    assert set(result.values()) == {"SUCCESS"}, result


def test_under_torch_compile_fullgraph():
    def step(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
        out = OP(query * 0.5, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                 0.25, 2, 0.0)
        return out * 2.0 + 1.0

    args = _opcheck_args()[:9]
    eager_k, eager_v = args[3].clone(), args[4].clone()
    expected = step(*args[:3], eager_k, eager_v, *args[5:])
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    got = compiled(*args)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(args[3], eager_k, rtol=0, atol=0)
    torch.testing.assert_close(args[4], eager_v, rtol=0, atol=0)
    assert torch.count_nonzero(args[3]) > 0, "the compiled call must write the cache in place"

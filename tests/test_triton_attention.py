"""The Triton paged-attention and KV-write kernels against the float64 oracle and the torch path.

Each case is one random ragged batch (cached context + new query tokens per sequence, shuffled
blocks). The KV cache starts NaN outside the cached context and the output buffer starts NaN:
every valid output element must be written and match the oracle, padded rows must stay
untouched, and a read of any slot that was never written would show up as NaN.

On the CPU the kernels run through the Triton interpreter. With `FASTGEN_TRITON_DEVICE=cuda`
(scripts/device_check.sh, on a GPU machine) the kernel cases run compiled, on the GPU, and the
tests that only make sense in the interpreter are skipped.
"""

import os

DEVICE = os.environ.get("FASTGEN_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined (they are, lazily, on first use)

import runpy  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import fastgen  # noqa: E402
from fastgen.models.loader import load_model  # noqa: E402
from fastgen.ops import AttentionMetadata, attention, torch_paged_attention, write_kv_cache  # noqa: E402
from fastgen.ops import triton_attention as ta  # noqa: E402
from attention_oracle import paged_attention_oracle  # noqa: E402
from kit import PagedRunner  # noqa: E402

interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="runs CPU tensors through the Triton interpreter")

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}


@dataclass
class Batch:
    """Inputs of one attention call and which query rows belong to a sequence."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    valid: torch.Tensor

    def args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        return (self.query, self.key, self.value, k_cache, v_cache, self.slot_mapping, self.block_tables,
                self.seq_lens, self.query_start_loc)


def make_batch(seqs: list[tuple[int, int]], *, block_size: int, num_q_heads: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype = torch.float32, pad_tokens: int = 0, seed: int = 0,
               num_blocks: int = 64) -> Batch:
    """`seqs` holds `(context_len, query_len)` per sequence; `(0, 0)` is a padded sequence row."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    num_tokens = sum(q for _, q in seqs) + pad_tokens
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(1, max(-(-(c + q) // block_size) for c, q in seqs))
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    slots, starts, valid = [], [0], torch.zeros(num_tokens, dtype=torch.bool)
    for s, (context, query_len) in enumerate(seqs):
        blocks = [free.pop() for _ in range(-(-(context + query_len) // block_size))]
        block_tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(context):
            k_cache[blocks[pos // block_size], pos % block_size] = randn(num_kv_heads, head_dim)
            v_cache[blocks[pos // block_size], pos % block_size] = randn(num_kv_heads, head_dim)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(context, context + query_len)]
        valid[starts[-1] : starts[-1] + query_len] = True
        starts.append(starts[-1] + query_len)
    return Batch(
        query=randn(num_tokens, num_q_heads, head_dim), key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim), k_cache=k_cache, v_cache=v_cache,
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64), block_tables=block_tables,
        seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), valid=valid,
    )


def check_against_reference(batch: Batch, *, sliding_window: int = 0, softcap: float = 0.0,
                            num_kv_splits: int | None = None, sinks: bool = False, attention_chunk: int = 0) -> None:
    """Run the kernel (on `DEVICE`) on copies of the cache; compare its output and caches with the
    float64 oracle's, and its output with the torch path's. `sinks`: with a random sink logit per
    query head, large enough to take a good share of the softmax."""
    scale = batch.query.shape[-1] ** -0.5
    sink_logits = None
    if sinks:
        sink_logits = 2 * torch.randn(batch.query.shape[1], generator=torch.Generator().manual_seed(5)) + 1
    expected, ref_k, ref_v = paged_attention_oracle(*batch.args(batch.k_cache, batch.v_cache), scale,
                                                    sliding_window, softcap, sink_logits, attention_chunk)
    torch_out = torch_paged_attention(*batch.args(batch.k_cache.clone(), batch.v_cache.clone()), scale,
                                      sliding_window, softcap, sink_logits, attention_chunk)
    args = [t.to(DEVICE) for t in batch.args(batch.k_cache.clone(), batch.v_cache.clone())]
    k_cache, v_cache = args[3], args[4]
    out = torch.full_like(args[0], float("nan"))
    device_sinks = None if sink_logits is None else sink_logits.to(DEVICE)
    ta.triton_paged_attention(*args, scale, sliding_window, softcap, device_sinks, attention_chunk, out=out,
                              num_kv_splits=num_kv_splits)
    out, k_cache, v_cache = out.cpu(), k_cache.cpu(), v_cache.cpu()
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(out[~batch.valid]).all(), "the kernel wrote rows of padded tokens"
    assert not torch.isnan(out[batch.valid]).any(), "the kernel left valid output elements unwritten"
    tol = TOL[batch.query.dtype]
    torch.testing.assert_close(out[batch.valid].double(), expected[batch.valid], rtol=tol, atol=tol)
    torch.testing.assert_close(out[batch.valid], torch_out[batch.valid], rtol=tol, atol=tol)


# (name, sequences, make_batch keywords, check keywords): one random ragged batch per case.
CASES = [
    ("decode_only", [(5, 1), (16, 1), (31, 1), (47, 1), (70, 1)],
     dict(block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64), {}),
    ("prefill_only", [(0, 1), (0, 9), (0, 33), (0, 20)],
     dict(block_size=32, num_q_heads=2, num_kv_heads=2, head_dim=128), {}),
    ("mixed_gqa8", [(40, 1), (0, 17), (30, 12), (5, 1), (64, 3)],
     dict(block_size=16, num_q_heads=8, num_kv_heads=1, head_dim=80), {}),
    ("sliding_window", [(40, 1), (0, 21), (13, 9), (70, 1)],
     dict(block_size=16, num_q_heads=4, num_kv_heads=1, head_dim=96), dict(sliding_window=7)),
    ("head_dim_256_fp16", [(20, 1), (7, 10), (33, 1)],
     dict(block_size=32, num_q_heads=4, num_kv_heads=2, head_dim=256, dtype=torch.float16), {}),
    ("fp16_window", [(50, 1), (3, 14), (17, 1)],
     dict(block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16), dict(sliding_window=16)),
    ("bf16", [(9, 1), (0, 12), (40, 5)],
     dict(block_size=16, num_q_heads=4, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16), {}),
    ("padded_entries", [(20, 1), (0, 0), (15, 6), (33, 0), (0, 0)],
     dict(block_size=16, num_q_heads=4, num_kv_heads=1, head_dim=64, pad_tokens=5), {}),
    ("gqa_group_3", [(17, 1), (0, 11), (29, 4)],
     dict(block_size=16, num_q_heads=6, num_kv_heads=2, head_dim=64), {}),
    ("softcap", [(25, 1), (0, 13), (8, 6)],
     dict(block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64), dict(softcap=5.0)),
    ("split_kv_decode", [(200, 1), (90, 1), (3, 1), (0, 0)],
     dict(block_size=32, num_q_heads=8, num_kv_heads=2, head_dim=64), dict(num_kv_splits=4)),
    ("split_kv_mixed_window", [(150, 1), (20, 19), (60, 2)],
     dict(block_size=16, num_q_heads=8, num_kv_heads=1, head_dim=64, pad_tokens=2),
     dict(num_kv_splits=3, sliding_window=40)),
    # Attention sinks (gpt-oss): normalised in the attention kernel, and in the split-KV reduce.
    ("sinks_mixed_window", [(40, 1), (0, 21), (13, 9), (70, 1)],
     dict(block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, pad_tokens=1),
     dict(sliding_window=7, sinks=True)),
    ("sinks_split_kv", [(150, 1), (20, 19), (60, 2), (0, 0)],
     dict(block_size=16, num_q_heads=4, num_kv_heads=1, head_dim=64), dict(num_kv_splits=3, sinks=True)),
    ("sinks_bf16", [(9, 1), (0, 12), (40, 5)],
     dict(block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16), dict(sinks=True)),
    # Chunked local attention (Llama 4): query blocks that straddle chunk starts, and over KV splits.
    ("attention_chunk_mixed", [(40, 1), (0, 21), (13, 9), (70, 1), (11, 30)],
     dict(block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, pad_tokens=1), dict(attention_chunk=12)),
    ("attention_chunk_split_kv", [(150, 1), (20, 19), (60, 2), (0, 0)],
     dict(block_size=16, num_q_heads=4, num_kv_heads=1, head_dim=64), dict(num_kv_splits=3, attention_chunk=48)),
]


@pytest.mark.parametrize("seqs,batch_kw,check_kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_matches_oracle(seqs, batch_kw, check_kw):
    check_against_reference(make_batch(seqs, **batch_kw), **check_kw)


@interpreter_only
def test_kv_write_skips_padding_slots():
    batch = make_batch([(3, 5), (0, 0), (10, 2)], block_size=16, num_q_heads=2, num_kv_heads=2, head_dim=80,
                       dtype=torch.float16, pad_tokens=3)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_cache(batch.key, batch.value, ref_k, ref_v, batch.slot_mapping)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    ta.triton_write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping)
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(k_cache).sum() == torch.isnan(batch.k_cache).sum() - 7 * 2 * 80
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        ta.triton_write_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.slot_mapping[:-1])
    with pytest.raises(ValueError, match="key/value must be"):
        ta.triton_write_kv_cache(batch.key[:, :1], batch.value[:, :1], k_cache, v_cache, batch.slot_mapping)


def test_prefix_hit_reads_blocks_filled_in_the_same_step():
    """Sequence 1 shares sequence 0's first block, which sequence 0 fills in this very step."""
    batch = make_batch([(0, 20), (0, 3)], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64)
    shared = int(batch.block_tables[0, 0])
    own = int(batch.block_tables[1, 0])
    batch.block_tables = torch.tensor([[shared, int(batch.block_tables[0, 1])], [shared, own]], dtype=torch.int32)
    batch.seq_lens = torch.tensor([20, 19], dtype=torch.int32)  # tokens 0..15 come from the shared block
    batch.slot_mapping[20:] = torch.tensor([own * 16 + p for p in range(3)])
    check_against_reference(batch)


@interpreter_only
def test_op_zeroes_padded_rows_and_matches_torch_op():
    batch = make_batch([(12, 3), (0, 0)], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64, pad_tokens=4)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    expected = torch.ops.fastgen.paged_attention_torch(*batch.args(ref_k, ref_v), 0.125)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    got = torch.ops.fastgen.paged_attention_triton(*batch.args(k_cache, v_cache), 0.125)
    assert (got[~batch.valid] == 0).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)


@interpreter_only
def test_compiles_fullgraph_around_the_triton_op():
    batch = make_batch([(9, 1), (0, 6)], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64)
    md = AttentionMetadata(batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                           backend="triton")

    def layer(q, k, v, caches):
        return attention(q * 2.0, k, v, caches, md, 0.125).sum(-1)

    eager = layer(batch.query, batch.key, batch.value, (batch.k_cache.clone(), batch.v_cache.clone()))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(batch.query, batch.key, batch.value, (batch.k_cache.clone(), batch.v_cache.clone()))
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


def _bad(batch: Batch, **changes) -> tuple:
    fields = dict(zip(("query", "key", "value", "k_cache", "v_cache", "slot_mapping", "block_tables", "seq_lens",
                       "query_start_loc"), batch.args(batch.k_cache, batch.v_cache)))
    fields.update(changes)
    return tuple(fields.values())


@interpreter_only
def test_bad_metadata_raises_before_launch():
    batch = make_batch([(20, 1), (0, 5)], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64)
    cases = [
        (ValueError, "query_start_loc", dict(query_start_loc=batch.query_start_loc[:-1])),
        (ValueError, "key/value", dict(key=batch.key[:-1])),
        (ValueError, "slot_mapping", dict(slot_mapping=batch.slot_mapping[1:])),
        (ValueError, "block_tables", dict(block_tables=batch.block_tables[:, :1])),
        (ValueError, "block_tables", dict(block_tables=batch.block_tables[:1])),
        (ValueError, "cover its", dict(seq_lens=torch.tensor([21, 3], dtype=torch.int32))),
        (ValueError, "head_dim 72", dict(query=torch.zeros(6, 4, 72), key=torch.zeros(6, 2, 72),
                                         value=torch.zeros(6, 2, 72), k_cache=torch.zeros(64, 16, 2, 72),
                                         v_cache=torch.zeros(64, 16, 2, 72))),
        (ValueError, "multiple of num_kv_heads", dict(query=torch.zeros(6, 3, 64))),
        (TypeError, "KV cache dtype", dict(k_cache=batch.k_cache.half(), v_cache=batch.v_cache.half())),
        (TypeError, "seq_lens", dict(seq_lens=batch.seq_lens.float())),
        (ValueError, "slot_mapping values", dict(slot_mapping=batch.slot_mapping + 10_000)),
    ]
    for error, match, changes in cases:
        k_before = batch.k_cache.clone()
        with pytest.raises(error, match=match):
            ta.triton_paged_attention(*_bad(batch, **changes), 0.125)
        torch.testing.assert_close(batch.k_cache, k_before, rtol=0, atol=0, equal_nan=True)


@interpreter_only
def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch, tiny_checkpoints):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = make_batch([(4, 2)], block_size=16, num_q_heads=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ta.triton_paged_attention(*batch.args(batch.k_cache, batch.v_cache), 0.125)
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        fastgen.pipeline(tiny_checkpoints["llama"], attention_backend="triton", num_kv_blocks=8, progress=False)
    with pytest.raises(ValueError, match="attention_backend"):
        fastgen.pipeline(tiny_checkpoints["llama"], attention_backend="cuda", progress=False)


def test_split_rule_depends_on_shapes_only():
    assert ta.choose_num_kv_splits(num_programs=512, max_context_len=32768, num_sms=132) == 1
    assert ta.choose_num_kv_splits(num_programs=8, max_context_len=32768, num_sms=132) == ta.MAX_SPLITS
    assert ta.choose_num_kv_splits(num_programs=8, max_context_len=256, num_sms=132) == 2
    assert ta.choose_num_kv_splits(num_programs=8, max_context_len=64, num_sms=132) == 1
    assert ta.choose_num_kv_splits(num_programs=100, max_context_len=32768, num_sms=132) == 4
    assert ta.tile_shape(num_tokens=8, num_seqs=8, group=4, head_dim=128) == (16, 4, 4)
    assert ta.tile_shape(num_tokens=512, num_seqs=4, group=1, head_dim=128) == (64, 64, 8)
    assert ta.tile_shape(num_tokens=512, num_seqs=4, group=4, head_dim=256) == (32, 8, 8)
    assert ta.tile_shape(num_tokens=8, num_seqs=8, group=32, head_dim=80) == (32, 1, 4)
    assert [ta.supports_head_dim(d) for d in (64, 80, 96, 128, 256, 72, 8, 512)] == [True] * 5 + [False] * 3


@interpreter_only
@pytest.mark.parametrize("model_type", ["llama", "mistral", "llama4_text"])
def test_model_greedy_tokens_match_torch_op(model_type, tiny_checkpoints):
    """A whole tiny model through the Triton op: same greedy tokens and logits as the torch op."""
    model = load_model(tiny_checkpoints[model_type], progress=False).model
    prompts = [[5, 9, 44, 7], list(range(30, 49)), [100 + 3 * i for i in range(11)]]
    outputs = {}
    for backend in ("torch", "triton"):
        runner = PagedRunner(model, num_blocks=32, block_size=8, backend=backend)
        seqs = [runner.add(p) for p in prompts]
        logits = runner.step([(s, len(s.token_ids)) for s in seqs])
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        steps = [logits[last]]
        for _ in range(5):
            for seq, row in zip(seqs, steps[-1]):
                seq.token_ids.append(int(row.argmax()))
            steps.append(runner.step([(s, 1) for s in seqs]))
        outputs[backend] = ([s.token_ids for s in seqs], torch.stack(steps))
    assert outputs["triton"][0] == outputs["torch"][0]
    assert len({t for ids in outputs["torch"][0] for t in ids[-6:]}) > 3, "greedy outputs are flat: a weak test"
    torch.testing.assert_close(outputs["triton"][1], outputs["torch"][1], rtol=1e-4, atol=1e-4)


@interpreter_only
def test_pipeline_with_triton_backend_matches_torch(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    small = dict(num_kv_blocks=16, block_size=8, token_budget=16, max_seqs=4, progress=False)
    texts = ["The quick brown fox", "def f(x): return x"]
    results = {}
    for backend in ("torch", "triton"):
        with fastgen.pipeline(path, attention_backend=backend, **small) as pipe:
            assert pipe.engine.runner.attention_backend == backend
            results[backend] = [r.token_ids for r in pipe(texts, max_new_tokens=4, do_sample=False)]
    assert results["triton"] == results["torch"]


@interpreter_only
def test_interpreter_works_when_triton_was_imported_first():
    """torch._dynamo imports triton, so in a test session triton's own jit functions may predate
    TRITON_INTERPRET=1; the kernels must still run (they avoid `triton.language.standard`)."""
    script = textwrap.dedent("""
        import os, torch, torch._dynamo, sys
        assert "triton" in sys.modules
        os.environ["TRITON_INTERPRET"] = "1"
        from fastgen.ops import torch_paged_attention, triton_paged_attention
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(5, h, 64, generator=gen) for h in (4, 2, 2))
        caches = [torch.randn(4, 16, 2, 64, generator=gen) for _ in range(2)]
        meta = (torch.tensor([3, 4, 5, 6, 40]), torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
                torch.tensor([7, 20], dtype=torch.int32), torch.tensor([0, 4, 5], dtype=torch.int32))
        ref = torch_paged_attention(q, k, v, *[c.clone() for c in caches], *meta, 0.125)
        got = triton_paged_attention(q, k, v, *caches, *meta, 0.125, num_kv_splits=2)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@interpreter_only
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts code the compiler rejects (e.g. non-constexpr globals): compile each
    kernel to a cubin for sm_90 with Triton's bundled toolchain, in a process without the interpreter."""
    pytest.importorskip("triton.backends.nvidia")
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from fastgen.ops import triton_kernels as K

        def compile_kernel(fn, pointers, constexprs):
            sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
            sig.update({n: "fp32" for n in ("scale", "softcap") if n in sig})
            kernel = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32))
            assert kernel.asm["cubin"]

        meta = {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
        data = {n: "*bf16" for n in ("out_ptr", "query_ptr", "k_cache_ptr", "v_cache_ptr", "key_ptr", "value_ptr")}
        parts = {n: "*fp32" for n in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr", "sinks_ptr")}
        tile = dict(HEAD_DIM_PAD=128, GROUP=4, BLOCK_M=16, BLOCK_Q=4)
        compile_kernel(K.paged_attention_kernel, {**meta, **data, **parts},
                       dict(tile, TILE_N=32, NUM_SPLITS=2, USE_WINDOW=True, USE_CHUNK=True, USE_SOFTCAP=True,
                            USE_SINKS=True, UPCAST=False, IEEE_DOT=False))
        compile_kernel(K.reduce_splits_kernel, {**meta, **data, **parts}, dict(tile, NUM_SPLITS=2, USE_SINKS=True))
        compile_kernel(K.kv_write_kernel, {**data, "slot_mapping_ptr": "*i64"},
                       dict(BLOCK_T=8, HEADS_PAD=8, HEAD_DIM_PAD=128))
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the full benchmark")
def test_bench_script_exits_cleanly_without_gpu(capsys):
    path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_attention.py")
    assert runpy.run_path(path, run_name="bench_attention")["main"]([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out

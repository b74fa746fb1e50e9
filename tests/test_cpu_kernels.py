"""fastgen's C++ CPU kernels: paged decode attention against the float64 oracle, the ISA variants, the build
cache, the fallback where nothing can be built, the op under torch.compile, and the plan that picks it.

Every oracle test runs `fastgen::paged_attention_cpu` through the paged-attention harness (NaN-filled cache,
shuffled blocks, block tables whose unused columns point at arbitrary blocks), with the torch path's decode
rows disabled: a decode row the kernel did not attend fails the test instead of passing on the torch path.
The kernel is built once per ISA variant into the user's fastgen cache and reused by later sessions.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fastgen

from fastgen.ops import write_kv_cache
from fastgen.ops.cpu_kernels import (ENV_VAR, build_dir, cpu_kernel_isa, kernel_op, pick_isa, requested_isa,
                                     supported_isas)
from fastgen.planning.hardware import Hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.policy import make_plan
from attention_oracle import paged_attention_oracle
from kit import build_checkpoint
from test_paged_attention import _Harness, _run_batch, _Seq  # the harness every paged-attention op is checked by

CPU_OP = torch.ops.fastgen.paged_attention_cpu
TORCH_OP = torch.ops.fastgen.paged_attention_torch
# The module, not the op `fastgen.ops` exports under the same name.
paged_attention_module = importlib.import_module("fastgen.ops.paged_attention")
decode_module = importlib.import_module("fastgen.ops.cpu_kernels.decode")
GIB = 1 << 30


@pytest.fixture(scope="module")
def kernel_isa() -> str:
    """The variant this machine runs, built (or found in the cache); the module is skipped where none can be."""
    isa = pick_isa(supported_isas(), "auto")
    if isa is None:
        pytest.skip("this CPU has no AVX2: no C++ CPU kernel variant runs here")
    if kernel_op("paged_decode", isa) is None:
        pytest.skip("the C++ CPU kernels could not be built here (see the log line)")
    return isa


@pytest.fixture
def kernel_only(kernel_isa, monkeypatch) -> str:
    """The op's decode rows on the kernel alone: the torch path's decode attention raises if reached."""
    monkeypatch.delenv(ENV_VAR, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("a decode row reached the torch path")

    monkeypatch.setattr(paged_attention_module, "attend_decode_rows", refuse)
    return kernel_isa


def _decode(h: _Harness, lengths: list[int], op=CPU_OP, pad_tokens: int = 1, pad_rows: int = 1) -> None:
    """One decode step of sequences that end up `lengths` tokens long, checked against the oracle. The K/V
    of their earlier tokens are written straight into the cache: the oracle's Python loops over long
    prompts would cost seconds."""
    seqs = [_Seq() for _ in lengths]
    context = [(s, n - 1) for s, n in zip(seqs, lengths) if n > 1]
    if context:
        _, key, value, k_cache, v_cache, slot_mapping = h.step_args(context)[:6]
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    h.step([(s, 1) for s in seqs], pad_tokens=pad_tokens, pad_rows=pad_rows, op=op)


def _lengths(block_size: int, seed: int, count: int = 5) -> list[int]:
    """`count` ragged lengths up to three blocks and a bit, plus 1 and exactly two blocks."""
    gen = torch.Generator().manual_seed(seed)
    return [1, 2 * block_size] + torch.randint(1, 3 * block_size + 3, (count,), generator=gen).tolist()


HEAD_DIMS = [64, 80, 96, 128, 256]
GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # (query heads, KV heads): ratios 1, 2, 4, 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_matches_oracle_across_head_dims_and_gqa(kernel_only, head_dim, dtype):
    for i, (q_heads, kv_heads) in enumerate(GQA):
        block_size = (3, 16, 5, 32)[i]
        h = _Harness(block_size=block_size, num_q_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, seed=head_dim + i)
        _decode(h, _lengths(block_size, seed=head_dim + 7 * i), pad_tokens=2)


@pytest.mark.parametrize("block_size", [1, 4, 7, 16, 64])
def test_ragged_lengths_at_block_boundaries(kernel_only, block_size):
    """Lengths 1, a block less one, a block, a block and one, two blocks: every boundary case of the walk."""
    h = _Harness(block_size=block_size, num_q_heads=6, num_kv_heads=2, head_dim=64, seed=block_size, num_blocks=96)
    _decode(h, sorted({1, max(1, block_size - 1), block_size, block_size + 1, 2 * block_size}), pad_rows=2)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("flags", [dict(window=5), dict(softcap=5.0), dict(sinks=True), dict(chunk=6),
                                   dict(window=7, softcap=2.0, sinks=True)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flags_match_oracle(kernel_only, dtype, flags, kind):
    """Sliding window, logit soft-cap, attention sinks and chunked attention: the kernel's own flags."""
    h = _Harness(block_size=4, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seed=len(flags), **flags)
    if kind == "decode":
        _decode(h, _lengths(4, seed=len(str(flags)), count=8))
    else:  # decode rows on the kernel beside prompt chunks on the torch path, in one call
        _run_batch(h, kind, seed=len(str(flags)), pad_tokens=2, pad_rows=1, op=CPU_OP)


def test_float16_cache(kernel_only):
    h = _Harness(block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, seed=5)
    _decode(h, _lengths(8, seed=5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flags", [dict(), dict(window=700, sinks=True)], ids=str)
def test_long_rows_split_over_threads(kernel_only, dtype, flags):
    """Few rows of long contexts: each row's keys split over several work items, merged by log-sum-exp."""
    h = _Harness(block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, num_blocks=200, seed=9,
                 **flags)
    _decode(h, [1501, 41])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flags", [dict(), dict(window=6, sinks=True), dict(chunk=8, softcap=3.0)], ids=str)
def test_multi_row_queries_through_the_kernel(kernel_isa, dtype, flags):
    """The kernel's own op with `max_query_len` above 1 attends prompt chunks too (each row at its causal
    offset), after writing every token's K/V (those of the longer chunks too); rows of longer chunks and of
    padding are zeros."""
    h = _Harness(block_size=4, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seed=8, num_blocks=96,
                 **flags)
    seqs = [_Seq() for _ in range(5)]
    h.step([(s, n) for s, n in zip(seqs, [3, 9, 1, 17, 6])], op=CPU_OP)
    chunks = [(seqs[0], 5), (seqs[1], 1), (seqs[2], 12), (seqs[3], 2), (seqs[4], 7)]
    args = h.step_args(chunks, pad_tokens=1, pad_rows=1)
    expected, expected_k, expected_v = paged_attention_oracle(*args)
    out = kernel_op("paged_decode", kernel_isa)(*args, 8)
    torch.testing.assert_close(h.k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(h.v_cache, expected_v, rtol=0, atol=0, equal_nan=True)
    served = torch.zeros(out.shape[0], dtype=torch.bool)
    bounds = args[8].tolist()
    for s, (_, n) in enumerate(chunks):
        served[bounds[s]:bounds[s + 1]] = n <= 8
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(out[served].double(), expected[served], **tol)
    assert torch.count_nonzero(out[~served]) == 0


def _chunks_match_oracle(h: _Harness, isa: str, context: list[int], chunks: list[int]) -> None:
    """Sequences with `context` tokens already in the cache each attend a chunk of `chunks[i]` tokens in one call of
    the kernel's own op, every query length its own; checked against the oracle."""
    seqs = [_Seq() for _ in context]
    if any(context):  # written straight into the cache, as in `_decode`
        _, key, value, k_cache, v_cache, slot_mapping = h.step_args([(s, n) for s, n in zip(seqs, context) if n])[:6]
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    args = h.step_args(list(zip(seqs, chunks)), pad_tokens=1, pad_rows=1)
    expected = paged_attention_oracle(*args)[0]
    out = kernel_op("paged_decode", isa)(*args, max(chunks))
    tol = dict(rtol=2e-5, atol=2e-5) if h.k_cache.dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(out[:sum(chunks)].double(), expected[:sum(chunks)], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_prompt_chunks_in_lanes_match_oracle(kernel_isa, dtype, head_dim):
    """Chunks whose rows x query heads per KV head fill 16 lanes take the lane path (AVX512): first chunks and
    chunks over cached context, ragged lengths that leave the last vector part-empty, block sizes that cut
    tiles short, every GQA ratio; shorter queries beside them keep the row path."""
    for i, (q_heads, kv_heads) in enumerate(GQA):
        block_size = (3, 16, 5, 32)[i]
        h = _Harness(block_size=block_size, num_q_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, seed=head_dim + i, num_blocks=160)
        _chunks_match_oracle(h, kernel_isa, context=[0, 21, 0, 7, 50], chunks=[37, 16, 1, 5, 23])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flags", [dict(window=9, sinks=True), dict(chunk=8, softcap=3.0)], ids=str)
def test_prompt_chunk_flags_in_lanes(kernel_isa, dtype, flags):
    """Windows and attention chunks give each lane its own first key; soft-capping and sinks are per lane too."""
    h = _Harness(block_size=4, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seed=11, num_blocks=96,
                 **flags)
    _chunks_match_oracle(h, kernel_isa, context=[0, 13, 30], chunks=[29, 11, 6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_short_chunks_over_long_context_split_in_lanes(kernel_isa, dtype):
    """Two rows of eight query heads on one KV head fill a vector; over 1500 keys on two threads their keys
    are split over several items, merged by log-sum-exp."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        h = _Harness(block_size=16, num_q_heads=8, num_kv_heads=1, head_dim=64, dtype=dtype, num_blocks=200, seed=4,
                     window=1400, sinks=True)
        _chunks_match_oracle(h, kernel_isa, context=[1500, 40], chunks=[2, 3])
    finally:
        torch.set_num_threads(threads)


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """The cache's elements as integers of their width: equal iff equal bit for bit (NaNs included)."""
    return cache.view({4: torch.int32, 2: torch.int16}[cache.element_size()])


def _fused_write_step(h: _Harness, key_dtype: torch.dtype, strided: bool) -> tuple:
    """A step's op arguments (after a first step writing context) of decode rows, a chunk, padded tokens and
    rows, whose keys and values are `key_dtype` and, `strided`, views of one fused projection as in a model."""
    seqs = [_Seq() for _ in range(4)]
    h.step([(s, n) for s, n in zip(seqs, [5, 1, 12, 3])], op=CPU_OP)
    args = list(h.step_args([(seqs[0], 1), (seqs[1], 6), (seqs[2], 1), (seqs[3], 1)], pad_tokens=3, pad_rows=2))
    key, value = args[1].to(key_dtype), args[2].to(key_dtype)
    if strided:
        fused = torch.cat((key, value, key), dim=1)  # keys at a token stride of 3 x kv_heads x head_dim
        key, value = fused[:, : key.shape[1]], fused[:, key.shape[1]: 2 * key.shape[1]]
    args[1], args[2] = key, value
    return tuple(args)


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fused_kv_write_lands_where_write_kv_cache_puts_it(kernel_isa, dtype, layout):
    """The kernel's KV write against `write_kv_cache` on copies of the same caches, bit for bit: padded tokens
    (slot -1) write nothing and slots neither writes keep their NaN; also for keys and values strided as views
    of a fused projection, and of another dtype than the cache's."""
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    for key_dtype, strided in ((dtype, False), (dtype, True), (other, False)):
        h = _Harness(block_size=4, num_q_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype, seed=11, layout=layout)
        args = _fused_write_step(h, key_dtype, strided)
        key, value, k_cache, v_cache, slot_mapping = args[1:6]
        want_k, want_v = k_cache.clone(), v_cache.clone()
        write_kv_cache(key, value, want_k, want_v, slot_mapping)
        assert kernel_op("paged_decode", kernel_isa)(*args, 1) is not None
        assert torch.equal(_bits(k_cache), _bits(want_k)) and torch.equal(_bits(v_cache), _bits(want_v))


def test_unserved_layer_is_left_untouched(kernel_isa):
    """Where the kernel does not take the layer (a head dim not a multiple of 16) its op returns None and
    writes nothing: the torch path does both."""
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=24, seed=12)
    args = _fused_write_step(h, torch.float32, False)
    before = [_bits(cache).clone() for cache in args[3:5]]
    assert kernel_op("paged_decode", kernel_isa)(*args, 1) is None
    assert all(torch.equal(b, _bits(cache)) for b, cache in zip(before, args[3:5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flags", [dict(), dict(window=6, softcap=3.0, sinks=True)], ids=str)
def test_decode_step_through_the_op_equals_the_torch_path(kernel_isa, dtype, flags, monkeypatch):
    """Two layers of one decode step (padded tokens and rows) through `paged_attention_cpu` give the torch
    path's caches bit for bit and its outputs within rounding, zeros in padded rows; the kernel's plan is
    worked out by the first layer and reused by the second (as compiled layers share it)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    planned, torch_rows = [], []
    real_plan, real_rows = paged_attention_module.plan_kernel_step, paged_attention_module.attend_decode_rows
    monkeypatch.setattr(paged_attention_module, "plan_kernel_step", lambda *a: planned.append(1) or real_plan(*a))
    monkeypatch.setattr(paged_attention_module, "attend_decode_rows",
                        lambda *a: torch_rows.append(1) or real_rows(*a))
    h = _Harness(block_size=16, num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=13, num_blocks=96,
                 **flags)
    seqs = [_Seq() for _ in range(3)]
    h.step([(s, n) for s, n in zip(seqs, [300, 17, 40])], op=CPU_OP)
    args = h.step_args([(s, 1) for s in seqs], pad_tokens=2, pad_rows=1)
    planned.clear()
    layers = [(args[3], args[4]), (args[3].clone(), args[4].clone())]
    torch_layers = [(k.clone(), v.clone()) for k, v in layers]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    for caches, torch_caches in zip(layers, torch_layers):
        out = CPU_OP(*args[:3], *caches, *args[5:])
        # A slot_mapping of its own: the torch op keeps its plans apart from the kernel's.
        expected = TORCH_OP(*args[:3], *torch_caches, args[5].clone(), *args[6:])
        for cache, torch_cache in zip(caches, torch_caches):
            assert torch.equal(_bits(cache), _bits(torch_cache))
        torch.testing.assert_close(out, expected, **tol)
        assert torch.count_nonzero(out[len(seqs):]) == 0
    assert planned == [1] and len(torch_rows) == 2  # the torch op's two calls alone


def test_kernel_query_len_takes_long_chunks_only_over_short_contexts():
    """Up to `MAX_QUERY_LEN` always; a longer chunk while query tokens x sequence length stay within the
    bound; never a length at or above the first chunk that exceeds it; every chunk without a bound."""
    assert decode_module.kernel_query_len([], 1000) == decode_module.MAX_QUERY_LEN
    assert decode_module.kernel_query_len([(3, 5000), (20, 40)], 1000) == 20  # a short row over a long context too
    assert decode_module.kernel_query_len([(20, 40), (30, 40), (25, 100)], 1000) == 20  # 25 x 100 exceeds it
    assert decode_module.kernel_query_len([(20, 40), (20, 500)], 1000) == decode_module.MAX_QUERY_LEN
    assert decode_module.kernel_query_len([(20, 40), (2000, 9000)], None) == 2000


def test_chunk_bound_follows_the_kernel_variant():
    """Rows one at a time (AVX2) keep the tight bound; lanes without bf16 dot products a wider one; AVX512-BF16
    none."""
    assert decode_module.chunk_pairs_limit("avx2") == decode_module.MAX_CHUNK_PAIRS
    assert decode_module.chunk_pairs_limit("avx512") == decode_module.MAX_LANE_CHUNK_PAIRS
    assert decode_module.MAX_LANE_CHUNK_PAIRS > decode_module.MAX_CHUNK_PAIRS
    assert decode_module.chunk_pairs_limit("avx512_bf16") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_op_sends_queries_up_to_max_query_len_to_the_kernel(kernel_only, dtype, monkeypatch):
    """Through `paged_attention_cpu`: decode rows, a verification-shaped row (1 + 4 drafts) and a chunk of
    exactly `MAX_QUERY_LEN` tokens over earlier context go to the kernel; only the longer chunks (one
    over cached context, one a first chunk) take the torch path, with the chunk bound below them; all
    match the oracle. Without a bound, every chunk goes to the kernel."""
    from fastgen.ops.cpu_kernels import MAX_QUERY_LEN

    monkeypatch.setattr(decode_module, "chunk_pairs_limit", lambda isa: MAX_QUERY_LEN * 9)
    long_rows = []
    real = paged_attention_module._attend_one
    monkeypatch.setattr(paged_attention_module, "_attend_one",
                        lambda query, *a, **k: long_rows.append(query.shape[0]) or real(query, *a, **k))
    h = _Harness(block_size=8, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seed=5, num_blocks=128)
    seqs = [_Seq() for _ in range(6)]
    context = [40, 13, 30, 9, 21]
    h.step([(s, n) for s, n in zip(seqs, context)], op=CPU_OP)
    long_rows.clear()  # the context itself was a prefill call
    h.step([(seqs[0], 1), (seqs[1], 5), (seqs[2], MAX_QUERY_LEN), (seqs[3], MAX_QUERY_LEN + 1), (seqs[4], 1),
            (seqs[5], MAX_QUERY_LEN + 3)], pad_tokens=2, pad_rows=1, op=CPU_OP)
    assert sorted(long_rows) == [MAX_QUERY_LEN + 1, MAX_QUERY_LEN + 3]
    monkeypatch.setattr(decode_module, "chunk_pairs_limit", lambda isa: None)
    long_rows.clear()
    h.step([(seqs[0], 1), (seqs[3], MAX_QUERY_LEN + 2), (seqs[5], 2 * MAX_QUERY_LEN + 5)], pad_tokens=1, op=CPU_OP)
    assert long_rows == []


@pytest.mark.parametrize("isa", ["avx512_bf16", "avx512", "avx2"])
def test_forced_isa_variants(kernel_isa, isa, monkeypatch):
    """`FASTGEN_CPU_KERNELS` caps the variant; each variant this CPU runs matches the oracle in fp32 and bf16,
    on decode rows and on prompt chunks (in lanes on the AVX512 variants, bf16 widened without AVX512-BF16)."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv(ENV_VAR, isa)
    assert cpu_kernel_isa() == isa
    assert kernel_op("paged_decode", isa) is not None
    monkeypatch.setattr(paged_attention_module, "attend_decode_rows", None)  # a decode row on torch would fail
    for dtype in (torch.float32, torch.bfloat16):
        h = _Harness(block_size=16, num_q_heads=9, num_kv_heads=3, head_dim=80, dtype=dtype, seed=2)
        _decode(h, _lengths(16, seed=4))
        h = _Harness(block_size=16, num_q_heads=9, num_kv_heads=3, head_dim=80, dtype=dtype, seed=3)
        _chunks_match_oracle(h, isa, context=[0, 19], chunks=[21, 7])


def test_kernels_off_take_the_torch_path(kernel_isa, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "off")
    assert cpu_kernel_isa() is None
    calls = []
    real = paged_attention_module.attend_decode_rows
    monkeypatch.setattr(paged_attention_module, "attend_decode_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=1)
    _decode(h, _lengths(4, seed=1))
    assert calls


def test_unserved_shapes_take_the_torch_path(kernel_isa):
    """A head dim the kernel does not take (not a multiple of 16) is answered by the torch path."""
    h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=24, seed=3)
    _decode(h, _lengths(4, seed=3))


def test_bad_isa_request_names_the_choices(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "amx")
    with pytest.raises(ValueError, match="avx512_bf16"):
        requested_isa()


def test_pick_isa_caps_and_falls_back():
    both = ("avx512_bf16", "avx512", "avx2")
    assert pick_isa(both, "auto") == "avx512_bf16" and pick_isa(both, "avx512") == "avx512"
    assert pick_isa(("avx2",), "avx512_bf16") == "avx2" and pick_isa(both, "off") is None and pick_isa((), "auto") is None


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that imports fastgen from wherever this one does."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True,
                          timeout=300, check=False)


_DECODE_TWICE = """
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    from test_paged_attention import _Harness, _run_batch
    for seed in (1, 2):  # two calls: the build is tried (and logged) once
        h = _Harness(block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=seed)
        _run_batch(h, "decode", seed=seed, op=torch.ops.fastgen.paged_attention_cpu)
    print("ok")
"""


def test_no_compiler_falls_back_with_one_log_line(tmp_path):
    """A compiler that is not there: results from the torch path, still checked against the oracle, and one
    warning naming the fallback."""
    done = _run_python(_DECODE_TWICE.format(tests=os.path.dirname(__file__)), CXX=str(tmp_path / "no-such-c++"),
                       FASTGEN_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert done.stderr.count("stay on the torch path") == 1, done.stderr[-2000:]


def test_kernels_failing_together_log_one_line(tmp_path, kernel_isa):
    """Every kernel's build failing at once on `prebuild`'s threads (no compiler) still logs one line."""
    code = """
        from fastgen.ops.cpu_kernels import KERNELS, prebuild
        threads = prebuild(KERNELS)
        for thread in threads:
            thread.join()
        print(len(threads))
    """
    done = _run_python(code, CXX=str(tmp_path / "no-such-c++"), FASTGEN_CACHE=str(tmp_path / "cache"))
    from fastgen.ops.cpu_kernels import KERNELS

    assert done.returncode == 0 and done.stdout.strip() == str(len(KERNELS)), done.stderr[-2000:]
    assert done.stderr.count("stay on the torch path") == 1, done.stderr[-2000:]


def test_a_killed_build_leaves_nothing_to_wait_on(tmp_path, kernel_isa):
    """torch's build lock as a build killed midway leaves it (a fresh `lock` file in the build directory): the next
    process builds and loads the kernel instead of waiting on it forever."""
    code = f"""
        import os
        from fastgen.ops.cpu_kernels import build_dir, kernel_op
        directory = build_dir({kernel_isa!r}, "bf16_matmul")
        os.makedirs(directory)
        open(os.path.join(directory, "lock"), "w").close()
        print(kernel_op("bf16_matmul", {kernel_isa!r}) is not None, os.path.exists(os.path.join(directory, "lock")))
    """
    done = _run_python(code, FASTGEN_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0 and done.stdout.split() == ["True", "False"], done.stderr[-2000:]


def test_second_process_reuses_the_build(kernel_isa):
    """A later process loads the cached library: nothing under the build directory is rewritten."""
    directory = build_dir(kernel_isa, "paged_decode")
    library = os.path.join(directory, f"fastgen_paged_decode_{kernel_isa}.so")
    before = os.stat(library).st_mtime_ns
    done = _run_python(_DECODE_TWICE.format(tests=os.path.dirname(__file__)))
    assert done.returncode == 0 and "unavailable" not in done.stderr, done.stderr[-2000:]
    assert os.stat(library).st_mtime_ns == before


def test_op_is_one_opaque_node_under_compile(kernel_only):
    """torch.compile(fullgraph=True) keeps the op as one node (its fake gives the shape), and the compiled
    call matches the oracle like the eager one."""
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True, dynamic=False)
    def compiled(*args):
        return CPU_OP(*args)

    h = _Harness(block_size=8, num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, seed=6)
    _decode(h, _lengths(8, seed=6), op=compiled)
    calls = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and calls in ([CPU_OP], [CPU_OP.default])


def test_pipeline_on_the_cpu_backend_equals_the_torch_path(kernel_isa, tmp_path, monkeypatch):
    """The engine with attention_backend="cpu" gives the torch path's tokens, every decode row on the kernel."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    path = build_checkpoint(str(tmp_path / "llama"), "llama")
    small = dict(num_kv_blocks=16, block_size=8, token_budget=16, max_seqs=4, progress=False)
    texts = ["The quick brown fox", "def f(x): return x", "one two"]
    results = {}
    for backend in ("torch", "cpu"):
        if backend == "cpu":
            monkeypatch.setattr(paged_attention_module, "attend_decode_rows", None)  # a decode row on torch fails
        with fastgen.pipeline(path, attention_backend=backend, **small) as pipe:
            assert pipe.engine.runner.attention_backend == backend
            results[backend] = [r.token_ids for r in pipe(texts, max_new_tokens=6, do_sample=False)]
    assert results["cpu"] == results["torch"]


@pytest.fixture(scope="module")
def smollm2_facts(tmp_path_factory):
    """SmolLM2-135M's shape (9 query heads, 3 KV heads of 64), from its config alone."""
    import transformers

    path = tmp_path_factory.mktemp("smollm2")
    transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                             tie_word_embeddings=True, dtype="bfloat16").save_pretrained(path)
    return model_facts(str(path))


def _epyc(compiler: str) -> Hardware:
    return Hardware("cpu", 2, frozenset({"avx2", "avx512f", "avx512_bf16"}), "AVX512", 24 * GIB,
                    cpp_compiler=compiler)


def test_plan_names_the_kernel_and_its_isa(smollm2_facts, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    plan = make_plan(smollm2_facts, _epyc("/usr/bin/c++"))
    reason = plan.reasons["attention_backend"]
    assert plan.attention_backend == "cpu" and "avx512_bf16" in reason and "/usr/bin/c++" in reason
    monkeypatch.setenv(ENV_VAR, "avx2")
    capped = make_plan(smollm2_facts, _epyc("/usr/bin/c++"))
    assert capped.attention_backend == "cpu" and f"avx2 variant, capped by {ENV_VAR}=avx2" in capped.reasons[
        "attention_backend"]
    monkeypatch.setenv(ENV_VAR, "off")
    off = make_plan(smollm2_facts, _epyc("/usr/bin/c++"))
    assert off.attention_backend == "torch" and f"{ENV_VAR}=off" in off.reasons["attention_backend"]
    monkeypatch.delenv(ENV_VAR)
    none = make_plan(smollm2_facts, _epyc(""))
    assert none.attention_backend == "torch" and "no C++ compiler" in none.reasons["attention_backend"]


def test_a_runner_builds_the_kernels_its_plan_uses(kernel_isa, tiny_checkpoints, monkeypatch):
    """`plan_kernels` names what a plan calls (no LoRA kernel without LoRA, the fp32 tiles' kernel for an fp32 plan
    with `gemv_weights` and none without, the int4 and Q8_0 head kernels for an int4 plan); `prebuild` loads them
    on threads the first callers then find done; an unknown kernel is refused by name; with the kernels off
    nothing is started."""
    from fastgen.executor.runner import plan_kernels
    from fastgen.ops.cpu_kernels import KERNELS, prebuild

    facts = model_facts(tiny_checkpoints["llama"])
    hardware = Hardware("cpu", 2, frozenset({"avx2", "avx512f", "avx512_bf16"}), "AVX512", 24 << 30,
                        cpp_compiler="c++")
    fp32 = plan_kernels(make_plan(facts, hardware, dtype="float32"))
    assert fp32 == ("paged_decode", "f32_matmul", "decode_layer")
    assert plan_kernels(make_plan(facts, hardware, dtype="float32", gemv_weights=False)) == ("paged_decode",)
    int4 = plan_kernels(make_plan(facts, hardware, dtype="float32", quantization="int4", quantization_group_size=64))
    assert set(int4) == {"paged_decode", "q4_matmul", "q8_matmul", "decode_layer"} and set(int4) <= set(KERNELS)
    monkeypatch.setenv(ENV_VAR, kernel_isa)
    threads = prebuild(["paged_decode", "q4_matmul", "paged_decode"])
    assert [t.name for t in threads] == ["fastgen-build-paged_decode", "fastgen-build-q4_matmul"]
    for thread in threads:
        thread.join(timeout=600)
    assert kernel_op("q4_matmul", kernel_isa) is not None
    with pytest.raises(ValueError, match=r"unknown C\+\+ CPU kernel 'q5_matmul'"):
        build_dir(kernel_isa, "q5_matmul")
    monkeypatch.setenv(ENV_VAR, "off")
    assert prebuild(["paged_decode"]) == []

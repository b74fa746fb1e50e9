"""One layer's paged attention on the CPU: the torch path against fastgen's C++ kernel.

    python scripts/bench_cpu_attention.py [--q-heads 9] [--kv-heads 3] [--head-dim 64] [--block-size 128]
                                          [--batches 1,16] [--contexts 256,1024,4096] [--query-lens 1]
                                          [--dtypes bf16,fp32] [--repeats 20] [--threads N]
                                          [--json bench_results/cpu_attention.json]

Defaults are SmolLM2-135M's attention (9 query heads, 3 KV heads of 64, the plan's 128-token blocks). Each
batch is `batch` sequences with `context` cached tokens and `query_len` new tokens each (1: decode rows; more:
prompt chunks), their blocks shuffled over a cache with room for all of them. Timed per call of one layer,
best and median of `--repeats` after warm-up:
- torch: `fastgen::paged_attention_torch` (KV write + the block-by-block flash-kernel decode path, or the
  flash kernel over gathered blocks for chunks);
- cpu: `fastgen::paged_attention_cpu` (what the engine runs: the C++ kernel for every row it takes, chunks
  beyond the variant's `chunk_pairs_limit` on the torch path);
- kernel: the C++ kernel's op alone, taking every row whatever its length (what `chunk_pairs_limit` is tuned
  by).
Both ops get the step's plans computed once beforehand, as the engine's first layer computes them for the
rest. The two outputs are compared before timing. A measurement, not a test: the machine's other load shows.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import torch
from bench_common import write_json

import fastgen.ops  # noqa: F401  (registers the fastgen:: ops)
from fastgen.ops import allocate_kv_cache
from fastgen.ops.cpu_kernels import cpu_kernel_isa, kernel_op
from fastgen.ops.paged_attention import cpu_paged_attention, torch_paged_attention

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def time_ms(fn, repeats: int) -> tuple[float, float]:
    """(best, median) wall time of `fn()` in ms, after 3 warm-up calls. On a shared machine the best is the
    one to compare: other processes only ever add time."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times), 1000 * statistics.median(times)


def attention_step(batch: int, context: int, query_len: int, args, dtype: torch.dtype) -> tuple:
    """The op arguments of one step: `batch` sequences of `query_len` new tokens after `context` cached ones,
    blocks shuffled."""
    gen = torch.Generator().manual_seed(batch * 7 + context + 1000 * query_len)
    blocks_per_seq = -(-(context + query_len) // args.block_size)
    num_blocks = batch * blocks_per_seq + 1
    k_cache, v_cache = (allocate_kv_cache(num_blocks, args.block_size, args.kv_heads, args.head_dim, dtype, "cpu")
                        .normal_(generator=gen) for _ in "kv")
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    tables = tables.to(torch.int32)
    positions = torch.arange(context, context + query_len)
    slots = (tables[:, positions // args.block_size].long() * args.block_size + positions % args.block_size).flatten()
    tokens = batch * query_len
    query = torch.randn(tokens, args.q_heads, args.head_dim, generator=gen).to(dtype)
    key, value = (torch.randn(tokens, args.kv_heads, args.head_dim, generator=gen).to(dtype) for _ in "kv")
    seq_lens = torch.full((batch,), context + query_len, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32) * query_len
    return (query, key, value, k_cache, v_cache, slots, tables, seq_lens, starts, args.head_dim**-0.5)


def main(argv: list[str] | None = None) -> int:
    """Time every (dtype, batch, context, query length) and print a table; write JSON where asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--query-lens", default="1", help="new tokens per sequence (1: decode; more: chunks)")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    isa = cpu_kernel_isa()
    start = time.perf_counter()
    if isa is None or kernel_op("paged_decode", isa) is None:
        print("the C++ CPU kernel is off or could not be built here; nothing to compare", file=sys.stderr)
        return 1
    op = kernel_op("paged_decode", isa)
    print(f"kernel {isa}: ready in {time.perf_counter() - start:.2f} s; {torch.get_num_threads()} threads")
    rows = []
    print(f"{'':>25} | {'best ms (median ms)':^44} | speed-up (best)")
    print(f"{'dtype':>5} {'batch':>5} {'context':>7} {'query':>5} | {'torch':>14} {'cpu':>14} {'kernel':>14} |"
          f" cpu kernel")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for batch in map(int, args.batches.split(",")):
            for context, query_len in itertools.product(map(int, args.contexts.split(",")),
                                                        map(int, args.query_lens.split(","))):
                step = attention_step(batch, context, query_len, args, dtype)
                torch_plans, cpu_plans = {}, {}
                expected = torch_paged_attention(*step, step_plans=torch_plans)
                got = cpu_paged_attention(*step, step_plans=cpu_plans)
                tol = 2e-2 if dtype != torch.float32 else 1e-4
                torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
                torch.testing.assert_close(op(*step, 0, 0.0, None, 0, query_len).float(), expected.float(), rtol=tol,
                                           atol=tol)
                timed = {
                    "torch": time_ms(lambda: torch_paged_attention(*step, step_plans=torch_plans), args.repeats),
                    "cpu": time_ms(lambda: cpu_paged_attention(*step, step_plans=cpu_plans), args.repeats),
                    "kernel": time_ms(lambda: op(*step, 0, 0.0, None, 0, query_len), args.repeats),
                }
                rows.append(dict(dtype=name, batch=batch, context=context, query_len=query_len, isa=isa,
                                 **{f"{k}_best_ms": v[0] for k, v in timed.items()},
                                 **{f"{k}_median_ms": v[1] for k, v in timed.items()}))
                cells = " ".join(f"{best:>6.3f} ({median:>6.3f})" for best, median in timed.values())
                print(f"{name:>5} {batch:>5} {context:>7} {query_len:>5} | {cells} |"
                      f" {timed['torch'][0] / timed['cpu'][0]:.2f}x {timed['torch'][0] / timed['kernel'][0]:.2f}x")
    if args.json:
        write_json(args.json, dict(args=vars(args), threads=torch.get_num_threads(), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

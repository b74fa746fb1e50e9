"""Paged attention on the GPU: the Triton kernel against a torch baseline, for SplitFuse-shaped batches.

    python scripts/bench_attention.py [--dtype bf16] [--q-heads 32] [--kv-heads 8] [--head-dim 128]
                                      [--block-size 64] [--iters 50] [--json bench_results/attention.json]

Batches (Llama-3-8B attention shapes by default): decode-heavy (many sequences, one new token
each), long-context decode with few sequences (where split-KV matters), prefill-heavy (prompt
chunks) and mixed (decodes plus prompt chunks, as one Dynamic SplitFuse step). Each is timed with
CUDA events, the median of `--iters` runs after warm-up, for:
- triton: `triton_paged_attention` (one KV-write launch, then the attention launch(es));
- torch: the KV write by `index_copy_`, then SDPA over K/V gathered through the block tables into
  a padded dense batch (the padding index and mask are built once per batch, outside the timing,
  as they would be once per step for all layers).
The two outputs are compared before timing. Achieved bandwidth counts the bytes the step must
move at least (every sequence's K/V read once, queries read, outputs and new K/V written) and is
set against the device's measured copy bandwidth; prefill-heavy batches are compute-bound, so
TFLOP/s (causal, 4 flops per query-key-dim) is shown too. On a machine without a CUDA GPU the
script says so and exits 0. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastgen.ops import torch_paged_attention, triton_paged_attention, write_kv_cache
from fastgen.ops import triton_attention


@dataclass(slots=True)
class Scenario:
    """One batch shape: `(context_len, query_len)` per sequence."""

    name: str
    """Label in the table."""
    seqs: list[tuple[int, int]]
    """Cached tokens and new tokens of each sequence."""


def scenarios() -> list[Scenario]:
    """The batches timed: decode-heavy, long-context decode, prefill-heavy, mixed SplitFuse."""
    return [
        Scenario("decode 128 x ctx 2048", [(2048, 1)] * 128),
        Scenario("decode 4 x ctx 32768", [(32768, 1)] * 4),
        Scenario("prefill 4 x 1024", [(0, 1024)] * 4),
        Scenario("prefill chunk 512 @ ctx 3584", [(3584, 512)] * 2),
        Scenario("mixed 64 dec + 2 x 352", [(2048, 1)] * 64 + [(1024, 352), (0, 352)]),
    ]


def median_ms(fn, iters: int) -> float:
    """Median of `iters` CUDA-event timings of `fn()` after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: torch.device, iters: int) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), 1 GiB buffers."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() / ms / 1e6


def build(sc: Scenario, args, device: torch.device) -> dict:
    """Random inputs and metadata of one scenario on `device` (blocks shuffled over the cache)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    bs = args.block_size
    blocks_per_seq = [-(-(c + q) // bs) for c, q in sc.seqs]
    num_blocks = sum(blocks_per_seq) + 8
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(len(sc.seqs), width, dtype=torch.int32)
    slots, starts = [], [0]
    for s, ((context, query_len), n) in enumerate(zip(sc.seqs, blocks_per_seq)):
        blocks = [order.pop() for _ in range(n)]
        tables[s, :n] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // bs] * bs + p % bs for p in range(context, context + query_len)]
        starts.append(starts[-1] + query_len)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    num_tokens = starts[-1]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    cache_shape = (num_blocks, bs, args.kv_heads, args.head_dim)
    return dict(
        query=randn(num_tokens, args.q_heads, args.head_dim), key=randn(num_tokens, args.kv_heads, args.head_dim),
        value=randn(num_tokens, args.kv_heads, args.head_dim), k_cache=randn(*cache_shape),
        v_cache=randn(*cache_shape), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device), seq_lens=torch.tensor([c + q for c, q in sc.seqs], dtype=torch.int32,
                                                              device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
    )


def torch_baseline(inputs: dict, seqs: list[tuple[int, int]], scale: float):
    """A closure running the torch baseline (KV write + gathered SDPA); padding index and mask prebuilt."""
    device = inputs["query"].device
    max_q = max(q for _, q in seqs)
    starts = inputs["query_start_loc"].tolist()
    max_len = inputs["block_tables"].shape[1] * inputs["k_cache"].shape[1]
    token_index = torch.zeros(len(seqs), max_q, dtype=torch.long)
    q_valid = torch.zeros(len(seqs), max_q, dtype=torch.bool)
    mask = torch.zeros(len(seqs), 1, max_q, max_len, dtype=torch.bool)
    for s, (context, query_len) in enumerate(seqs):
        token_index[s, :query_len] = torch.arange(starts[s], starts[s] + query_len)
        q_valid[s, :query_len] = True
        q_pos = context + torch.arange(query_len).unsqueeze(1)
        mask[s, 0, :query_len] = torch.arange(max_len).unsqueeze(0) <= q_pos
        mask[s, 0, query_len:, 0] = True  # padded query rows attend to something: no NaN rows
    token_index, q_valid, mask = token_index.to(device), q_valid.to(device), mask.to(device)
    out = torch.zeros_like(inputs["query"])
    heads, dim = inputs["k_cache"].shape[2], inputs["k_cache"].shape[3]

    def run() -> torch.Tensor:
        write_kv_cache(inputs["key"], inputs["value"], inputs["k_cache"], inputs["v_cache"], inputs["slot_mapping"])
        tables = inputs["block_tables"].long()
        k = inputs["k_cache"][tables].reshape(len(seqs), max_len, heads, dim).transpose(1, 2)
        v = inputs["v_cache"][tables].reshape(len(seqs), max_len, heads, dim).transpose(1, 2)
        q = inputs["query"][token_index].transpose(1, 2)
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[token_index[q_valid]] = dense.transpose(1, 2)[q_valid]
        return out

    return run


def min_bytes(inputs: dict, seqs: list[tuple[int, int]]) -> int:
    """Bytes one step must move at least: K/V of every sequence once, queries, outputs, new K/V."""
    kv_row = inputs["k_cache"][0, 0].numel() * inputs["k_cache"].element_size()
    kv_read = 2 * kv_row * sum(c + q for c, q in seqs)
    q_bytes = inputs["query"].numel() * inputs["query"].element_size()
    return kv_read + 2 * q_bytes + 2 * inputs["key"].numel() * inputs["key"].element_size()


def flops(seqs: list[tuple[int, int]], q_heads: int, head_dim: int) -> int:
    """Causal attention flops: 2 matmuls x 2 flops per query x visible key x head dim."""
    pairs = sum(q * c + q * (q + 1) // 2 for c, q in seqs)
    return 4 * pairs * q_heads * head_dim


def main(argv: list[str] | None = None) -> int:
    """Parse options, time every scenario, print the table, write JSON; 0 on success."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=os.path.join("bench_results", "attention.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU on this machine; the Triton attention kernel is only timed on a GPU "
              "(CPU correctness runs in tests/test_triton_attention.py through TRITON_INTERPRET=1).")
        return 0
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    copy_bw = copy_bandwidth(device, args.iters)
    print(f"{props.name}, {props.multi_processor_count} SMs, measured copy bandwidth {copy_bw:.0f} GB/s; "
          f"{args.dtype}, heads {args.q_heads}/{args.kv_heads}, head_dim {args.head_dim}, block {args.block_size}")
    scale = args.head_dim**-0.5
    rows = []
    header = f"{'batch':30} {'tokens':>6} {'splits':>6} {'triton ms':>9} {'torch ms':>9} {'speedup':>7} " \
             f"{'GB/s':>7} {'% copy':>6} {'TFLOP/s':>7} {'max err':>8}"
    print(header)
    for sc in scenarios():
        inputs = build(sc, args, device)
        baseline = torch_baseline(inputs, sc.seqs, scale)
        expected = baseline().clone()
        got = triton_paged_attention(**inputs, scale=scale)
        err = (got.float() - expected.float()).abs().max().item()
        if sc.seqs[0][0] + sc.seqs[0][1] <= 4096 and len(sc.seqs) <= 8:
            ref = torch_paged_attention(**inputs, scale=scale)
            err = max(err, (got.float() - ref.float()).abs().max().item())
        t_ms = median_ms(lambda: triton_paged_attention(**inputs, scale=scale), args.iters)
        b_ms = median_ms(baseline, args.iters)
        num_tokens, num_seqs = inputs["query"].shape[0], len(sc.seqs)
        block_m, block_q, _ = triton_attention.tile_shape(num_tokens, num_seqs, args.q_heads // args.kv_heads,
                                                          args.head_dim)
        programs = triton_attention.num_query_blocks(num_tokens, num_seqs, block_q) * args.kv_heads
        splits = triton_attention.choose_num_kv_splits(
            programs, inputs["block_tables"].shape[1] * args.block_size, props.multi_processor_count)
        gbps = min_bytes(inputs, sc.seqs) / t_ms / 1e6
        tflops = flops(sc.seqs, args.q_heads, args.head_dim) / t_ms / 1e9
        row = dict(batch=sc.name, tokens=num_tokens, seqs=num_seqs, splits=splits, block_m=block_m,
                   triton_ms=t_ms, torch_ms=b_ms, speedup=b_ms / t_ms, gb_per_s=gbps, copy_fraction=gbps / copy_bw,
                   tflops=tflops, max_abs_err=err)
        rows.append(row)
        print(f"{sc.name:30} {num_tokens:6d} {splits:6d} {t_ms:9.3f} {b_ms:9.3f} {b_ms / t_ms:7.2f} "
              f"{gbps:7.0f} {100 * gbps / copy_bw:6.1f} {tflops:7.1f} {err:8.1e}")
        del inputs, baseline, expected, got
        torch.cuda.empty_cache()
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(device=props.name, copy_gb_per_s=copy_bw, config=vars(args), results=rows), f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-bucket step time, eager vs compiled (vs CUDA graphs on a GPU), compile/capture cost,
end-to-end decode throughput, and batch-1 decode bandwidth against the machine's ceiling.

    .venv/bin/python scripts/bench_graphs.py [--layers 8 --hidden 512 | --model DIR] [--buckets 1,2,4,...]

Each bucket is timed on a realistic step: `min(bucket, max_seqs)` sequences with 64 tokens of
context each, the bucket's tokens spread over them (a decode step when bucket <= max_seqs).
Batch-1 decode bandwidth is weight bytes x decode steps/s (gpt-fast's measure), compared with
a measured streaming-read bandwidth. The model is a random-weight Llama of `--layers` x `--hidden`,
or with `--model` a checkpoint directory (say, bench_peer's converted SmolLM2-135M), its
parameters counted from its config. Prints tables, writes JSON (bench_results/graphs.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
from bench_common import build_llama_checkpoint, median_seconds, memory_read_bandwidth, profile_shares, write_json

import fastgen
from fastgen.executor.step_inputs import HostStepInputs
from fastgen.planning.model_facts import model_facts

CONTEXT = 64
KV_CACHE_BYTES = 1 << 30


def step_inputs(bucket: int, max_seqs: int, block_size: int) -> HostStepInputs:
    """A bucket-sized step: sequences with CONTEXT tokens of KV each, the bucket's tokens spread over them."""
    num_seqs = min(bucket, max_seqs)
    per_seq = [bucket // num_seqs + (1 if i < bucket % num_seqs else 0) for i in range(num_seqs)]
    blocks_per_seq = -(-(CONTEXT + max(per_seq)) // block_size)
    host = HostStepInputs.empty()
    for s, n in enumerate(per_seq):
        table = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        for p in range(CONTEXT, CONTEXT + n):
            host.input_ids.append(5)
            host.positions.append(p)
            host.slot_mapping.append(table[p // block_size] * block_size + p % block_size)
            host.long_rope.append(False)
            host.lora_slots.append(-1)
        host.seq_lens.append(CONTEXT + n)
        host.state_slots.append(-1)
        host.query_start_loc.append(host.query_start_loc[-1] + n)
        host.block_tables.append(table)
    return host


def time_buckets(pipe: fastgen.Pipeline, buckets: list[int], max_seqs: int, repeats: int) -> dict[int, float]:
    """Median seconds of one model step per bucket through the runner's static buffers."""
    runner = pipe.engine.runner
    out = {}
    with torch.inference_mode():
        for bucket in buckets:
            runner.buffers.fill(step_inputs(bucket, max_seqs, runner.block_size), bucket)
            views = runner.buffers.views(bucket)
            if bucket in runner._graphs:
                out[bucket] = median_seconds(runner._graphs[bucket][0].replay, repeats)
            else:  # the model step itself: its decoder layers are the compiled ones when compile is on
                with runner._compile_context():
                    out[bucket] = median_seconds(lambda: runner._forward(*views), repeats)
    return out


def profile_batch1_step(pipe: fastgen.Pipeline, steps: int = 50) -> dict[str, float]:
    """CPU-time shares (attention op, matmuls, other) of `steps` batch-1 decode steps through
    `runner.execute`, and the mean step seconds under the profiler."""
    runner = pipe.engine.runner
    host = step_inputs(1, 1, runner.block_size)
    host.logits_indices.append(0)
    for _ in range(5):
        runner.execute(host)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with prof:
        start = time.perf_counter()
        for _ in range(steps):
            runner.execute(host)
        elapsed = time.perf_counter() - start
    shares = profile_shares(prof)
    shares["step_seconds_profiled"] = elapsed / steps
    return shares


def decode_throughput(pipe: fastgen.Pipeline, batch: int, new_tokens: int) -> float:
    """Generated tokens/s for `batch` requests of 16-token prompts decoding `new_tokens` each."""
    params = fastgen.SamplingParams(do_sample=False, max_new_tokens=new_tokens, ignore_eos=True)
    engine = pipe.engine
    for i in range(batch):
        engine.add_request([3 + (i + j) % 100 for j in range(16)], params)
    engine.step()  # the prefill step is not decode
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint directory instead of the random Llama shape")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--buckets", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--max-seqs", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size (default: the plan's, what a user gets: 128 tokens for head_dim 64)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile 50 batch-1 decode steps per mode (torch.profiler CPU-time shares)")
    parser.add_argument("--out", default="bench_results/graphs.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    buckets = [int(b) for b in args.buckets.split(",")]
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    # The KV cache sized in bytes, so that it fits whatever block size the plan picks.
    common = dict(dtype=dtype, buckets=buckets, token_budget=buckets[-1], max_seqs=min(args.max_seqs, buckets[-1]),
                  kv_cache_memory=KV_CACHE_BYTES, progress=False)
    if args.block_size is not None:
        common["block_size"] = args.block_size
    modes = {"eager": dict(compile="off"), "compiled": dict(compile="default")}
    if on_gpu:
        modes["compiled+graphs"] = dict(compile="default", cuda_graphs=True)

    tmp = tempfile.mkdtemp(prefix="fastgen-bench-")
    try:
        if args.model:
            path, num_params, kind = args.model, model_facts(args.model).num_params, os.path.basename(args.model)
        else:
            path, kind = tmp, "Llama-shaped"
            num_params = build_llama_checkpoint(tmp, dtype, args.layers, args.hidden)
        weight_bytes = num_params * torch.empty((), dtype=dtype).element_size()
        print(f"model: {kind}, {num_params / 1e6:.0f}M parameters ({weight_bytes / 2**20:.0f} MiB), {args.dtype}, "
              f"on {device}, {torch.get_num_threads()} threads")
        step_times, warmup, decode, profiles = {}, {}, {}, {}
        for name, options in modes.items():
            start = time.perf_counter()
            pipe = fastgen.pipeline(path, **common, **options)
            startup = time.perf_counter() - start
            block_size = pipe.engine.runner.block_size
            warmup[name] = {"startup_s": startup, "per_bucket_s": dict(pipe.engine.runner.warmup_seconds)}
            step_times[name] = time_buckets(pipe, buckets, common["max_seqs"], args.repeats)
            decode[name] = {b: decode_throughput(pipe, int(b), args.new_tokens) for b in args.batch_sizes.split(",")}
            if args.profile:
                profiles[name] = profile_batch1_step(pipe)
            pipe.destroy()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    names = list(modes)
    print(f"\nstep time per bucket (ms, median of {args.repeats}); compile/capture seconds in brackets")
    print(f"{'bucket':>7}" + "".join(f"{n:>26}" for n in names) + f"{'eager/compiled':>16}")
    for b in buckets:
        cells = "".join(
            f"{1e3 * step_times[n][b]:>16.2f} [{warmup[n]['per_bucket_s'].get(b, 0.0):>6.1f} s]" for n in names)
        print(f"{b:>7}{cells}{step_times['eager'][b] / step_times['compiled'][b]:>15.2f}x")
    print("\nend-to-end decode tokens/s")
    print(f"{'batch':>7}" + "".join(f"{n:>18}" for n in names))
    for b in args.batch_sizes.split(","):
        print(f"{b:>7}" + "".join(f"{decode[n][b]:>18.1f}" for n in names))
    bandwidth = memory_read_bandwidth(device)
    print(f"\nbatch-1 decode weight bandwidth (weights {weight_bytes / 2**20:.0f} MiB x tokens/s, {block_size}-token KV "
          f"blocks) vs measured streaming reads {bandwidth / 1e9:.1f} GB/s:")
    roofline = {}
    for n in names:
        achieved = weight_bytes * decode[n]["1"]
        roofline[n] = achieved / bandwidth
        print(f"  {n:<18}{achieved / 1e9:>7.1f} GB/s = {100 * roofline[n]:.0f}% of measured")
    for n, shares in profiles.items():
        print(f"  {n} batch-1 step profile: {1e3 * shares['step_seconds_profiled']:.2f} ms; "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items() if k != "step_seconds_profiled"))
    write_json(args.out, {"args": vars(args), "device": str(device), "num_params": num_params,
                          "weight_bytes": weight_bytes, "block_size": block_size, "step_seconds": step_times, "warmup": warmup,
                          "decode_tokens_per_s": decode, "read_bandwidth_bytes_per_s": bandwidth,
                          "batch1_fraction_of_bandwidth": roofline, "batch1_profile_shares": profiles})


if __name__ == "__main__":
    main()

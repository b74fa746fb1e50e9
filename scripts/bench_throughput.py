"""Offline throughput: fastgen vs Hugging Face `generate` on the same model and workload.

    .venv/bin/python scripts/bench_throughput.py [--requests 128] [--prompt-mean 256] [--output-mean 64]

A Llama-shaped model of about 100M parameters with random weights (bf16 on the CPU) serves issue
9's seeded workload: 128 requests, prompt lengths normal around 256 tokens (30% spread, clipped
16..1024), output lengths normal around 64 (30% spread), greedy, EOS ignored. In the same run:
- fastgen: all requests submitted at once, Dynamic SplitFuse continuous batching;
- HF `generate` in left-padded static batches, each batch running to its longest output; the
  batch size best for HF is searched. Only requested tokens count as output;
- HF `generate` with its static KV cache and `torch.compile` (transformers' automatic compile of
  the decode step: `cache_implementation="static"` + a `CompileConfig`), at the best batch size
  found above. One `max_cache_len` for the whole workload keeps the decode shapes the same in
  every batch, so it compiles once; that compile is done by an untimed warm-up, as fastgen's is.
  If it fails or passes `--hf-static-timeout`, the reason is recorded instead of a time.
Prints a table with fastgen's speed over each HF row and writes JSON (default
bench_results/throughput.json). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch
import transformers
from bench_common import build_llama_checkpoint, matmul_flops, profile_shares, run_offline, workload, write_json


def padded_batch(batch: list[tuple[list[int], int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask of a batch of (prompt ids, output length), on `device`."""
    width = max(len(p) for p, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, (p, _) in enumerate(batch):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def run_hf(model, requests, batch_size: int, timeout: float = float("inf"), **gen) -> float:
    """Seconds for HF generate in left-padded static batches of `batch_size` (`gen`: extra
    generate keywords); raises TimeoutError between batches once `timeout` seconds have passed."""
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"stopped after {i} of {len(requests)} requests: over {timeout:.0f} s")
        batch = requests[i : i + batch_size]
        ids, mask = padded_batch(batch, model.device)
        model.generate(ids, attention_mask=mask, max_new_tokens=max(o for _, o in batch), do_sample=False, **gen)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - start


def run_hf_static_compiled(model, requests, batch_size: int, timeout: float) -> tuple[float, dict]:
    """Timed seconds of HF generate with a static cache and torch.compile, and notes: the untimed
    compile warm-up's seconds and the graphs Dynamo still compiled during the timed run."""
    config = transformers.CompileConfig(mode="reduce-overhead" if model.device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers compiles automatically only on accelerators otherwise
    gen = {"cache_implementation": "static", "compile_config": config,
           "max_cache_len": max(len(p) for p, _ in requests) + max(o for _, o in requests)}
    start = time.perf_counter()
    # One warm-up batch per batch shape the timed run will see (a last, smaller batch is another).
    for size in sorted({batch_size, len(requests) % batch_size} - {0}):
        run_hf(model, [(p, 4) for p, _ in requests[:size]], size, **gen)
    warmup = time.perf_counter() - start
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    seconds = run_hf(model, requests, batch_size, timeout, **gen)
    return seconds, {"compile_warmup_seconds": warmup,
                     "graphs_compiled_in_timed_run": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-mean", type=int, default=256)
    parser.add_argument("--output-mean", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=1024, help="prompt lengths are clipped to 16..this")
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--hf-batch-sizes", default="8,16,32,64")
    parser.add_argument("--hf-static-batch-size", type=int, default=None,
                        help="batch size of the HF static cache + torch.compile row (default: the best eager one)")
    parser.add_argument("--hf-static-timeout", type=float, default=900.0,
                        help="seconds the timed HF static + compile run may take before it is abandoned")
    parser.add_argument("--no-hf-static", action="store_true", help="skip the HF static cache + torch.compile row")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", default="default", choices=["off", "default", "max-autotune"])
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also run fastgen on the first N requests under torch.profiler (untimed): op table + shares")
    parser.add_argument("--out", default="bench_results/throughput.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    # fastgen's pipeline takes the GPU when there is one; HF and the ceiling must run there too.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    tmp = tempfile.mkdtemp(prefix="fastgen-bench-")
    try:
        num_params = build_llama_checkpoint(tmp, dtype, args.layers, args.hidden)
        vocab = transformers.AutoConfig.from_pretrained(tmp).vocab_size
        requests = workload(args.requests, args.prompt_mean, args.output_mean, vocab, args.seed, args.max_prompt)
        prompt_tokens = sum(len(p) for p, _ in requests)
        output_tokens = sum(o for _, o in requests)
        print(f"model: Llama-shaped, {num_params / 1e6:.0f}M parameters, {args.dtype}, random weights; on {device}, "
              f"{torch.get_num_threads()} threads")
        print(f"workload: {len(requests)} requests, {prompt_tokens} prompt + {output_tokens} output tokens")

        options = dict(dtype=dtype, compile=args.compile, token_budget=args.token_budget,
                       max_seqs=min(256, args.token_budget))
        results = {"fastgen": run_offline(tmp, requests, **options)}
        profile = None
        if args.profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            run_offline(tmp, requests[: args.profile], around_steps=prof, **options)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
            profile = {k: round(v, 3) for k, v in profile_shares(prof).items()}
            print("fastgen CPU time shares:", ", ".join(f"{k} {100 * v:.0f}%" for k, v in profile.items()))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        run_hf(hf, requests[:2], 2)  # warm-up
        for bs in (int(b) for b in args.hf_batch_sizes.split(",")):
            print(f"HF generate, batch {bs} ...", flush=True)
            results[f"hf_generate_bs{bs}"] = run_hf(hf, requests, bs)
        best_eager = min(results[k] for k in results if k.startswith("hf"))
        static_bs = args.hf_static_batch_size or next(
            int(k.removeprefix("hf_generate_bs")) for k in results if k.startswith("hf") and results[k] == best_eager)
        static_name, static_note = f"hf_static_compile_bs{static_bs}", {}
        if not args.no_hf_static:
            print(f"HF generate, static cache + torch.compile, batch {static_bs} ...", flush=True)
            try:
                results[static_name], static_note = run_hf_static_compiled(hf, requests, static_bs,
                                                                          args.hf_static_timeout)
            except Exception as exc:  # a row that cannot run here is a result too: record why
                static_note = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                print(f"  not measured: {static_note['failed']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    best_hf = min((k for k in results if k.startswith("hf")), key=results.get)
    rows = []
    print(f"\n{'engine':<26}{'seconds':>9}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}{'vs best HF':>12}"
          f"{'fastgen / row':>15}")
    for name, secs in results.items():
        row = {"engine": name, "seconds": secs, "requests_per_s": len(requests) / secs,
               "output_tokens_per_s": output_tokens / secs, "total_tokens_per_s": (prompt_tokens + output_tokens) / secs,
               "speedup_vs_best_hf": results[best_hf] / secs, "fastgen_speedup_over_row": secs / results["fastgen"],
               **(static_note if name == static_name else {})}
        rows.append(row)
        print(f"{name:<26}{secs:>9.2f}{row['requests_per_s']:>8.2f}{row['output_tokens_per_s']:>11.1f}"
              f"{row['total_tokens_per_s']:>13.1f}{row['speedup_vs_best_hf']:>11.2f}x"
              f"{row['fastgen_speedup_over_row']:>14.2f}x")
    if "failed" in static_note:
        rows.append({"engine": static_name, **static_note})
        print(f"{static_name:<26}not measured: {static_note['failed']}")
    elif static_note:
        print(f"({static_name}: {static_note['compile_warmup_seconds']:.1f} s of untimed compile warm-up; "
              f"{static_note['graphs_compiled_in_timed_run']} graphs compiled during the timed run)")
    ceiling = matmul_flops(device, dtype)
    # Forward FLOPs ~ 2 x params per token (attention over short contexts adds little here).
    achieved = 2 * num_params * (prompt_tokens + output_tokens) / results["fastgen"]
    print(f"\nfastgen: {achieved / 1e9:.0f} GFLOP/s of model math = {100 * achieved / ceiling:.0f}% of the "
          f"measured {args.dtype} matmul ceiling ({ceiling / 1e9:.0f} GFLOP/s)")
    write_json(args.out, {"args": vars(args), "device": str(device), "num_params": num_params,
                          "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "threads": torch.get_num_threads(), "results": rows,
                          "matmul_flops": ceiling, "fastgen_model_flops": achieved, "fastgen_profile_shares": profile})


if __name__ == "__main__":
    main()

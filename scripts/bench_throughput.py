"""Offline throughput: fastgen vs Hugging Face `generate` on the same model and workload.

    .venv/bin/python scripts/bench_throughput.py [--requests 64] [--prompt-mean 128] [--output-mean 32]

A Llama-shaped model of about 100M parameters with random weights (bf16 on the CPU) serves a
seeded workload: prompt and output lengths drawn from normal distributions (30% spread, as in
FastGen's method, scaled to this machine), greedy, EOS ignored. In the same run:
- fastgen: all requests submitted at once, Dynamic SplitFuse continuous batching;
- HF `generate` in left-padded static batches, each batch running to its longest output; the
  batch size best for HF is searched. Only requested tokens count as output.
Prints a table and writes JSON (default bench_results/throughput.json). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch
import transformers
from bench_common import build_llama_checkpoint, matmul_flops, run_offline, workload, write_json



@torch.inference_mode()
def run_hf(model, requests, batch_size: int) -> float:
    """Seconds for HF generate in left-padded static batches of `batch_size`."""
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        model.generate(ids, attention_mask=mask, max_new_tokens=max(o for _, o in batch), do_sample=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-mean", type=int, default=128)
    parser.add_argument("--output-mean", type=int, default=32)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--hf-batch-sizes", default="8,16,32")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", default="default", choices=["off", "default", "max-autotune"])
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--out", default="bench_results/throughput.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    tmp = tempfile.mkdtemp(prefix="fastgen-bench-")
    try:
        num_params = build_llama_checkpoint(tmp, dtype, args.layers, args.hidden)
        vocab = transformers.AutoConfig.from_pretrained(tmp).vocab_size
        requests = workload(args.requests, args.prompt_mean, args.output_mean, vocab, args.seed)
        prompt_tokens = sum(len(p) for p, _ in requests)
        output_tokens = sum(o for _, o in requests)
        print(f"model: Llama-shaped, {num_params / 1e6:.0f}M parameters, {args.dtype}, random weights; "
              f"{torch.get_num_threads()} threads")
        print(f"workload: {len(requests)} requests, {prompt_tokens} prompt + {output_tokens} output tokens")

        results = {"fastgen": run_offline(tmp, requests, dtype=dtype, compile=args.compile,
                                          token_budget=args.token_budget, max_seqs=min(256, args.token_budget))}
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        run_hf(hf, requests[:2], 2)  # warm-up
        for bs in (int(b) for b in args.hf_batch_sizes.split(",")):
            results[f"hf_generate_bs{bs}"] = run_hf(hf, requests, bs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    best_hf = min((k for k in results if k.startswith("hf")), key=results.get)
    rows = []
    print(f"\n{'engine':<22}{'seconds':>9}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}{'vs best HF':>12}")
    for name, secs in results.items():
        row = {"engine": name, "seconds": secs, "requests_per_s": len(requests) / secs,
               "output_tokens_per_s": output_tokens / secs, "total_tokens_per_s": (prompt_tokens + output_tokens) / secs,
               "speedup_vs_best_hf": results[best_hf] / secs}
        rows.append(row)
        print(f"{name:<22}{secs:>9.2f}{row['requests_per_s']:>8.2f}{row['output_tokens_per_s']:>11.1f}"
              f"{row['total_tokens_per_s']:>13.1f}{row['speedup_vs_best_hf']:>11.2f}x")
    ceiling = matmul_flops(torch.device("cpu"), dtype)
    # Forward FLOPs ~ 2 x params per token (attention over short contexts adds little here).
    achieved = 2 * num_params * (prompt_tokens + output_tokens) / results["fastgen"]
    print(f"\nfastgen: {achieved / 1e9:.0f} GFLOP/s of model math = {100 * achieved / ceiling:.0f}% of the "
          f"measured {args.dtype} matmul ceiling ({ceiling / 1e9:.0f} GFLOP/s)")
    write_json(args.out, {"args": vars(args), "num_params": num_params, "prompt_tokens": prompt_tokens,
                          "output_tokens": output_tokens, "threads": torch.get_num_threads(), "results": rows,
                          "matmul_flops": ceiling, "fastgen_model_flops": achieved})


if __name__ == "__main__":
    main()

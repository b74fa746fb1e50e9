"""Weight offload: decode tokens/s with streamed layers against the in-memory model, by batch size
and weight budget, with the bytes moved per generated token and the share of the copies hidden
behind compute.

    .venv/bin/python scripts/bench_offload.py [--layers 36 --hidden 512] [--budgets 0.5,0.25,0.1]
        [--sources cpu,disk] [--batches 1,4,16,64,256] [--threads N] [--device cuda]

A random-weight Llama-shaped checkpoint (bench_common's builder; many thin layers by default so
that even a 10% budget holds the embeddings, the LM head and two layer buffers). One engine per
(source, budget), plus the in-memory one (100%): for each batch size, `--batch` prompts of
`--prompt-len` tokens are prefilled (untimed), then `--decode-steps` decode steps are timed. Per row:
decode tokens/s, its ratio to in-memory at the same batch, bytes copied per generated token, the
copy rate, and the overlap (1 - time compute waited for a layer / time the copies took; from the
streamer's counters). Prints a table, writes JSON (bench_results/offload.json) and plots tokens/s
and overlap against the batch size (bench_results/offload.png).

On a GPU (`--device cuda`, the default when one is present) the copies are pinned host buffers
on a side stream ("cpu") or file reads into pinned staging buffers ("disk"); on a CPU a thread
reads the file or copies the host image, and "cpu" keeps that image in the same RAM (it measures
the copy path, it saves no memory).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import torch
import transformers
from bench_common import build_llama_checkpoint, pyplot_or_none, write_json

import fastgen

GREEDY = dict(do_sample=False, ignore_eos=True)


def decode_run(pipe: fastgen.Pipeline, batch: int, args: argparse.Namespace, vocab: int) -> dict:
    """Prefill `batch` prompts, then time `args.decode_steps` decode steps; the streamer's counters
    over the timed steps."""
    engine = pipe.engine
    rng = np.random.default_rng(batch)
    for _ in range(batch):
        prompt = rng.integers(3, vocab, args.prompt_len).tolist()
        engine.add_request(prompt, fastgen.SamplingParams(max_new_tokens=args.decode_steps + 2, **GREEDY))
    while any(s.num_computed_tokens < s.num_prompt_tokens for seqs in engine.requests.values() for s in seqs):
        engine.step()
    engine.step()  # the first decode step: lazy allocations happen here
    streamer = engine.runner.offload
    before = streamer.snapshot() if streamer else None
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.decode_steps):
        engine.step()
    sync()
    elapsed = time.perf_counter() - start
    after = streamer.snapshot() if streamer else None
    while engine.has_unfinished():
        engine.step()
    row = {"batch": batch, "tok_s": batch * args.decode_steps / elapsed, "seconds": elapsed}
    if streamer:
        moved = after.bytes_streamed - before.bytes_streamed
        copying = after.transfer_seconds - before.transfer_seconds
        waiting = after.wait_seconds - before.wait_seconds
        row.update(bytes_per_token=moved / (batch * args.decode_steps),
                   copy_gbps=moved / copying / 1e9 if copying else 0.0, copy_seconds=copying, wait_seconds=waiting,
                   overlap=max(0.0, 1 - waiting / copying) if copying else 1.0)
    return row


def run_config(path: str, source: str, budget: float, args: argparse.Namespace, vocab: int) -> dict:
    """Every batch size on one engine (in-memory when `source` is "none")."""
    start = time.perf_counter()
    offload = {} if source == "none" else dict(offload=source, weight_memory=budget)
    pipe = fastgen.pipeline(path, device=args.device, dtype=args.dtype, compile=args.compile,
                            token_budget=args.token_budget, max_seqs=max(args.batches), max_length=256,
                            num_kv_blocks=max(args.batches) * 2 + 8, block_size=16, progress=False, **offload)
    load = time.perf_counter() - start
    try:
        plan = pipe.engine.plan
        streamer = pipe.engine.runner.offload
        stats = streamer.snapshot() if streamer else None
        config = {"source": source, "budget": budget, "load_seconds": load, "weight_memory": plan.weight_memory,
                  "plan_reason": plan.reasons["weight_memory"],
                  "resident_layers": stats.resident_layers if stats else args.layers,
                  "streamed_layers": stats.streamed_layers if stats else 0,
                  "bytes_per_step": stats.bytes_per_step if stats else 0,
                  "rows": [decode_run(pipe, b, args, vocab) for b in args.batches]}
        if streamer:
            config["peak_resident_bytes"] = streamer.snapshot().peak_resident_bytes
    finally:
        pipe.destroy()
    print(f"  {source} {budget:.0%}: {time.perf_counter() - start:.0f} s", flush=True)
    return config


def plot(configs: list[dict], path: str) -> None:
    """Tokens/s and overlap against batch size, one line per (source, budget)."""
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, (rate, hidden) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, c in enumerate(configs):
        label = "in-memory" if c["source"] == "none" else f"{c['source']} {c['budget']:.0%}"
        batches = [r["batch"] for r in c["rows"]]
        style = dict(marker="o", label=label, color=f"C{i}", linestyle="--" if c["source"] == "disk" else "-")
        rate.plot(batches, [r["tok_s"] for r in c["rows"]], **style)
        if c["source"] != "none":
            hidden.plot(batches, [r["overlap"] for r in c["rows"]], **style)
    for ax in (rate, hidden):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences decoding together)")
        ax.grid(alpha=0.3)
    rate.set_yscale("log")
    rate.set_ylabel("decode tokens/s")
    rate.legend(fontsize=8)
    hidden.set_ylabel("overlap (share of copy time hidden)")
    hidden.set_ylim(0, 1.05)
    fig.suptitle("fastgen weight offload: decode throughput and overlap")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", default=None, help="checkpoint and plan dtype (default: float32 on a CPU, "
                                                      "bfloat16 on a GPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", default="off", help="compile mode (off by default: start-up stays short)")
    parser.add_argument("--sources", default="cpu,disk")
    parser.add_argument("--budgets", default="0.5,0.25,0.1", help="weight_memory fractions (in-memory is 100%%)")
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    parser.add_argument("--out", default="bench_results/offload.json")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="fastgen-bench-offload-")
    try:
        path = os.path.join(workdir, "model")
        num_params = build_llama_checkpoint(path, getattr(torch, args.dtype), args.layers, args.hidden)
        weights = os.path.getsize(os.path.join(path, "model.safetensors"))
        vocab = len(transformers.AutoTokenizer.from_pretrained(path))
        print(f"model: Llama-shaped, {num_params / 1e6:.0f}M random parameters ({args.layers} x {args.hidden}), "
              f"{weights / 2**20:.0f} MiB of {args.dtype} weights; {args.device}, {torch.get_num_threads()} threads",
              flush=True)
        configs = [run_config(path, "none", 1.0, args, vocab)]
        configs += [run_config(path, source, float(budget), args, vocab)
                    for source in args.sources.split(",") for budget in args.budgets.split(",")]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = {r["batch"]: r["tok_s"] for r in configs[0]["rows"]}
    print("\n| source | budget | layers resident / streamed | batch | decode tok/s | vs in-memory | "
          "MiB copied per token | copy GB/s | overlap |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in configs:
        for r in c["rows"]:
            r["vs_in_memory"] = r["tok_s"] / base[r["batch"]]
            name = "in-memory" if c["source"] == "none" else c["source"]
            extra = ("| - | - | - |" if c["source"] == "none" else
                     f"| {r['bytes_per_token'] / 2**20:.2f} | {r['copy_gbps']:.2f} | {r['overlap']:.2f} |")
            print(f"| {name} | {c['budget']:.0%} | {c['resident_layers']} / {c['streamed_layers']} | {r['batch']} | "
                  f"{r['tok_s']:.1f} | {r['vs_in_memory']:.2f}x {extra}")
    for c in configs[1:]:
        print(f"plan for {c['source']} {c['budget']:.0%}: {c['plan_reason']}")
    write_json(args.out, {"num_params": num_params, "weight_bytes": weights, "layers": args.layers,
                          "hidden": args.hidden, "threads": torch.get_num_threads(), "args": vars(args),
                          "configs": configs})
    plot(configs, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()

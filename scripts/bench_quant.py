"""Weight-only quantization: the plan dtype (bf16) against int8 and int4 weights on one model.

    .venv/bin/python scripts/bench_quant.py [--layers 20 --hidden 1536] [--modes none,int8,int4]

A random-weight Llama-shaped checkpoint (~0.5B parameters at the defaults, bench_common's builder).
Per mode: greedy agreement with the unquantized model over a fixed prompt set (share of generated
positions with the same token), perplexity of a fixed text (Python's own `pydoc_data.topics`,
through prompt logprobs), weight memory (the model's parameters and buffers, KV cache and rotary
tables excluded), batch-1 decode tokens/s and batched decode tokens/s (decode steps only, after the
prompts are in). Prints a table, writes JSON (bench_results/quant.json).

Random weights make perplexity about the vocabulary size whatever the format: there the column
shows how far quantization moves the model, not how good it is.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time

import numpy as np
import torch
import transformers
from bench_common import build_llama_checkpoint, write_json

import fastgen

GREEDY = dict(do_sample=False, ignore_eos=True)


def fixed_text_ids(tokenizer, tokens: int) -> list[int]:
    """The first `tokens` tokens of Python's pydoc topics, in sorted topic order (a fixed text)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return tokenizer.encode(text[: 8 * tokens])[:tokens]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers, each tensor once (tied ones too)."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def decode_rate(pipe: fastgen.Pipeline, prompts: list[list[int]], steps: int) -> float:
    """Generated tokens/s over `steps` decode steps of all `prompts` together (their prefill untimed)."""
    engine = pipe.engine
    for prompt in prompts:
        engine.add_request(prompt, fastgen.SamplingParams(max_new_tokens=steps + 2, **GREEDY))
    while any(s.num_computed_tokens < s.num_prompt_tokens for seqs in engine.requests.values() for s in seqs):
        engine.step()
    engine.step()  # the first decode step of every sequence: any lazy allocation happens here
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return len(prompts) * steps / elapsed


def perplexity(pipe: fastgen.Pipeline, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of `ids[1:]` given their prefixes."""
    out = pipe([ids], max_new_tokens=1, prompt_logprobs=0, **GREEDY)[0]
    nll = [-entry[token] for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
    return math.exp(float(np.mean(nll)))


def run_mode(path: str, mode: str, args: argparse.Namespace, prompts: list[list[int]],
             text: list[int]) -> dict:
    """Every measure of one quantization mode."""
    start = time.perf_counter()
    pipe = fastgen.pipeline(path, dtype=args.dtype, quantization=mode, compile="off", token_budget=args.token_budget,
                            max_seqs=max(args.batch, len(prompts)), max_length=1024, progress=False)
    load_seconds = time.perf_counter() - start
    try:
        greedy = [r.token_ids for r in pipe(prompts, max_new_tokens=args.new_tokens, **GREEDY)]
        row = {"mode": mode, "load_seconds": load_seconds, "weight_bytes": weight_bytes(pipe.engine.runner.model),
               "greedy": greedy, "perplexity": perplexity(pipe, text),
               "batch1_tok_s": decode_rate(pipe, prompts[:1], args.decode_steps),
               f"batch{args.batch}_tok_s": decode_rate(pipe, (prompts * args.batch)[: args.batch], args.decode_steps)}
    finally:
        pipe.destroy()
    print(f"  {mode}: {time.perf_counter() - start:.0f} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--dtype", default="bfloat16", help="the plan dtype (activations, unquantized weights)")
    parser.add_argument("--modes", default="none,int8,int4")
    parser.add_argument("--prompts", type=int, default=8, help="greedy-agreement prompts")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--text-tokens", type=int, default=256, help="tokens of the perplexity text")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="sequences of the batched decode measure")
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--out", default="bench_results/quant.json")
    args = parser.parse_args()
    modes = args.modes.split(",")
    workdir = tempfile.mkdtemp(prefix="fastgen-bench-quant-")
    try:
        path = os.path.join(workdir, "model")
        start = time.perf_counter()
        num_params = build_llama_checkpoint(path, torch.bfloat16, args.layers, args.hidden)
        print(f"model: Llama-shaped, {num_params / 1e6:.0f}M random parameters ({args.layers} x {args.hidden}), "
              f"built in {time.perf_counter() - start:.0f} s; plan dtype {args.dtype}, eager steps, "
              f"{torch.get_num_threads()} threads", flush=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, len(tokenizer), int(n)).tolist() for n in rng.integers(8, 48, args.prompts)]
        text = fixed_text_ids(tokenizer, args.text_tokens)
        rows = [run_mode(path, mode, args, prompts, text) for mode in modes]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = next((r for r in rows if r["mode"] == "none"), rows[0])
    batched = f"batch{args.batch}_tok_s"
    print(f"\n| weights | greedy agreement | perplexity | weight memory (MiB) | batch-1 decode tok/s | "
          f"batch-{args.batch} decode tok/s |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        pairs = [(a, b) for ours, ref in zip(r["greedy"], base["greedy"]) for a, b in zip(ours, ref)]
        r["greedy_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
        name = args.dtype if r["mode"] == "none" else f"{r['mode']} ({args.dtype} activations)"
        print(f"| {name} | {r['greedy_agreement']:.3f} | {r['perplexity']:.1f} | {r['weight_bytes'] / 2**20:.0f} | "
              f"{r['batch1_tok_s']:.2f} | {r[batched]:.2f} |")
    for r in rows:
        print(f"{r['mode']}: batch-1 decode {r['batch1_tok_s'] / base['batch1_tok_s']:.2f}x, batch-{args.batch} "
              f"{r[batched] / base[batched]:.2f}x, weights {r['weight_bytes'] / base['weight_bytes']:.2f}x of "
              f"{base['mode']}")
    write_json(args.out, {"num_params": num_params, "layers": args.layers, "hidden": args.hidden, "dtype": args.dtype,
                          "threads": torch.get_num_threads(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

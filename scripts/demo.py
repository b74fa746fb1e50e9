"""The main job on the bundled demo model: load it, generate for a batch of prompts, stream one.

    make demo                       # or: .venv/bin/python scripts/demo.py [--model DIR]

The demo model is a few-MB Llama trained on Python's own documentation (scripts/train_demo_model.py):
its output looks like English about Python, not like meaningful answers.
"""

from __future__ import annotations

import argparse
import sys
import time

import fastgen

PROMPTS = [
    "The module",
    "A function is",
    "Python is",
    "The default value of",
    "If the object",
    "This method returns",
    "An exception is raised when",
    "The following example shows",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or cached hub id (default: the demo model)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()

    start = time.perf_counter()
    pipe = fastgen.pipeline(args.model)
    print(f"loaded {pipe.engine.model_dir} on {pipe.engine.device} ({pipe.engine.dtype}) "
          f"in {time.perf_counter() - start:.1f} s")

    start = time.perf_counter()
    responses = pipe(PROMPTS, max_new_tokens=args.max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    for prompt, response in zip(PROMPTS, responses):
        print(f"\n>>> {prompt}\n{prompt}{response.generated_text}  [{response.finish_reason}, {response.generated_length} tokens]")
    generated = sum(r.generated_length for r in responses)
    print(f"\n{len(PROMPTS)} prompts, {generated} tokens in {elapsed:.2f} s ({generated / elapsed:.0f} tokens/s, greedy)")

    print("\n>>> streamed, sampled (temperature 0.8, seed 0)\nPython is", end="", flush=True)
    for delta in pipe.stream("Python is", max_new_tokens=args.max_new_tokens, temperature=0.8, seed=0):
        print(delta.generated_text, end="", flush=True)
    print()
    pipe.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

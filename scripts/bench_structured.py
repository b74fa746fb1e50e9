"""Structured outputs' cost: 16 concurrent json_schema requests against the same output lengths unconstrained.

    .venv/bin/python scripts/bench_structured.py [--model PATH] [--requests 16] [--backend xgrammar] [--repeats 3]

Each round runs the constrained requests first (temperature 1, seeded); each request's output length is
then replayed unconstrained (`ignore_eos`, `max_new_tokens` = that length), so both runs compute the same
tokens and differ only by the grammar work. Reports tok/s and TPOT of each (TPOT = engine seconds per
step that decodes, the steps being the same), grammar compile time cold and cached, and the mask time
per step (bitmask fill on the host + its application to the logits), per round and as the mean
ratio; writes JSON (bench_results/structured.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fastgen  # noqa: E402
from fastgen.engine.grammar import bitmask as bitmask_module  # noqa: E402
from fastgen.structured_outputs import StructuredOutputsParams  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def run(engine, prompts: list[str], params: list[fastgen.SamplingParams]) -> tuple[float, int, int]:
    """Submit every request at once and step until done: (seconds, generated tokens, steps)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    seqs = [s for rid in ids for s in engine.sequences(rid)]
    steps, started = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return time.perf_counter() - started, sum(len(s.output_token_ids) for s in seqs), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--backend", default="xgrammar", choices=["xgrammar", "llguidance"])
    parser.add_argument("--repeats", type=int, default=3, help="constrained / unconstrained rounds, alternating")
    parser.add_argument("--json", default="bench_results/structured.json")
    args = parser.parse_args()
    pipe = fastgen.pipeline(args.model, structured_outputs_backend=args.backend, progress=False)
    engine = pipe.engine
    prompts = [f"Record {i}: a person's details as JSON." for i in range(args.requests)]

    manager = engine.structured_outputs
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    manager.compiler  # the backend and its tokenizer tables are built once per engine, not per grammar
    started = time.perf_counter()
    manager.prepare(StructuredOutputsParams.from_value(spec)).pending.wait(60)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    manager.prepare(StructuredOutputsParams.from_value(spec)).pending.wait(60)
    cached = time.perf_counter() - started

    mask_seconds = [0.0]
    fill, apply = manager.fill_bitmask, bitmask_module.apply_bitmask_

    def timed_fill(rows):
        t = time.perf_counter()
        try:
            return fill(rows)
        finally:
            mask_seconds[0] += time.perf_counter() - t

    def timed_apply(*a, **k):
        t = time.perf_counter()
        try:
            return apply(*a, **k)
        finally:
            mask_seconds[0] += time.perf_counter() - t

    manager.fill_bitmask = timed_fill
    import fastgen.engine.step.sampler as sampler_module
    sampler_module.apply_bitmask_ = timed_apply

    run(engine, prompts[:2], [fastgen.SamplingParams(max_new_tokens=8)] * 2)  # warm-up
    rounds = []
    for repeat in range(args.repeats):
        # Constrained and plain alternate, so a change of load on a shared machine lands on both.
        mask_seconds[0] = 0.0
        constrained = [fastgen.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0,
                                              seed=repeat * args.requests + i, structured_outputs=spec)
                       for i in range(args.requests)]
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, constrained)]
        seqs = [engine.sequences(rid)[0] for rid in ids]
        steps, started = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        c_seconds = time.perf_counter() - started
        lengths = [len(s.output_token_ids) for s in seqs]
        valid = sum(1 for s in seqs if _valid(s.stream.text))
        plain = [fastgen.SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=1.0, top_p=1.0, seed=i)
                 for i, n in enumerate(lengths)]
        p_seconds, p_tokens, p_steps = run(engine, prompts, plain)
        tokens = sum(lengths)
        rounds.append({"tokens": tokens, "valid_json": valid, "constrained_tok_s": tokens / c_seconds,
                       "unconstrained_tok_s": p_tokens / p_seconds,
                       "ratio": (tokens / c_seconds) / (p_tokens / p_seconds),
                       "constrained_tpot_ms": 1e3 * c_seconds / steps, "unconstrained_tpot_ms": 1e3 * p_seconds / p_steps,
                       "mask_ms_per_step": 1e3 * mask_seconds[0] / steps, "steps": [steps, p_steps]})
        r = rounds[-1]
        print(f"repeat {repeat}: constrained {r['constrained_tok_s']:.1f} tok/s (TPOT {r['constrained_tpot_ms']:.1f} ms, "
              f"mask {r['mask_ms_per_step']:.2f} ms/step), unconstrained {r['unconstrained_tok_s']:.1f} tok/s "
              f"(TPOT {r['unconstrained_tpot_ms']:.1f} ms): ratio {r['ratio']:.3f}, valid {valid}/{args.requests}",
              flush=True)
    result = {
        "model": engine.model_dir, "backend": args.backend, "requests": args.requests, "rounds": rounds,
        "ratio_mean": sum(r["ratio"] for r in rounds) / len(rounds),
        "ratio_median": statistics.median(r["ratio"] for r in rounds),
        "valid_json": f"{sum(r['valid_json'] for r in rounds)}/{args.requests * len(rounds)}",
        "compile_cold_ms": 1e3 * cold, "compile_cached_ms": 1e3 * cached,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    write_json(args.json, result)
    pipe.destroy()


def _valid(text: str) -> bool:
    try:
        import jsonschema
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:
        return False


if __name__ == "__main__":
    main()

"""The load `scripts/bench_serving.py` puts on a server, and what it makes of each request: closed-loop and
Poisson (open-loop) clients over streamed requests, per-request TTFT, TPOT, ITL and smoothed generation
rate, a level's summary, and the SLA derived from the unloaded level."""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from bench_common import latency_summary

SMOOTH_WINDOW = 8
"""Tokens over which a stream's generation rate is smoothed for the SLA (FastGen's method)."""


def one_request(client, prompt: list[int], out_len: int) -> dict:
    """Stream one request; returns its send time and (arrival time, tokens) per delta."""
    sent = time.perf_counter()
    deltas, prompt_len = [], len(prompt)
    for delta in client.stream([prompt], max_new_tokens=out_len, do_sample=False, ignore_eos=True):
        if delta.token_ids:
            deltas.append((time.perf_counter(), len(delta.token_ids)))
        prompt_len = delta.prompt_length or prompt_len
    return {"sent": sent, "deltas": deltas, "prompt_tokens": prompt_len}


def closed_loop(send, requests: list, concurrency: int) -> tuple[list[dict], float]:
    """`concurrency` threads, each sending its next request when the last one finished;
    `send(prompt, out_len)` runs one request and returns its record."""
    records: list[dict] = []
    lock, cursor = threading.Lock(), iter(requests)
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            with lock:
                item = next(cursor, None)
            if item is None:
                return
            try:
                rec = send(*item)
            except BaseException as exc:  # re-raised in the main thread
                errors.append(exc)
                return
            with lock:
                records.append(rec)

    return _run_threads([threading.Thread(target=worker, daemon=True) for _ in range(concurrency)], records, errors)


def poisson(client, requests: list, rate: float, seed: int) -> tuple[list[dict], float]:
    """Open loop: requests sent at exponential inter-arrival times of mean 1/rate seconds."""
    records: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    gaps = np.random.default_rng(seed).exponential(1 / rate, len(requests))

    def send(item) -> None:
        try:
            rec = one_request(client, *item)
        except BaseException as exc:
            errors.append(exc)
            return
        with lock:
            records.append(rec)

    threads = [threading.Thread(target=send, args=(item,), daemon=True) for item in requests]
    start = time.perf_counter()
    due = start
    for thread, gap in zip(threads, gaps):
        due += gap
        time.sleep(max(0.0, due - time.perf_counter()))
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return records, time.perf_counter() - start


def _run_threads(threads: list[threading.Thread], records: list[dict], errors: list) -> tuple[list[dict], float]:
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records, time.perf_counter() - start


def request_metrics(rec: dict) -> dict:
    """TTFT, TPOT, E2E, ITLs and the worst smoothed generation rate of one streamed request."""
    times = [t for t, n in rec["deltas"] for _ in range(n)]
    out = len(times)
    ttft, e2e = times[0] - rec["sent"], times[-1] - rec["sent"]
    itl = [b - a for (a, _), (b, _) in zip(rec["deltas"], rec["deltas"][1:])]
    windows = [SMOOTH_WINDOW / max(times[i + SMOOTH_WINDOW] - times[i], 1e-9) for i in range(out - SMOOTH_WINDOW)]
    whole = (out - 1) / max(e2e - ttft, 1e-9) if out > 1 else float("inf")
    return {"ttft": ttft, "tpot": (e2e - ttft) / (out - 1) if out > 1 else 0.0, "e2e": e2e, "itl": itl,
            "output_tokens": out, "prompt_tokens": rec["prompt_tokens"], "min_rate": min(windows, default=whole)}


def summarise(records: list[dict], seconds: float, sla: dict | None) -> dict:
    """Latency summaries, throughputs and (given an SLA) the effective throughput of one level."""
    m = [request_metrics(r) for r in records]
    out_tokens = sum(x["output_tokens"] for x in m)
    total = out_tokens + sum(x["prompt_tokens"] for x in m)
    row = {"requests": len(m), "seconds": seconds, "requests_per_s": len(m) / seconds,
           "output_tokens_per_s": out_tokens / seconds, "total_tokens_per_s": total / seconds,
           "ttft": latency_summary([x["ttft"] for x in m]), "tpot": latency_summary([x["tpot"] for x in m]),
           "itl": latency_summary([g for x in m for g in x["itl"]]), "e2e": latency_summary([x["e2e"] for x in m])}
    if sla is not None:
        met = [x["ttft"] <= x["prompt_tokens"] / sla["prompt_tokens_per_s"] and x["min_rate"] >= sla["gen_tokens_per_s"]
               for x in m]
        row["sla_fraction_met"] = sum(met) / len(met)
        row["effective_requests_per_s"] = row["requests_per_s"] * row["sla_fraction_met"]
    return row


def derive_sla(records: list[dict], args: argparse.Namespace) -> dict:
    """The SLA from the flags, or from the unloaded (concurrency-1) speeds times --sla-fraction."""
    m = [request_metrics(r) for r in records]
    prefill = float(np.median([x["prompt_tokens"] / x["ttft"] for x in m]))
    decode = float(np.median([1 / x["tpot"] for x in m if x["tpot"] > 0]))
    return {"prompt_tokens_per_s": args.sla_prompt_rate or prefill * args.sla_fraction,
            "gen_tokens_per_s": args.sla_gen_rate or decode * args.sla_fraction,
            "unloaded_prefill_tokens_per_s": prefill, "unloaded_decode_tokens_per_s": decode,
            "fraction": args.sla_fraction, "smoothing_window_tokens": SMOOTH_WINDOW}

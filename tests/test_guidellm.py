"""guidellm 0.8.1, unmodified, benchmarking the real server: its default streaming benchmark
(chat completions with `stream_options: {include_usage, continuous_usage_stats}`, `ignore_eos`,
`max_completion_tokens`) on synthetic data with a local tokenizer, offline, for a few seconds
at a synchronous rate, then the same against `/v1/completions`. Every request must succeed, and the
token counts guidellm read from the streamed usage must be exact.

guidellm 0.8.1 spells the brief's `guidellm benchmark --target URL --rate-type synchronous
--max-seconds 5 --data prompt_tokens=16,output_tokens=8 --processor DIR` as `guidellm run` with
`kind=` options. It comes with the `compat` extra (`make test` installs it); without it the test
is skipped.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from rest_server import serve

pytestmark = pytest.mark.skipif(importlib.util.find_spec("guidellm") is None,
                                reason="guidellm is not installed: pip install -e '.[compat]' (guidellm==0.8.1)")

MODEL = "tiny-llama"
ENGINE = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
OUTPUT_TOKENS = 8


def _guidellm(served, tokenizer: str, report: str, seconds: int, request_format: str | None = None) -> str:
    """Run one synchronous benchmark against `served`; returns what guidellm printed."""
    backend = f"kind=openai_http,target={served.url}" + (f",request_format={request_format}" if request_format else "")
    cmd = [sys.executable, "-m", "guidellm", "run", "--backend", backend, "--profile", "kind=synchronous",
           "--constraint", f"kind=max_duration,seconds={seconds}",
           "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "200"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as exc:
        printed = (exc.stdout or b"")[-3000:].decode(errors="replace") + (exc.stderr or b"")[-3000:].decode(
            errors="replace")
        raise AssertionError(f"guidellm did not finish; server: {served.engine.stats()}, "
                             f"pending {served.app.state.gateway.pending}\n{printed}") from None
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _check_report(report: str) -> int:
    with open(report) as f:
        (benchmark,) = json.load(f)["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] <= 1, totals  # the last may be cut by the deadline
    assert totals["successful"] >= 5, totals
    outputs = metrics["output_token_count"]["successful"]
    assert outputs["min"] == outputs["max"] == OUTPUT_TOKENS  # ignore_eos held, usage counted every token
    assert metrics["time_to_first_token_ms"]["successful"]["count"] == totals["successful"]
    return totals["successful"]


def test_guidellm_default_benchmark_runs_without_errors(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["llama"]
    with serve(checkpoint, MODEL, ENGINE) as served:
        chat = _guidellm(served, checkpoint, str(tmp_path / "chat.json"), 5)
        text = _guidellm(served, checkpoint, str(tmp_path / "text.json"), 3, "/v1/completions")
        served.wait_idle()
    print("guidellm, default (chat completions):\n" + chat[chat.find("Run Summary Info") - 2:])
    print("guidellm, /v1/completions:\n" + text[text.find("Run Summary Info") - 2:])
    assert _check_report(str(tmp_path / "chat.json")) and _check_report(str(tmp_path / "text.json"))

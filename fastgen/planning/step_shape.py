"""How large a step is: the token budget, a prompt chunk's attention charge against it, the CUDA-graph
buckets and the KV block size, with the machine rates they rest on. `fastgen.planning.policy` asks
these for its `Plan`; each returns its choice and the reason that quotes the figures behind it.
"""

from __future__ import annotations

import torch

from fastgen.planning.hardware import Hardware
from fastgen.planning.model_facts import ModelFacts
from fastgen.planning.plan import dtype_name, format_count

FASTGEN_TOKEN_BUDGET = 768  # FastGen's max_ragged_batch_size
FASTGEN_MAX_SEQS = 512  # FastGen's max_ragged_sequence_count
# Matmul GFLOP/s per core of an AVX-512-BF16 CPU without AVX512-FP16: 410 bf16, 185 fp32, 3 fp16 on 2 cores
# (measured with torch matmuls on the 2-core development hosts).
CPU_GFLOPS_PER_CORE = {"bfloat16": 205.0, "float32": 92.5, "float16": 1.5}
# bf16 on a CPU with AMX tiles: 1798-2071 GFLOP/s on 2 cores of the development Xeon (2048^3, best of 8 medians).
CPU_AMX_BF16_GFLOPS_PER_CORE = 900.0
# Batch-1 decode streams weights at ~22-25 GB/s on 2 cores of this CPU class (measured: weight bytes x tok/s); like
# the matmul rate, taken to scale with cores, so the ratio of the two (what the budget floor rests on) does not.
CPU_WEIGHT_STREAM_GBPS_PER_CORE = 11.5
# FastGen's SLA tiers ask >= 2, 4 or 6 tokens/s per stream: a full step must stay under 0.5 s.
CPU_STEP_TARGET_S = 0.5
# An offline batch on a CPU is judged by its total throughput: steps of a few hundred rows keep the
# matmuls near their peak and pay the per-step, per-layer costs (attention calls, Python) fewer times,
# although such a step outlasts the 0.5 s target. Measured with scripts/bench_peer.py (SmolLM2-135M, fp32,
# 128 requests): larger steps than 512 gained nothing there; on a CPU fast enough to fit more than FastGen's
# 768 tokens in the step target, steps up to 2048 tokens gained 11% (bf16 on AMX), 4096 nothing more.
CPU_OFFLINE_TOKEN_BUDGET = 512
CPU_OFFLINE_MAX_TOKEN_BUDGET = 2048
OFFLINE_BUDGET_EVIDENCE = ("on a 2-core EPYC SmolLM2-135M (fp32, 128 requests) made 190 tok/s with 128-token steps, "
                           "227-264 with 512, 249 with 768 and 255 with 2048")
FAST_OFFLINE_BUDGET_EVIDENCE = ("on a 2-core AMX Xeon SmolLM2-135M (bf16, 128 requests) made 1218-1242 tok/s with "
                                "512-token steps, 1298 with 1024, 1379-1383 with 2048 and 1384 with 4096")
SPLITFUSE_CHARGE_EVIDENCE = (
    "Both run at about one rate in a chunk step (AMX Xeon, bf16, a 248-token chunk of a 15M model: linears "
    "~0.57 TFLOP/s, attention over 1860 positions ~0.54), and the charge took that model's p99 inter-token "
    "latency from 3.71x to 4.04x and 4.21x below whole-prompt steps at a 256-token budget, at -3.8% and -2.9% "
    "throughput against them (-1.1% without the charge; scripts/bench_splitfuse.py)")
# Every step streams all weights once; the budget keeps that under 10% of a step's matmul time.
CPU_STREAM_SHARE = 0.1
A100_BF16_TFLOPS = 312.0  # the GPU FastGen's 768-token budget was tuned on (dense bf16 spec)
H200_BF16_TFLOPS = 790.0  # measured on an H200: 8192^3 bf16 torch matmuls, random data


def cpu_gflops(hw: Hardware, dtype_name: str) -> float:
    """Matmul GFLOP/s of this CPU in `dtype_name`: measured if available, else per-core figures."""
    if dtype_name in hw.matmul_gflops:
        return hw.matmul_gflops[dtype_name]
    per_core = dict(CPU_GFLOPS_PER_CORE)
    if "avx512f" not in hw.cpu_flags:
        per_core["float32"] /= 2  # AVX2 has half AVX-512's vector width
    if "amx_bf16" in hw.cpu_flags:
        per_core["bfloat16"] = CPU_AMX_BF16_GFLOPS_PER_CORE
    elif "avx512_bf16" not in hw.cpu_flags:
        per_core["bfloat16"] = per_core["float32"]  # converted to fp32 in software at best
    if "amx_fp16" in hw.cpu_flags:
        per_core["float16"] = per_core["bfloat16"]  # AMX tiles run fp16 at the bf16 rate
    elif "avx512_fp16" in hw.cpu_flags:
        per_core["float16"] = per_core["float32"]  # measured on such a host: fp16 ~ fp32, bf16 ~3-5x faster
    return per_core[dtype_name] * hw.cpu_cores


def cpu_rates(hw: Hardware) -> str:
    """The CPU's bf16 / fp32 / fp16 matmul rates as a reason quotes them, with their source."""
    rates = "/".join(f"{cpu_gflops(hw, name):.3g}" for name in ("bfloat16", "float32", "float16"))
    source = ("measured here" if hw.matmul_gflops
              else f"{hw.cpu_cores} cores x the per-core rates of its AVX512-BF16 or AMX units")
    return f"~{rates} GFLOP/s in bf16/fp32/fp16 ({source})"


def choose_token_budget(model: ModelFacts, hw: Hardware, dtype: torch.dtype, offline: bool) -> tuple[int, str]:
    """CPU: the largest step that stays near 0.5 s when serving, at least 512 tokens for an offline batch;
    GPU: FastGen's 768, scaled up on Hopper-class FLOP/s."""
    if hw.device_type == "cpu":
        rate = cpu_gflops(hw, dtype_name(dtype))
        flop_per_token = 2 * model.active_params
        fits = int(CPU_STEP_TARGET_S * rate * 1e9 / flop_per_token)
        full = FASTGEN_TOKEN_BUDGET * flop_per_token / (rate * 1e9)
        source = "measured" if dtype_name(dtype) in hw.matmul_gflops else f"{hw.cpu_cores} cores"
        head = (f"{FASTGEN_TOKEN_BUDGET} tokens x 2 x {format_count(model.active_params)} params / {rate:.0f} GFLOP/s "
                f"({dtype_name(dtype)}, {source}) = {full:.2g} s per step")
        fits_power = 1 << (max(fits, 1).bit_length() - 1)  # budgets are powers of two other than FastGen's 768
        if fits >= FASTGEN_TOKEN_BUDGET and offline:
            budget = max(FASTGEN_TOKEN_BUDGET, min(fits_power, CPU_OFFLINE_MAX_TOKEN_BUDGET))
            return budget, (f"an offline batch, judged by its total throughput: {head}; a {CPU_STEP_TARGET_S} s "
                            f"step fits {fits} tokens; {FAST_OFFLINE_BUDGET_EVIDENCE}")
        if fits >= FASTGEN_TOKEN_BUDGET:
            return FASTGEN_TOKEN_BUDGET, f"FastGen's default: {head}, within the {CPU_STEP_TARGET_S} s step target"
        if offline:
            return max(CPU_OFFLINE_TOKEN_BUDGET, fits_power), (
                f"an offline batch, judged by its total throughput, not by step latency: {head}; "
                f"{OFFLINE_BUDGET_EVIDENCE}")
        # Weight streaming per step (bytes / GB/s) <= 10% of the matmul time (tokens x 2 x params / rate).
        itemsize = torch.empty((), dtype=dtype).element_size()
        stream = CPU_WEIGHT_STREAM_GBPS_PER_CORE * hw.cpu_cores
        least = rate * itemsize / (2 * stream * CPU_STREAM_SHARE)
        floor = min(FASTGEN_TOKEN_BUDGET, 1 << (int(least) - 1).bit_length())
        budget = max(floor, fits_power)
        why = f"{head}; a {CPU_STEP_TARGET_S} s step (FastGen's 2 tokens/s SLA) fits {fits} tokens"
        if budget == floor and fits < floor:
            why += (f"; floored at {floor} so re-streaming the weights each step (~{stream:.0f} GB/s) "
                    f"stays under {CPU_STREAM_SHARE:.0%} of its time")
        return budget, why
    cc = min(g.compute_capability for g in hw.gpus)
    if cc >= (9, 0):
        scaled = FASTGEN_TOKEN_BUDGET * H200_BF16_TFLOPS / A100_BF16_TFLOPS
        return 2048, (f"Hopper-class: {H200_BF16_TFLOPS:.0f} TFLOP/s bf16 (H200, measured) vs the A100's "
                      f"{A100_BF16_TFLOPS:.0f} FastGen tuned {FASTGEN_TOKEN_BUDGET} on; {scaled:.0f} tokens keep its "
                      "step time, rounded to 2048")
    return FASTGEN_TOKEN_BUDGET, f"FastGen's default ({FASTGEN_TOKEN_BUDGET}), tuned on A100-class GPUs"


def choose_context_charge(model: ModelFacts, offline: bool) -> tuple[int, str]:
    """Serving: the attended positions whose attention FLOPs (4 x heads x head_dim a layer) equal one token's
    linear FLOPs (2 x a layer's active parameters); an offline batch: no charge. The Scheduler counts every
    earlier position, also for sliding-window layers, which attend at most their window: past the window a
    chunk of such a model is charged more than it costs, so its chunks there are shorter than they need be."""
    if offline:
        return 0, ("an offline batch is judged by its total throughput, not by step latency: a prompt chunk "
                   "spends its tokens only (fewer, longer steps)")
    per_layer = (model.active_params - model.vocab_size * model.hidden_size) // model.num_layers
    context = max(1, per_layer // (2 * model.num_heads * model.head_dim))
    return context, (f"a layer's linears take 2 x {format_count(per_layer)} FLOPs a token, attention 4 x "
                     f"{model.num_heads} heads x {model.head_dim} a position: {context} positions cost one token. "
                     f"{SPLITFUSE_CHARGE_EVIDENCE}")


def choose_buckets(hw: Hardware, budget: int) -> tuple[tuple[int, ...], str]:
    """CPU: none (one symbolic-shape compile serves every step); GPU: vLLM's capture sizes, then powers of two."""
    powers = [1 << i for i in range(budget.bit_length()) if 1 << i <= budget]
    if hw.device_type == "cpu":
        return (), ("none on a CPU: with no CUDA graph to capture, a bucket only pays for padding; steps run at "
                    "their exact size and the decoder layer compiles once, with symbolic token and sequence counts")
    vllm = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
    sizes = sorted({s for s in vllm if s <= budget} | {p for p in powers if p > 512} | {budget})
    return tuple(sizes), (f"vLLM's capture sizes (pad <= 7 tokens to 256, <= 15 to 512), then powers of two and "
                          f"the budget: {len(sizes)} compiles + captures at start (pass fewer buckets to start faster)")


def choose_block_size(model: ModelFacts) -> tuple[int, str]:
    """FastGen's rule: 64-token blocks for head size 128, 128 for head size <= 64."""
    if model.head_dim <= 64:
        return 128, f"FastGen's rule: 128-token blocks for head_dim {model.head_dim} <= 64"
    return 64, f"FastGen's rule: 64-token blocks for head_dim {model.head_dim} > 64"

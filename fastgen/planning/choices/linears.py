"""How a plan's linears run, and so whether Inductor has anything left to fuse: oneDNN's prepacked weights
(`weight_prepack`), the copies that steps of few rows multiply instead (`gemv_weights`), and `compile`.
The figures quoted are measured on the development machines, as each constant says."""

from __future__ import annotations

import torch

from fastgen.ops.packed_linear import PREPACK_DTYPES, prepack_available
from fastgen.planning.hardware import Hardware, cpu_kernel_blocker
from fastgen.planning.model_facts import ModelFacts
from fastgen.planning.plan import dtype_name, format_bytes, format_count

CPU_COMPILE_MIN_PARAMS = 50_000_000
"""Below this size a CPU step takes milliseconds and is mostly Python and attention bookkeeping
that Inductor cannot fuse away. scripts/bench_graphs.py on a 5M-parameter Llama (the demo model's
shape, 2 cores, buckets 1..256) measured compiled/eager step-time ratios of 1.09-1.31x and decode
tokens/s 1.16-1.53x higher, for 6-10 s of cold compile per bucket (about 1 s with Inductor's warm
cache): a cold start of a minute or more to save a few milliseconds per step."""


PREPACKED_COMPILE_EVIDENCE = (
    "the linears run oneDNN-packed (weight_prepack), so Inductor would only fuse the elementwise glue between them: "
    "measured at most 5% more tok/s for 2-2.5x the start-up (scripts/bench_peer.py, 2-core EPYC, fp32, 128 requests: "
    "SmolLM2-135M 240 vs 228 tok/s at 512-token steps and 249 vs 249 at 768, ready in 21.7 s vs 8.5 s; a 0.5B Llama "
    "78 vs 82 tok/s, 25.1 s vs 11.7 s); compile='default' to opt in")
"""Why a CPU plan with prepacked linears does not compile."""

KERNEL_LINEARS_COMPILE_EVIDENCE = (
    "the int4/int8 linears run on fastgen's C++ kernels (and a step of few rows runs each layer as one C++ call), so "
    "Inductor would only fuse the elementwise glue between them: measured 0.94-0.99x the compiled plan's tok/s for "
    "half the start-up (scripts/bench_peer.py, 2-core EPYC, SmolLM2-135M bf16, 128 requests: int4 1403-1500 vs "
    "1499-1545 tok/s, int8 1382 vs 1352; ready in 4.2-5.7 s vs 9.2-14.5 s warm, 26.8 s vs 43.4 s with every cache "
    "empty; batch-1 decode runs the C++ layer op either way); compile='default' to opt in")
"""Why a CPU plan whose quantized linears run on fastgen's kernels does not compile."""


def choose_compile(model: ModelFacts, hw: Hardware, prepack: bool, kernel_linears: bool) -> tuple[str, str]:
    """Inductor's default mode; max-autotune only on request (its GEMM search costs minutes per bucket).
    Off on the CPU for small models, where start-up would dwarf the gain, and where the linears run
    prepacked or (`kernel_linears`) quantized on fastgen's kernels, which leaves Inductor only elementwise glue
    to fuse (all measured, see above)."""
    if hw.device_type == "cpu":
        if model.num_params < CPU_COMPILE_MIN_PARAMS:
            return "off", (f"{format_count(model.num_params)} params on a CPU: steps take milliseconds; compiling "
                           "measured 1.1-1.3x faster steps (5M-param Llama, bench_graphs.py) for 6-10 s of cold "
                           "compile per bucket, so not worth the start-up (compile='default' to opt in)")
        if prepack:
            return "off", PREPACKED_COMPILE_EVIDENCE
        if kernel_linears:
            return "off", KERNEL_LINEARS_COMPILE_EVIDENCE
        return "default", ("Inductor C++ fuses norms, rotary, residual adds and the MLP; each bucket compiles once "
                           "(seconds each, cached on disk by Inductor for the next start)")
    return "default", ("Inductor fuses norms, rotary, residual adds and the MLP; max-autotune benchmarks GEMM "
                       "configs per bucket (minutes of start-up), so only when asked")


def prepack_blocker(hw: Hardware, dtype: torch.dtype, quant: str, offload: str) -> str | None:
    """Why weight prepacking cannot apply here (None: it can)."""
    if hw.device_type != "cpu":
        return "oneDNN's packed linear is a CPU kernel"
    if not prepack_available():
        return "this torch build has no oneDNN"
    if dtype not in PREPACK_DTYPES:
        return (f"oneDNN's packed linear takes {' or '.join(map(dtype_name, PREPACK_DTYPES))} weights, "
                f"not {dtype_name(dtype)}")
    if dtype == torch.bfloat16 and not {"avx512_bf16", "amx_bf16"} & hw.cpu_flags:
        return "oneDNN packs bf16 weights only on CPUs with AVX512-BF16 or AMX (this one emulates bf16 matmuls)"
    if quant != "none":
        return f"the {quant} linears run their own packed kernels"
    if offload != "none":
        return "offload streams the layers' plain weights"
    return None


def choose_weight_prepack(blocker: str | None) -> tuple[bool, str]:
    """On wherever nothing blocks it (`prepack_blocker`): CPU fp32, and bf16 on CPUs with bf16 instructions."""
    if blocker is not None:
        return False, blocker
    return True, ("oneDNN multiplies a weight reordered once at load instead of re-blocking it every call: 1.2-1.9x "
                  "MKL's F.linear at 8-512 rows (2-core EPYC, fp32)")


GEMV_COPY_SHARE = 0.1
"""The plain weights are kept beside the packed ones by default while they take at most this share of the
available RAM."""


TILE_DTYPES = (torch.bfloat16, torch.float32)
"""Weight dtypes fastgen's C++ GEMV kernels keep in their column tiles (`gemv_weights`)."""


def kernel_tiles(hw: Hardware, dtype: torch.dtype) -> bool:
    """Whether `gemv_weights` keeps tiles for fastgen's C++ GEMV kernels (where they build) rather than plain
    weights."""
    return dtype in TILE_DTYPES and cpu_kernel_blocker(hw) is None


def gemv_copy_bytes(model: ModelFacts, dtype: torch.dtype, tiles: bool = False) -> int:
    """Bytes `gemv_weights` keeps besides the packed weights: the decoder layers' plain weights (or, `tiles`, their
    copies in fastgen's GEMV kernels' layout), and the LM head's (a tied head's plain weight is the embedding's,
    kept anyway; its tiles are a copy)."""
    head = 0 if model.config.tie_word_embeddings and not tiles else model.head_weight_bytes(dtype)
    return model.layer_weight_bytes(dtype) + head


def choose_gemv_weights(model: ModelFacts, hw: Hardware, dtype: torch.dtype, prepack: bool) -> tuple[bool, str]:
    """On with prepacking while the copies take at most `GEMV_COPY_SHARE` of the available RAM: bf16 or fp32 weights
    in fastgen's C++ kernel layout where it runs, else the plain weights, except for bf16 weights on a CPU with bf16
    dot products (AVX512-BF16, AMX) and no C++ kernel, which oneDNN's packed kernel uses."""
    if not prepack:
        return False, "weight_prepack is off: every linear multiplies its plain weight"
    tiles = kernel_tiles(hw, dtype)
    native = sorted(hw.cpu_flags & {"avx512_bf16", "amx_bf16"})
    if dtype == torch.bfloat16 and native and not tiles:
        return False, (f"bf16 weights on a CPU with {' and '.join(native)}: oneDNN's packed kernel multiplies them "
                       "with bf16 dot products at 1.5-3x the GB/s of the plain-weight GEMV path at 1-8 rows "
                       "(2-core EPYC with avx512_bf16, SmolLM2-135M's shapes: batch-1 decode 41 -> 25 ms a step)")
    copy = gemv_copy_bytes(model, dtype, tiles)
    if copy > GEMV_COPY_SHARE * hw.ram_available:
        return False, (f"the copies would take {format_bytes(copy)}, over {GEMV_COPY_SHARE:.0%} of the "
                       f"{format_bytes(hw.ram_available)} of RAM available (gemv_weights=True to keep them anyway)")
    if tiles and dtype == torch.bfloat16:
        return True, (f"steps of at most 4 rows multiply over copies of the bf16 weights in fastgen's C++ kernel "
                      f"layout ({format_bytes(copy)} more; 16 output columns interleaved, pair dots in lanes): "
                      "~31 GB/s read against oneDNN's ~18 and ATen's mv ~10 (2-core EPYC, SmolLM2-135M's shapes)")
    if tiles:
        return True, (f"steps of at most 4 rows multiply over copies of the fp32 weights in fastgen's C++ kernel "
                      f"layout ({format_bytes(copy)} more; 16 output columns interleaved, each column's sum in its "
                      f"own lane): ~32 GB/s read against the grouped bmm's ~29 over SmolLM2-135M's 30 layers, and the "
                      "decode-layer op takes such layers whole: batch-1 fp32 decode 41 -> 64-67 tok/s (2-core EPYC "
                      "with AVX-512)")
    return True, (f"steps of at most 4 rows multiply over the plain weights ({format_bytes(copy)} more) with their "
                  "output rows split over the cores: 1.4-2x oneDNN's packed kernel, which runs them on one core "
                  "(2-core EPYC, fp32)")

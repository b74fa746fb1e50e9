"""The plan's `lm_head_quantization`: whether the LM head is held in GGUF's Q8_0 (`fastgen.models.q8_head`),
and what it then takes beside the weights."""

from __future__ import annotations

from typing import Any

import torch

from fastgen.models.q8_head import Q8_MAX_ROWS
from fastgen.ops.cpu_kernels.q8 import BLOCK
from fastgen.planning.hardware import Hardware, cpu_kernel_blocker
from fastgen.planning.model_facts import ModelFacts


def q8_head_bytes(model: ModelFacts) -> int:
    """Bytes of the LM head in Q8_0: an int8 per weight and an fp16 scale per block of 32."""
    return model.vocab_size * model.hidden_size * (BLOCK + 2) // BLOCK


def _blocker(model: ModelFacts, hw: Hardware) -> str | None:
    """Why this machine or model cannot hold the head in Q8_0 (None: it can)."""
    if hw.device_type != "cpu":
        return f"its kernel is fastgen's C++ CPU kernel, and this plan is for {hw.device_type}"
    if model.hidden_size % BLOCK:
        return f"Q8_0 blocks are {BLOCK} inputs wide and the hidden size is {model.hidden_size}"
    return cpu_kernel_blocker(hw)


def choose_lm_head_quantization(model: ModelFacts, hw: Hardware, user: dict[str, Any], dtype: torch.dtype,
                                quantization: str) -> tuple[str, str]:
    """`lm_head_quantization` and its reason: Q8_0 where the decoder's linears are quantized and the kernel
    runs here, the plan dtype otherwise; ValueError for a user's "q8_0" that cannot run here."""
    blocker = _blocker(model, hw)
    if user.get("lm_head_quantization") == "q8_0":
        if blocker is not None:
            raise ValueError(f"lm_head_quantization='q8_0' cannot apply: {blocker}")
        return "q8_0", "set by the user"
    if "lm_head_quantization" in user:
        return "none", "set by the user"
    if blocker is not None:
        return "none", f"the plan dtype: Q8_0 cannot apply ({blocker})"
    if quantization == "none":
        return "none", ("the plan dtype, as the decoder's linears (lm_head_quantization='q8_0' holds it in Q8_0, "
                        "1.06 bytes a weight, for batch-1 decode)")
    return "q8_0", (f"the decoder's linears are {quantization}: the head in Q8_0 reads 1.06 bytes a weight "
                    f"instead of {torch.empty((), dtype=dtype).element_size()} at batch 1, as llama.cpp holds a "
                    "quantized file's output layer (2-core EPYC, SmolLM2-135M batch-1 decode: int8 30.9 -> 43.2 "
                    f"tok/s, int4 47.9 -> 51.0); its plain weight stays for steps of more than {Q8_MAX_ROWS} "
                    "sampled rows")

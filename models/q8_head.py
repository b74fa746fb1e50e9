"""The LM head in GGUF's Q8_0 layout (`lm_head_quantization="q8_0"`), multiplied by fastgen's C++ CPU kernel.

A batch-1 decode step on a CPU reads every weight once, and a small model's LM head is a large share of
them: SmolLM2-135M's tied 49152 x 576 head is 57 MB in bf16 against 54 MB for all 30 layers in int4. In
Q8_0 (int8 values in blocks of 32, one fp16 scale each) it is 30 MB, and each hidden row is quantized to
Q8_0 too, so the dot products run on int8 pairs: what llama.cpp computes for a GGUF file whose output layer
is Q8_0, as SmolLM2's Q4_1 file's is. The head is quantized once, after the weights are loaded.

The int8 dot products pay off while the weight's read dominates: up to `Q8_MAX_ROWS` hidden rows a call.
Above it the head multiplies its plain weight (kept: a tied head's is the embedding's anyway), whose GEMM
computes faster. 2-core EPYC (AVX512-VNNI), 49152 x 576, ms a call, Q8_0 / bf16: 1 row 1.5 / 5.2, 4 rows
2.3 / 4.2, 8 rows 4.0 / 5.3, 16 rows 7.0 / 6.5, 64 rows 29 / 14.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from fastgen.models.parallel import ParallelLMHead
from fastgen.ops.cpu_kernels import active_op
from fastgen.ops.cpu_kernels.q8 import cpu_q8_matmul, pack_q8_0, quantize_q8_0

logger = logging.getLogger("fastgen")

LM_HEAD_QUANTIZATIONS = ("none", "q8_0")
"""`lm_head_quantization` settings: the plan dtype, or GGUF's Q8_0."""

Q8_MAX_ROWS = 8
"""Most hidden rows a call multiplies in Q8_0; more take the plain weight (see the table above)."""


class Q8LMHead(nn.Module):
    """A loaded `ParallelLMHead` (this rank's vocabulary rows) held in Q8_0 beside its plain weight; `logits`
    as the head's."""

    def __init__(self, head: ParallelLMHead) -> None:
        super().__init__()
        self.tp = head.tp
        self.vocab_size = head.vocab_size
        self.in_features, self.out_features = head.in_features, head.out_features
        values, scales = pack_q8_0(*quantize_q8_0(head.weight))
        self.register_buffer("qweight", values, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        # The plain weight (a tied head's is the embedding's), for calls of more than Q8_MAX_ROWS rows.
        self.weight = head.weight
        self.bias = head.bias

    def extra_repr(self) -> str:
        """Sizes shown by `print(model)`."""
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary rows of the logits, in fp32."""
        flat = hidden.reshape(-1, self.in_features)
        if flat.shape[0] > Q8_MAX_ROWS:
            return F.linear(hidden, self.weight, self.bias).float()
        out = cpu_q8_matmul(flat, self.qweight, self.scales, self.out_features)
        if out is None:
            raise RuntimeError("the Q8_0 LM head needs fastgen's C++ CPU kernels, which are off or failed to build "
                               "since the engine started (FASTGEN_CPU_KERNELS)")
        if self.bias is not None:
            out += self.bias
        return out.view(*hidden.shape[:-1], self.out_features)

    # The head's own gather-to-rank-0 and fp32 cast, over this module's `forward`.
    logits = ParallelLMHead.logits


@torch.no_grad()
def quantize_lm_head(model: nn.Module) -> bool:
    """Replace the loaded model's LM head by a `Q8LMHead`, in place; False, with one log line and the head
    left as it is, where the C++ CPU kernels cannot run (no compiler, `FASTGEN_CPU_KERNELS=off`)."""
    if active_op("q8_matmul") is None:
        logger.warning("lm_head_quantization='q8_0' needs fastgen's C++ CPU kernels, which cannot run here: the LM "
                       "head keeps its dtype")
        return False
    for name, module in list(model.named_modules()):
        if isinstance(module, ParallelLMHead):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Q8LMHead(module))
    return True

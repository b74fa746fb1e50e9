"""RMSNorm against Hugging Face's `LlamaRMSNorm`, bit for bit: the fp32 path takes torch's one-call
`F.rms_norm`, the others HF's own cast-normalise-cast sequence."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fastgen.models.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (512, 64), (3, 9, 64)])
def test_rms_norm_equals_hf_bitwise(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    dim, eps = shape[-1], 1e-5
    ours, hf = RMSNorm(dim, eps), LlamaRMSNorm(dim, eps)
    weight = torch.randn(dim) * 0.5 + 1.0
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    # Rows of very different scales, so a change of summation order or of where eps enters shows.
    x = (torch.randn(shape) * torch.logspace(-3, 3, shape[-2]).unsqueeze(-1)).to(dtype)
    with torch.inference_mode():
        got, want = ours(x), hf(x)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)

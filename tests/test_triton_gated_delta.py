"""The Triton decode step of Gated DeltaNet against the torch one (itself checked against HF's in
test_gated_delta.py), with grouped value heads, head sizes that are not powers of two, rows on
scattered slots and untouched slots left as they were.

On the CPU the kernel runs through the Triton interpreter; with `FASTGEN_TRITON_DEVICE=cuda`
(scripts/device_check.sh, on a GPU machine) it runs compiled, on the GPU.
"""

import os

DEVICE = os.environ.get("FASTGEN_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is defined (on its module's import, below)

import pytest  # noqa: E402
import torch  # noqa: E402

from fastgen.ops.gated_delta import gating, recurrent_gated_delta_step  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 16, 8), (3, 3, 12, 20)])
def test_triton_decode_step_equals_torch(shape, dtype):
    from fastgen.ops.triton_gated_delta import triton_recurrent_gated_delta_step

    hk, hv, dk, dv = shape
    rows, slots = 3, 6
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(rows, hk, dk, generator=gen), torch.randn(rows, hk, dk, generator=gen)
    v = torch.randn(rows, hv, dv, generator=gen) * 2
    g, beta = gating(torch.randn(rows, hv, generator=gen) * 2, torch.randn(rows, hv, generator=gen) * 2,
                     torch.rand(hv, generator=gen), torch.randn(hv, generator=gen))
    pool = torch.randn(slots, hv, dk, dv, generator=gen)
    row_slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    expected_pool = pool.clone()
    expected = recurrent_gated_delta_step(q, k, v, g, beta, expected_pool, row_slots)
    pool, q, k, v, g, beta, row_slots = (t.to(DEVICE) for t in (pool, q, k, v, g, beta, row_slots))
    got = triton_recurrent_gated_delta_step(q, k, v, g, beta, pool, row_slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(pool.cpu(), expected_pool, atol=1e-5, rtol=1e-5)  # untouched slots too


def test_triton_decode_step_refuses_a_pool_it_cannot_address():
    from fastgen.ops.triton_gated_delta import triton_recurrent_gated_delta_step

    q = torch.randn(1, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="fp32 state pool"):
        triton_recurrent_gated_delta_step(q, q, torch.randn(1, 2, 4, device=DEVICE), torch.zeros(1, 2, device=DEVICE),
                                          torch.ones(1, 2, device=DEVICE),
                                          torch.zeros(3, 2, 8, 4, dtype=torch.bfloat16, device=DEVICE),
                                          torch.zeros(1, dtype=torch.int32, device=DEVICE))

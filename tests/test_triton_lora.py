"""The Triton LoRA delta (shrink + per-section expand) against each row's own x @ A^T @ B in float64.

Stacks are built as `LoRALinear` builds them: B zero off each output section's own ranks, the last rank
of every section zero in A too (an adapter of lower rank than the stack). Cases cover uneven rows per
slot with base rows between, one slot only, no adapted row at all, merged sections of odd widths, input
widths off the block, several rank, input and output blocks, and an output that is a column slice of a
wider tensor. Rows without an adapter, and columns outside the output slice, must come back bit for bit.

On the CPU the kernels run through the Triton interpreter; with `FASTGEN_TRITON_DEVICE=cuda`
(scripts/device_check.sh, on a GPU machine) they run compiled, on the GPU.
"""

import os

DEVICE = os.environ.get("FASTGEN_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (on their module's import, below)

import pytest  # noqa: E402
import torch  # noqa: E402

NUM_SLOTS = 4
UNEVEN = [2, 2, -1, 0, 2, -1, -1, 3, 2, 0]
"""Slot 2 on four rows, 0 on two, 3 on one, 1 on none; base rows between."""


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-4)
    return dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-3)


def _stacks(rank: int, d_in: int, sections: list[int], dtype: torch.dtype, seed: int,
            off_section: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`a[slots, R, in]` and `b[slots, R, out]` with B set to `off_section` off each section's own ranks and
    the last rank of each section zero in A."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, rank, d_in, generator=gen) * 0.5
    b = torch.randn(NUM_SLOTS, rank, sum(sections), generator=gen) * 0.5
    per = rank // len(sections)
    for j, size in enumerate(sections):
        start = sum(sections[:j])
        b[:, :j * per, start:start + size] = off_section
        b[:, (j + 1) * per:, start:start + size] = off_section
        a[:, (j + 1) * per - 1] = 0
    return a.to(dtype), b.to(dtype)


def _expected(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Row by row in float64; base rows as they are. `b` NaN off the sections reads as its zeros."""
    b = torch.nan_to_num(b.double(), nan=0.0)
    rows = [base[t].double() + (x[t].double() @ a[s].double().t() @ b[s] if s >= 0 else 0) for t, s in enumerate(slots)]
    return torch.stack(rows) if rows else base.double()


def _run(slots: list[int], sections: list[int], d_in: int, dtype: torch.dtype, *, rank: int = 12, seed: int = 0,
         off_section: float = 0.0) -> None:
    """One call on `DEVICE` against the float64 rows; rows of slot -1 must keep the base bit for bit."""
    from fastgen.ops.triton_lora import triton_lora_delta

    a, b = _stacks(rank, d_in, sections, dtype, seed, off_section)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(slots), d_in, generator=gen).to(dtype)
    base = torch.randn(len(slots), sum(sections), generator=gen).to(dtype)
    want = _expected(base, x, a, b, slots)
    out = base.to(DEVICE)
    slot_ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    triton_lora_delta(out, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), slot_ids, sections)
    out = out.cpu()
    assert out.dtype == dtype
    untouched = torch.tensor([s < 0 for s in slots], dtype=torch.bool)
    assert torch.equal(out[untouched], base[untouched]), "rows without an adapter changed"
    torch.testing.assert_close(out.double(), want, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sections", [[40], [16, 24], [13, 20, 7]], ids=["one", "two", "three-odd"])
@pytest.mark.parametrize("d_in", [27, 70])
def test_delta_matches_float64(d_in, sections, dtype):
    _run(UNEVEN, sections, d_in, dtype, seed=d_in + len(sections))


@pytest.mark.parametrize("slots", [UNEVEN, [1] * 5, [-1] * 3, [3], []],
                         ids=["uneven-with-base-rows", "one-slot", "base-only", "one-row", "no-rows"])
def test_slot_mixes(slots):
    _run(slots, [13, 20, 7], 27, torch.float32, seed=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sections", [[16, 24], [13, 20, 7]], ids=["two", "three-odd"])
def test_each_section_reads_only_its_own_ranks(sections, dtype):
    """B is NaN off each section's ranks: one read of them would make the row NaN."""
    _run(UNEVEN, sections, 27, dtype, seed=11, off_section=float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_several_rank_input_and_output_blocks(dtype):
    """Rank 36 spans three shrink programs (the last partial), 300 inputs three `BLOCK_K` steps (the last
    partial), a 150-wide section two expand blocks."""
    from fastgen.ops import triton_lora

    assert 36 > 2 * triton_lora.MAX_BLOCK_R and 300 > 2 * (triton_lora.SHRINK_TILE // triton_lora.MAX_BLOCK_R)
    assert 150 > triton_lora.MAX_BLOCK_N
    _run(UNEVEN, [150, 33, 60], 300, dtype, rank=36, seed=5)


def test_output_is_a_column_slice_of_a_wider_tensor():
    """Output rows strided wider than they are, x a column slice too: the columns around stay as they were."""
    from fastgen.ops.triton_lora import triton_lora_delta

    sections, d_in = [13, 20, 7], 27
    a, b = _stacks(12, d_in, sections, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    wide_x = torch.randn(len(UNEVEN), d_in + 9, generator=gen)
    wide = torch.randn(len(UNEVEN), 40 + 11, generator=gen)
    x, base = wide_x[:, 5:5 + d_in], wide[:, 6:46]
    want = _expected(base, x, a, b, UNEVEN)
    got = wide.to(DEVICE)
    out = got[:, 6:46]
    assert out.stride(0) == 51 and not out.is_contiguous()
    triton_lora_delta(out, wide_x.to(DEVICE)[:, 5:5 + d_in], a.to(DEVICE), b.to(DEVICE),
                      torch.tensor(UNEVEN, dtype=torch.int32, device=DEVICE), sections)
    got = got.cpu()
    assert torch.equal(got[:, :6], wide[:, :6]) and torch.equal(got[:, 46:], wide[:, 46:])
    torch.testing.assert_close(got[:, 6:46].double(), want, **_tolerance(torch.float32))


def _bad(case: str) -> tuple[tuple, list[int]]:
    a, b = _stacks(12, 8, [10, 6], torch.float32, seed=0)
    x, out, slots = torch.randn(3, 8), torch.randn(3, 16), torch.tensor([0, -1, 1], dtype=torch.int32)
    sections = [10, 6]
    if case == "rank-not-split":
        sections = [5, 5, 6]
        a, b = a[:, :10].contiguous(), b[:, :10].contiguous()
    elif case == "sizes-not-width":
        sections = [10, 5]
    elif case == "mixed-dtype":
        x = x.bfloat16()
    elif case == "strided-stack":
        b = b.transpose(0, 1).contiguous().transpose(0, 1)
    elif case == "strided-output-columns":
        out = torch.randn(16, 3).t()
    elif case == "slot-outside-stack":
        slots = torch.tensor([0, NUM_SLOTS, 1], dtype=torch.int32)
    return (out, x, a, b, slots), sections


@pytest.mark.parametrize("case,error,message", [
    pytest.param("rank-not-split", ValueError, "dividing the rank", id="rank-not-split"),
    pytest.param("sizes-not-width", ValueError, "adding up to the output's width", id="sizes-not-width"),
    pytest.param("mixed-dtype", TypeError, "share one of", id="mixed-dtype"),
    pytest.param("strided-stack", ValueError, "both stacks contiguous", id="strided-stack"),
    pytest.param("strided-output-columns", ValueError, "contiguous in its rows", id="strided-output-columns"),
    pytest.param("slot-outside-stack", ValueError, r"slots in \[0, 4\)", id="slot-outside-stack",
                 marks=pytest.mark.skipif(DEVICE != "cpu", reason="slots are read only on the CPU (no sync)")),
])
def test_refuses_what_it_cannot_take(case, error, message):
    from fastgen.ops.triton_lora import triton_lora_delta

    (out, x, a, b, slots), sections = _bad(case)
    before = out.clone()
    tensors = [t.to(DEVICE) for t in (out, x, a, b, slots)]
    with pytest.raises(error, match=message):
        triton_lora_delta(*tensors, sections)
    assert torch.equal(tensors[0].cpu(), before)

"""Triton kernels of the batched LoRA delta: every row of a flat batch under its own adapter slot, in a
shrink launch and one expand launch per output section (punica's BGMV idea, written anew here).

The contract is the C++ CPU kernel's (`fastgen.ops.cpu_kernels.lora`, `lora_delta.cpp`): row t with slot
s = `slot_ids[t]` >= 0 gets `output[t] += lora_b[s]^T (lora_a[s] x[t])`, with `lora_a` `[slots, R, in]`,
B stored transposed as `lora_b` `[slots, R, out]` and the adapter's scale already in B; rows of slot -1
are not touched. Work split:
- shrink, grid (rows, rank blocks): `h[t, r] = A_s[r] . x[t]` in fp32, walking `in` in `BLOCK_K` chunks.
  Products accumulate elementwise in a `[BLOCK_R, BLOCK_K]` tile and are summed once after the loop, so
  the loop body is loads and FMAs only.
- expand, grid (rows, output blocks of one section), launched once per section of `output_sizes`: a
  merged linear (q/k/v, gate/up) gives section j only ranks j*R/n .. (j+1)*R/n of B (zero elsewhere), so
  each launch reads only its own rank slice of h and B, never the zeros around it. A launch per section
  keeps the section's bounds plain integer arguments: no device tensor of section starts to upload, and
  no tuple arguments, which Triton before 3.3 lacks. The fp32 delta is added to the fp32 value of the
  output and rounded to the output's dtype once.
A row reads its own slot's A and B, so rows need no sorting by slot and there is no host sync: every
launch parameter comes from shapes, and the launches can be captured in a CUDA graph. The cost is that
rows sharing an adapter each read its A and B (from L2 after the first), where SGMV would share one load
across a tile of rows through `tl.dot`: fine for decode, where rows per adapter are few.

Import this module only when a kernel is about to launch: `triton.jit` decides at decoration time
whether it runs compiled or through the interpreter, so `TRITON_INTERPRET=1` is honoured as long as it
is set before then. The kernels call only `tl` builtins (see `fastgen.ops.triton_kernels` for why), hence
the local combine function and `tl.full` for zeros. The interpreter rounds fp32 to bf16 toward zero where
the GPU rounds to nearest, so interpreted bf16 outputs can be one unit in the last place nearer zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

SHRINK_TILE = 2048
"""Elements of a shrink program's `[BLOCK_R, BLOCK_K]` fp32 accumulator (16 a thread at 4 warps)."""
MAX_BLOCK_R = 16
"""Ranks of one shrink program: higher ranks spread over more programs, which decode needs to fill the GPU."""
EXPAND_TILE = 4096
"""Elements of an expand program's `[RANK_PAD, BLOCK_N]` tile of B."""
MAX_BLOCK_N = 128
"""Output columns of one expand program."""
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def lora_shrink_kernel(
    h_ptr, x_ptr, a_ptr, slots_ptr,
    in_features, rank, stride_xr, stride_hr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (row, rank block): `h[row, r] = A_s[r] . x[row]` in fp32 for the block's ranks; slot -1 exits."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank
    a_rows = a_ptr + (slot * rank + ranks.to(tl.int64))[:, None] * in_features
    x_row = x_ptr + row * stride_xr
    acc = tl.full([BLOCK_R, BLOCK_K], 0.0, dtype=tl.float32)
    for k_first in range(0, in_features, BLOCK_K):
        ks = k_first + tl.arange(0, BLOCK_K)
        k_ok = ks < in_features
        x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_rows + ks[None, :], mask=rank_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += a * x[None, :]
    tl.store(h_ptr + row * stride_hr + ranks, tl.reduce(acc, 1, _add), mask=rank_ok)


@triton.jit
def lora_expand_kernel(
    out_ptr, h_ptr, b_ptr, slots_ptr,
    out_features, rank, col_start, col_end, rank_start, section_rank, stride_or, stride_hr,
    RANK_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (row, output block of one section): add `h[row, section ranks] @ B_s[section ranks, block]`
    to the block's outputs, rounded once to the output dtype; slot -1 exits.

    The section is columns `col_start .. col_end` and ranks `rank_start .. rank_start + section_rank`."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    cols = col_start + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < col_end
    offsets = tl.arange(0, RANK_PAD)
    rank_ok = offsets < section_rank
    ranks = rank_start + offsets
    h = tl.load(h_ptr + row * stride_hr + ranks, mask=rank_ok, other=0.0)
    b = tl.load(b_ptr + (slot * rank + ranks.to(tl.int64))[:, None] * out_features + cols[None, :],
                mask=rank_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    delta = tl.reduce(h[:, None] * b, 0, _add)
    dst = out_ptr + row * stride_or + cols
    base = tl.load(dst, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(dst, (base + delta).to(out_ptr.dtype.element_ty), mask=col_ok)


def _check_inputs(output: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  slot_ids: torch.Tensor, output_sizes: list[int]) -> None:
    """Raise `ValueError`/`TypeError` naming the problem if the kernels cannot take these tensors, and
    `RuntimeError` for tensors off CUDA when the kernels were not defined under the interpreter.

    Slot values are read (a sync) only for CPU tensors, where an out-of-range slot would read outside the
    stacks in the interpreter; on a GPU they are the caller's to keep in range, as the step builds them."""
    if output.dim() != 2 or x.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(f"output must be [T, out], x [T, in], lora_a [slots, R, in] and lora_b [slots, R, out], got "
                         f"{tuple(output.shape)}, {tuple(x.shape)}, {tuple(lora_a.shape)}, {tuple(lora_b.shape)}")
    rows, width = output.shape
    num_slots, rank, in_features = lora_a.shape
    if (x.shape[0] != rows or x.shape[1] != in_features or lora_b.shape[0] != num_slots or lora_b.shape[1] != rank
            or lora_b.shape[2] != width):
        raise ValueError(f"the stacks lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} do not match "
                         f"x {tuple(x.shape)} and output {tuple(output.shape)}")
    if tuple(slot_ids.shape) != (rows,) or slot_ids.dtype not in _INT_DTYPES:
        raise ValueError(f"slot_ids must be int32 or int64 of shape [{rows}] (one per row), got "
                         f"{slot_ids.dtype} {list(slot_ids.shape)}")
    if output.dtype not in _FLOAT_DTYPES or any(t.dtype != output.dtype for t in (x, lora_a, lora_b)):
        raise TypeError(f"output, x, lora_a and lora_b must share one of float32, bfloat16, float16, got "
                        f"{output.dtype}, {x.dtype}, {lora_a.dtype}, {lora_b.dtype}")
    if output.stride(1) != 1 or not lora_a.is_contiguous() or not lora_b.is_contiguous():
        raise ValueError(f"output must be contiguous in its rows and both stacks contiguous, got strides "
                         f"{output.stride()}, {lora_a.stride()}, {lora_b.stride()}")
    sections = len(output_sizes)
    if sections == 0 or rank % sections or any(size < 0 for size in output_sizes) or sum(output_sizes) != width:
        raise ValueError(f"output_sizes {list(output_sizes)} must be sizes >= 0 adding up to the output's width "
                         f"{width}, their number dividing the rank {rank}")
    devices = {t.device for t in (output, x, lora_a, lora_b, slot_ids)}
    if len(devices) != 1:
        raise ValueError(f"all LoRA inputs must be on one device, got {sorted(map(str, devices))}")
    if slot_ids.device.type == "cpu" and rows and not (
            int(slot_ids.min()) >= -1 and int(slot_ids.max()) < num_slots):
        raise ValueError(f"slot_ids must be -1 (no adapter) or slots in [0, {num_slots})")
    if slot_ids.device.type != "cuda" and not isinstance(lora_shrink_kernel, InterpretedFunction):
        raise RuntimeError(f"Triton LoRA kernels on {slot_ids.device.type} tensors need TRITON_INTERPRET=1, set "
                           "before fastgen.ops.triton_lora is imported")


def triton_lora_delta(output: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      slot_ids: torch.Tensor, output_sizes: list[int]) -> None:
    """Add to `output[T, out]`, in place, each row's adapter delta `lora_b[s]^T (lora_a[s] x[t])` for its slot
    s = `slot_ids[t]` (-1 = none: the row is left as it is), where `lora_a` is `[slots, R, in]`, `lora_b`
    `[slots, R, out]` (B transposed, the scale in it), and output section j (`output_sizes`, n sections,
    n dividing R) reads only ranks j*R/n .. (j+1)*R/n of B. The contract of `cpu_lora_delta`.

    fp32, bf16 or fp16, all four tensors alike; the delta accumulates in fp32 and the output is rounded once.
    `output` may have any row stride but contiguous rows; `x` any layout (copied if its rows are not
    contiguous); both stacks contiguous. Launches: one shrink and one expand per non-empty section."""
    _check_inputs(output, x, lora_a, lora_b, slot_ids, output_sizes)
    rows, width = output.shape
    if rows == 0 or width == 0 or lora_a.shape[1] == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    slot_ids = slot_ids.contiguous()
    rank, in_features = lora_a.shape[1], lora_a.shape[2]
    h = torch.empty(rows, rank, dtype=torch.float32, device=output.device)
    block_r = min(triton.next_power_of_2(rank), MAX_BLOCK_R)
    block_k = min(triton.next_power_of_2(max(in_features, 16)), SHRINK_TILE // block_r)
    lora_shrink_kernel[(rows, triton.cdiv(rank, block_r))](
        h, x, lora_a, slot_ids, in_features, rank, x.stride(0), h.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)

    section_rank = rank // len(output_sizes)
    rank_pad = triton.next_power_of_2(section_rank)
    block_n = max(16, min(triton.next_power_of_2(max(output_sizes)), EXPAND_TILE // rank_pad, MAX_BLOCK_N))
    col_start = 0
    for j, size in enumerate(output_sizes):
        if size:
            lora_expand_kernel[(rows, triton.cdiv(size, block_n))](
                output, h, lora_b, slot_ids, width, rank, col_start, col_start + size, j * section_rank,
                section_rank, output.stride(0), h.stride(0), RANK_PAD=rank_pad, BLOCK_N=block_n)
        col_start += size

"""Host side of the Triton paged attention: input checks, tile and split-KV rules, launches.

Every launch parameter comes from tensor shapes (host-known), never from tensor values, so a
launch never syncs with the device and can be captured in a CUDA graph. Checks that read values
(block tables wide enough for each seq_len, query ranges within the batch) run only when the
metadata lives on the CPU, or on any device when `FASTGEN_CHECK_ATTENTION_METADATA=1` (a sync per
call: for debugging). The kernels themselves live in `fastgen.ops.triton_kernels`, imported on the
first launch so that `TRITON_INTERPRET=1` set before then is honoured.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
TILE_N = 32
"""Keys per inner-loop tile; independent of the KV block size (each key finds its block)."""
MIN_TILES_PER_SPLIT = 4
"""A KV split should cover at least this many key tiles, or the reduce costs more than it saves."""
MAX_SPLITS = 16
KV_WRITE_ELEMENTS = 8192
"""Elements of K (and of V) one KV-write program copies: 1 to 16 tokens, each with all its KV heads."""
CHECK_ENV = "FASTGEN_CHECK_ATTENTION_METADATA"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


def supports_head_dim(head_dim: int) -> bool:
    """Head dims the kernel serves: multiples of 16 from 16 to 256 (64, 80, 96, 128, 256, ...)."""
    return MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tile_shape(num_tokens: int, num_seqs: int, group: int, head_dim: int) -> tuple[int, int, int]:
    """`(BLOCK_M, BLOCK_Q, num_warps)`: rows of a program's tile, the query tokens they hold, warps.

    The `group` query heads of one KV head share the rows, so a tile holds `BLOCK_M // group`
    tokens. Batches averaging at least 4 new tokens per sequence are prefill-heavy and get 64
    rows (32 for head dims above 128, whose fp32 accumulator would spill registers); decode-heavy
    batches get 16, the smallest M the matrix units take. Tiles of 8192+ elements get 8 warps
    (sm_90 register counts from ptxas: no spills up to head_dim 128).
    """
    head_dim_pad = _next_pow2(head_dim)
    rows = (64 if head_dim_pad <= 128 else 32) if num_tokens >= 4 * num_seqs else 16
    block_m = max(rows, _next_pow2(group))
    return block_m, block_m // group, 8 if block_m * head_dim_pad >= 8192 else 4


def num_query_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Grid axis 0: an upper bound on the query blocks of all sequences, from shapes alone."""
    return num_tokens // block_q + num_seqs


def choose_num_kv_splits(num_programs: int, max_context_len: int, num_sms: int) -> int:
    """KV splits per query block: more than 1 only when the plain grid leaves the GPU idle.

    `num_programs` is the unsplit grid size (query blocks x KV heads), `max_context_len` the
    longest context the block tables can address (`max_blocks * block_size`), `num_sms` the
    device's multiprocessors. Aim for about two programs per multiprocessor, with each split
    covering at least `MIN_TILES_PER_SPLIT` tiles; a power of two so few variants compile.
    """
    if num_programs >= num_sms:
        return 1
    wanted = _next_pow2(-(-2 * num_sms // max(num_programs, 1)))
    by_length = max_context_len // (TILE_N * MIN_TILES_PER_SPLIT)
    splits = min(wanted, MAX_SPLITS)
    while splits > 1 and splits > by_length:
        splits //= 2
    return splits


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: splitting only adds work


def _checks_values(device: torch.device) -> bool:
    return device.type == "cpu" or os.environ.get(CHECK_ENV) == "1"


def check_kv_write_inputs(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Raise `ValueError`/`TypeError` naming the problem if the KV write cannot take these inputs."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.dim() != 3 or key.shape != value.shape or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key/value must be [tokens, {num_kv_heads}, {head_dim}] to match the cache, got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride 1), got strides {t.stride()}")
    if slot_mapping.dtype not in _INT_DTYPES:
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if tuple(slot_mapping.shape) != (key.shape[0],):
        raise ValueError(f"slot_mapping must have shape [{key.shape[0]}] (one slot per token), "
                         f"got {list(slot_mapping.shape)}")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"key, value, caches and slot_mapping must be on one device, got {sorted(map(str, devices))}")
    num_slots = num_blocks * block_size
    if _checks_values(key.device) and slot_mapping.numel() and not (
            int(slot_mapping.min()) >= -1 and int(slot_mapping.max()) < num_slots):
        raise ValueError(f"slot_mapping values must be -1 (padding) or slots in [0, {num_slots})")


def check_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
) -> None:
    """Raise `ValueError`/`TypeError` naming the problem if the inputs cannot go to the kernels.

    Shapes, dtypes, devices and layouts are always checked; values only as the module docstring says.
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, num_q_heads, head_dim], got {tuple(query.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    if key.shape[:1] != (num_tokens,) or k_cache.shape[-1:] != (head_dim,):
        raise ValueError(f"key/value and the KV cache must match query {tuple(query.shape)} in tokens and head_dim, "
                         f"got key {tuple(key.shape)}, cache {tuple(k_cache.shape)}")
    check_kv_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_kv_heads = k_cache.shape[2]
    if not supports_head_dim(head_dim):
        raise ValueError(f"head_dim {head_dim} is not supported by the Triton attention kernel "
                         f"(multiples of 16 from {MIN_HEAD_DIM} to {MAX_HEAD_DIM})")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != k_cache.dtype or query.stride(-1) != 1:
        raise TypeError(f"query must have the KV cache dtype {k_cache.dtype} and be contiguous in head_dim, got "
                        f"{query.dtype} with strides {query.stride()}")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [num_seqs], got {list(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc), ("block_tables", block_tables)):
        if t.dtype not in _INT_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must have shape [{num_seqs + 1}] for {num_seqs} seq_lens rows, "
                         f"got {list(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks] with contiguous rows, "
                         f"got shape {list(block_tables.shape)} strides {block_tables.stride()}")
    devices = {t.device for t in (query, key, block_tables, seq_lens, query_start_loc)}
    if len(devices) != 1:
        raise ValueError(f"all attention inputs must be on one device, got {sorted(map(str, devices))}")
    if _checks_values(query.device):
        _check_values(num_tokens, k_cache.shape[0], k_cache.shape[1], block_tables, seq_lens, query_start_loc)


def _check_values(num_tokens: int, num_blocks: int, block_size: int, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """Metadata value checks (they read the tensors, so on a GPU they sync)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] > num_tokens:
        raise ValueError(f"query_start_loc must start at 0, never decrease and end at most at {num_tokens}, "
                         f"got {starts}")
    width = block_tables.shape[1]
    for s, seq_len in enumerate(lens):
        query_len = starts[s + 1] - starts[s]
        if seq_len < 0 or (query_len > 0 and seq_len < query_len):
            raise ValueError(f"sequence {s}: seq_len {seq_len} must be >= 0 and cover its {query_len} query tokens")
        needed = -(-seq_len // block_size)
        if needed > width:
            raise ValueError(f"sequence {s}: seq_len {seq_len} needs {needed} blocks of {block_size} but "
                             f"block_tables rows hold only {width}")
        row = block_tables[s, :needed]
        if needed and (int(row.min()) < 0 or int(row.max()) >= num_blocks):
            raise ValueError(f"sequence {s}: block_tables row {row.tolist()} has ids outside [0, {num_blocks})")


def _kernels(device: torch.device) -> ModuleType:
    """The kernel module, imported now; a clear error where no Triton backend can run the launch."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"Triton attention on {device.type} tensors needs TRITON_INTERPRET=1 (set before the "
                           "first Triton call); on this machine use a CUDA GPU or attention_backend='torch'")
    from fastgen.ops import triton_kernels

    if device.type != "cuda" and not kernels_interpreted(triton_kernels):
        raise RuntimeError("the Triton kernels were compiled before TRITON_INTERPRET=1 was set; set it before "
                           "the first Triton attention call in the process")
    return triton_kernels


def kernels_interpreted(kernels: ModuleType) -> bool:
    """Whether the kernels of `kernels` run through the Triton interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels.paged_attention_kernel, InterpretedFunction)


def triton_write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Store `key`/`value` (`[T, num_kv_heads, head_dim]`) at their slots with one launch; slot -1 is skipped."""
    check_kv_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    _launch_kv_write(key, value, k_cache, v_cache, slot_mapping)


def _launch_kv_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    kernels = _kernels(key.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    heads_pad, head_dim_pad = _next_pow2(num_kv_heads), _next_pow2(head_dim)
    block_t = max(1, min(16, KV_WRITE_ELEMENTS // (heads_pad * head_dim_pad)))
    kernels.kv_write_kernel[(-(-num_tokens // block_t),)](
        key, value, k_cache, v_cache, slot_mapping,
        num_tokens, k_cache.shape[1], num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_T=block_t, HEADS_PAD=heads_pad, HEAD_DIM_PAD=head_dim_pad,
    )


def triton_paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    scale: float, sliding_window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
    attention_chunk: int = 0, *, out: torch.Tensor | None = None, num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend, with the same contract as `fastgen::paged_attention`.

    All K/V are written (one launch) before attention starts (the next launch): a sequence with a
    prefix-cache hit may read blocks another sequence of this step fills. `out` (`[T, num_q_heads,
    head_dim]`, query dtype) receives the rows of tokens owned by a sequence and is left untouched
    elsewhere; by default a zeroed tensor is allocated, so padded tokens read 0. `num_kv_splits`
    overrides the split-KV rule (`choose_num_kv_splits`). Returns `out`.
    """
    check_inputs(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    if sliding_window < 0 or softcap < 0 or attention_chunk < 0:
        raise ValueError(f"sliding_window ({sliding_window}), softcap ({softcap}) and attention_chunk "
                         f"({attention_chunk}) must be >= 0")
    if sinks is not None and (tuple(sinks.shape) != (query.shape[1],) or sinks.device != query.device
                              or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a float tensor [{query.shape[1]}] (one per query head) on {query.device}, "
                         f"got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
    if out is None:
        out = torch.zeros_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(-1) != 1:
        raise ValueError(f"out must be a {query.dtype} tensor of shape {tuple(query.shape)} on {query.device} "
                         f"contiguous in head_dim, got {out.dtype} {tuple(out.shape)} on {out.device}")
    _launch_kv_write(key, value, k_cache, v_cache, slot_mapping)
    kernels = _kernels(query.device)

    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_m, block_q, num_warps = tile_shape(num_tokens, num_seqs, group, head_dim)
    grid_q = num_query_blocks(num_tokens, num_seqs, block_q)
    if num_kv_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_kv_splits = choose_num_kv_splits(grid_q * num_kv_heads, max_context, _num_sms(query.device))
    if not 1 <= num_kv_splits <= MAX_SPLITS:
        raise ValueError(f"num_kv_splits must be in [1, {MAX_SPLITS}], got {num_kv_splits}")
    head_dim_pad = _next_pow2(head_dim)
    if num_kv_splits > 1:
        part_acc = torch.empty(num_tokens, num_q_heads, num_kv_splits, head_dim_pad, dtype=torch.float32,
                               device=query.device)
        part_max = torch.empty(num_tokens, num_q_heads, num_kv_splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never read: the kernel stores to `out` directly
    interpreted = kernels_interpreted(kernels)
    # The Triton interpreter's bf16 tl.dot gives wrong results (numpy has no bf16), so it computes in fp32;
    # fp32 inputs use IEEE products because tl.dot would otherwise round them to tf32.
    upcast = query.dtype == torch.float32 or (interpreted and query.dtype == torch.bfloat16)
    sinks_arg = query if sinks is None else sinks.contiguous()  # never read without USE_SINKS
    common = dict(HEAD_DIM_PAD=head_dim_pad, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q)
    kernels.paged_attention_kernel[(grid_q, num_kv_heads, num_kv_splits)](
        out, part_acc, part_max, part_sum,
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks_arg,
        num_seqs, num_q_heads, float(scale), float(softcap) if softcap > 0 else 1.0, int(sliding_window),
        int(attention_chunk), block_size, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0),
        TILE_N=TILE_N, NUM_SPLITS=num_kv_splits, USE_WINDOW=sliding_window > 0, USE_CHUNK=attention_chunk > 0,
        USE_SOFTCAP=softcap > 0, USE_SINKS=sinks is not None, UPCAST=upcast, IEEE_DOT=upcast,
        num_warps=num_warps, **common,
    )
    if num_kv_splits > 1:
        kernels.reduce_splits_kernel[(grid_q, num_kv_heads)](
            out, part_acc, part_max, part_sum, seq_lens, query_start_loc, sinks_arg,
            num_seqs, num_q_heads, head_dim, out.stride(0), out.stride(1),
            NUM_SPLITS=num_kv_splits, USE_SINKS=sinks is not None, num_warps=4, **common,
        )
    return out

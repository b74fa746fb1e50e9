"""Tensor-parallel building blocks: how one rank holds and runs its share of a layer.

Megatron-LM's split, as vLLM and DeepSpeed-FastGen use it:
- column-parallel linears (q/k/v, gate/up) keep a slice of the output rows and need no
  communication; the heads (or MLP columns) they produce stay on their rank;
- row-parallel linears (o_proj, down_proj) keep a slice of the input columns and sum the ranks'
  partial products with one all-reduce, so each attention block and each MLP costs one all-reduce;
- the embedding and LM head split the vocabulary: the embedding sums the rows each rank owns,
  the LM head's logit slices are gathered on rank 0, the only rank that samples.

Every layer here is the plain layer when `tp.size == 1` (same parameter names and shapes, same
arithmetic), so one model file serves both. Each layer also knows which slice of a full
checkpoint tensor it holds (`load_checkpoint_shard`), so the loader reads only that slice from
the memory-mapped safetensors file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True, frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    """Rank within the group (0 samples and schedules)."""
    size: int = 1
    """Ranks the weights are split over; 1 = no tensor parallelism."""
    group: Any = None
    """The torch.distributed process group of the model's collectives (None when size is 1)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")
        if self.size > 1 and self.group is None:
            raise ValueError("tensor parallelism over several ranks needs a process group")

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, MLP columns, ...); it must divide evenly."""
        if total % self.size:
            raise ValueError(f"tensor_parallel {self.size} must divide {what} ({total})")
        return total // self.size

    def kv_heads(self, num_kv_heads: int) -> int:
        """KV heads held per rank: a share of them, or one copy when there are more ranks than heads."""
        return kv_heads_per_rank(num_kv_heads, self.size)

    def kv_head_start(self, num_kv_heads: int) -> int:
        """Index of this rank's first KV head in the checkpoint."""
        if num_kv_heads >= self.size:
            return self.rank * self.kv_heads(num_kv_heads)
        return self.rank // (self.size // num_kv_heads)


SINGLE = TensorParallel()
"""The one-process setting (immutable, so sharing it is safe)."""


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each of `size` ranks holds: a share of them, or one copy when there are more ranks
    than heads. A function of the sizes alone, so the planner can ask before any process group exists."""
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"tensor_parallel {size} must divide the KV heads ({num_kv_heads})")
        return num_kv_heads // size
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel {size} must be a multiple of the {num_kv_heads} KV heads "
                         "when it exceeds them (each KV head is then copied to size/heads ranks)")
    return 1


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum `x` over the ranks (functional, so torch.compile traces it and CUDA graphs capture it)."""
    if tp.size == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", tp.group))


def gather_last_dim_to_first(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor | None:
    """Rank 0: the ranks' `x` concatenated on the last dim; other ranks: None (they only send)."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    dst = dist.get_global_rank(tp.group, 0)
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(x, parts, dst=dst, group=tp.group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def shape_of(full) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or of a safetensors lazy slice."""
    return tuple(full.shape) if isinstance(full, torch.Tensor) else tuple(full.get_shape())


def read_whole(full) -> torch.Tensor:
    """All of a checkpoint tensor or lazy slice (0-dim included)."""
    return full if isinstance(full, torch.Tensor) else full[...]


def read_slice(full, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows `start:start+length` along `dim` of a tensor or lazy slice (only those bytes are read)."""
    index = (slice(None),) * dim + (slice(start, start + length),)
    return full[index]


class MergedLinear(nn.Linear):
    """A column-parallel linear whose output rows concatenate several checkpoint linears (q|k|v, gate|up).

    One matmul instead of several. Shard `i` of the checkpoint (`full_sizes[i]` rows) contributes
    `output_sizes[i]` rows starting at checkpoint row `shard_starts[i]`; by default each rank takes
    an equal slice. The loader fills shard `i` at rows `sum(output_sizes[:i]) : sum(output_sizes[:i + 1])`.
    """

    def __init__(self, in_features: int, full_sizes: list[int], bias: bool, tp: TensorParallel = SINGLE,
                 output_sizes: list[int] | None = None, shard_starts: list[int] | None = None) -> None:
        if output_sizes is None:
            output_sizes = [tp.split(size, "each merged projection's rows") for size in full_sizes]
        if shard_starts is None:
            shard_starts = [tp.rank * size for size in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.tp = tp
        self.full_sizes = list(full_sizes)
        self.output_sizes = list(output_sizes)
        self.shard_starts = list(shard_starts)

    def load_checkpoint_shard(self, attr: str, shard: int | None, full) -> torch.Tensor:
        """This rank's rows of checkpoint shard `shard` (None: the whole merged tensor arrives fused)."""
        if shard is not None:
            return read_slice(full, 0, self.shard_starts[shard], self.output_sizes[shard])
        return read_merged_rows(full, self.full_sizes, self.shard_starts, self.output_sizes)


def read_merged_rows(full, full_sizes: list[int], shard_starts: list[int], output_sizes: list[int]) -> torch.Tensor:
    """This rank's rows of a checkpoint tensor that stacks several pieces (`full_sizes` rows each):
    `output_sizes[i]` rows of piece `i` from its row `shard_starts[i]`, concatenated."""
    offsets = [sum(full_sizes[:i]) for i in range(len(full_sizes))]
    return torch.cat([read_slice(full, 0, off + start, size)
                      for off, start, size in zip(offsets, shard_starts, output_sizes)])


def qkv_linear(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
               tp: TensorParallel) -> MergedLinear:
    """The merged q/k/v projection: this rank's query heads, and its KV heads (copied when ranks outnumber them)."""
    q_local = tp.split(num_heads, "the attention heads") * head_dim
    kv_local = tp.kv_heads(num_kv_heads) * head_dim
    kv_start = tp.kv_head_start(num_kv_heads) * head_dim
    return MergedLinear(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias,
                        tp, output_sizes=[q_local, kv_local, kv_local],
                        shard_starts=[tp.rank * q_local, kv_start, kv_start])


def finish_row_parallel(out: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel,
                        reduce: bool) -> torch.Tensor:
    """A row-parallel rank's partial product (no bias) summed over the ranks, then its bias; with
    `reduce=False` the partial as it is: whoever sums it adds the bias once."""
    if not reduce:
        return out
    out = all_reduce(out, tp)
    return out if bias is None else out + bias


class RowParallelLinear(nn.Linear):
    """A linear split along its input: each rank multiplies its slice, one all-reduce sums them.

    `reduce=False` leaves the partial sum for the caller to reduce together with others (a MoE
    layer reduces its routed experts and shared expert once; a LoRA linear adds its delta first). The
    bias is added once, after the sum: by whoever sums it (`finish_row_parallel`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE,
                 reduce: bool = True) -> None:
        super().__init__(tp.split(in_features, "the row-parallel input features"), out_features, bias=bias)
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` holds this rank's input columns."""
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        return finish_row_parallel(F.linear(x, self.weight), self.bias, self.tp, self.reduce)

    def load_checkpoint_shard(self, attr: str, shard: int | None, full) -> torch.Tensor:
        """This rank's input columns of the weight; the bias whole."""
        if attr == "bias":
            return read_whole(full)
        return read_slice(full, 1, self.tp.rank * self.in_features, self.in_features)


LAYOUT_ATTRS = ("output_sizes", "full_sizes", "shard_starts")
"""What a merged column-parallel linear says of its rows: this rank's and the checkpoint's sizes per
projection, and where this rank's rows start in each."""


def copy_parallel_layout(linear: nn.Module, to: nn.Module) -> None:
    """Give `to`, a module that replaces `linear` (packed, quantized), `linear`'s tensor-parallel layout:
    its merged rows (`LAYOUT_ATTRS`, where it has them) and `row_parallel` (its input is split)."""
    for attr in LAYOUT_ATTRS:
        if hasattr(linear, attr):
            setattr(to, attr, getattr(linear, attr))
    to.row_parallel = bool(getattr(linear, "row_parallel", isinstance(linear, RowParallelLinear)))


def _vocab_rows(full, tp: TensorParallel, rows_per_rank: int) -> torch.Tensor:
    """This rank's vocabulary rows, zero-padded past the real vocabulary (the last rank's tail)."""
    start = tp.rank * rows_per_rank
    length = max(0, min(rows_per_rank, shape_of(full)[0] - start))
    rows = read_slice(full, 0, start, length)
    if length < rows_per_rank:
        rows = torch.cat([rows, rows.new_zeros(rows_per_rank - length, *rows.shape[1:])])
    return rows


class VocabParallelEmbedding(nn.Embedding):
    """Token embedding with the vocabulary split in equal row ranges (the last one zero-padded)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(-(-vocab_size // tp.size), hidden_size)
        self.tp = tp
        self.vocab_size = vocab_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the ids it owns (zeros elsewhere); the all-reduce assembles the rows."""
        if self.tp.size == 1:
            return super().forward(input_ids)
        start = self.tp.rank * self.num_embeddings
        local = input_ids - start
        owned = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(owned, local, 0), self.weight)
        return all_reduce(rows * owned.unsqueeze(-1).to(rows.dtype), self.tp)

    def load_checkpoint_shard(self, attr: str, shard: int | None, full) -> torch.Tensor:
        """This rank's vocabulary rows."""
        return _vocab_rows(full, self.tp, self.num_embeddings)


class ParallelLMHead(nn.Linear):
    """LM head over this rank's vocabulary rows (shaped like `VocabParallelEmbedding`, so it can be tied).

    A bias (Phi) is split like the rows it belongs to."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel = SINGLE, bias: bool = False) -> None:
        super().__init__(hidden_size, -(-vocab_size // tp.size), bias=bias)
        self.tp = tp
        self.vocab_size = vocab_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits `[N, vocab]` on rank 0 (other ranks send their slice and get None)."""
        if self.tp.size == 1:
            return self(hidden).float()
        full = gather_last_dim_to_first(self(hidden), self.tp)
        return None if full is None else full[:, : self.vocab_size].float()

    def load_checkpoint_shard(self, attr: str, shard: int | None, full) -> torch.Tensor:
        """This rank's vocabulary rows (of the weight or the bias)."""
        return _vocab_rows(full, self.tp, self.out_features)

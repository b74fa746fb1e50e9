"""One step's flat inputs, and the static buffers they are padded into for a bucket.

Compile-first means static shapes: a step of T tokens from S sequences is padded to the
smallest bucket B >= T (and min(B, max_seqs) sequence rows), so each bucket is compiled once
and, on a GPU, captured once as a CUDA graph. Padding uses the conventions every attention
backend skips: slot -1, empty query ranges, seq_len 0. The same code runs on the CPU (compiled,
without graphs), so CI exercises it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from fastgen.block_manager import BlockManager
from fastgen.ops import AttentionMetadata
from fastgen.sequence import Sequence


@dataclass(slots=True)
class HostStepInputs:
    """A step's inputs as host lists, before padding or device transfer."""

    input_ids: list[int]
    """Token ids `[T]`."""
    positions: list[int]
    """Position of each token in its sequence `[T]`."""
    slot_mapping: list[int]
    """KV slot of each token `[T]`."""
    seq_lens: list[int]
    """Tokens with KV after this step, per sequence `[S]`."""
    query_start_loc: list[int]
    """Query offsets `[S + 1]`."""
    block_tables: list[list[int]]
    """Block ids per sequence (ragged)."""
    logits_indices: list[int]
    """Token rows whose logits are computed, per chunk in order: its `prompt_logit_positions`
    (requests asking for prompt logprobs), then its last token if the chunk ends its sequence
    (the row that is sampled)."""

    @property
    def num_tokens(self) -> int:
        """T."""
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        """S."""
        return len(self.seq_lens)


def prompt_logit_positions(seq: Sequence, num_new: int) -> range:
    """Positions of a chunk (before it runs) whose logits score the next prompt token: only for the
    sequence that collects the request's prompt logprobs."""
    if seq.prompt_logprobs is None:
        return range(0)
    start = seq.num_computed_tokens
    return range(start, min(start + num_new, seq.num_prompt_tokens - 1))


def build_host_inputs(chunks: list[tuple[Sequence, int]], block_manager: BlockManager) -> HostStepInputs:
    """Flatten `(seq, num_new_tokens)` chunks into `HostStepInputs`."""
    bs = block_manager.block_size
    out = HostStepInputs([], [], [], [], [0], [], [])
    for seq, num_new in chunks:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        first_row = out.query_start_loc[-1]
        out.logits_indices.extend(first_row + p - start for p in prompt_logit_positions(seq, num_new))
        table = block_manager.block_table(seq.seq_id)
        out.input_ids.extend(seq.token_ids[start:end])
        out.positions.extend(range(start, end))
        out.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        out.seq_lens.append(end)
        out.query_start_loc.append(out.query_start_loc[-1] + num_new)
        out.block_tables.append(table)
        if end == seq.num_tokens:
            out.logits_indices.append(out.query_start_loc[-1] - 1)
    return out


def seqs_for_bucket(bucket: int, max_seqs: int) -> int:
    """Sequence rows of a bucket: each sequence has at least one token, so never more than the bucket."""
    return min(bucket, max_seqs)


def pick_bucket(buckets: list[int], num_tokens: int) -> int | None:
    """Smallest bucket holding `num_tokens`, None if the step is larger than every bucket."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


class StaticBuffers:
    """Device tensors sized for the largest bucket; a step is copied in and padded in place.

    Views of these buffers are what compiled steps and CUDA graphs see, so their addresses must
    never change: they are allocated once and only ever written with `copy_`/`fill_`.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.max_seqs = max_seqs
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)

    def views(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The bucket's slices: input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc."""
        num_seqs = seqs_for_bucket(bucket, self.max_seqs)
        return (self.input_ids[:bucket], self.positions[:bucket], self.slot_mapping[:bucket],
                self.block_tables[:num_seqs], self.seq_lens[:num_seqs], self.query_start_loc[: num_seqs + 1])

    def fill(self, host: HostStepInputs | None, bucket: int) -> None:
        """Copy a step into the bucket's slices and pad the rest (None = an all-padding step)."""
        ids, pos, slots, tables, seq_lens, qsl = self.views(bucket)
        num_tokens = 0 if host is None else host.num_tokens
        num_seqs = 0 if host is None else host.num_seqs
        if host is not None:
            _copy(ids[:num_tokens], host.input_ids, torch.int64)
            _copy(pos[:num_tokens], host.positions, torch.int64)
            _copy(slots[:num_tokens], host.slot_mapping, torch.int64)
            _copy(seq_lens[:num_seqs], host.seq_lens, torch.int32)
            _copy(qsl[: num_seqs + 1], host.query_start_loc, torch.int32)
            width = max(len(t) for t in host.block_tables)
            padded = [t + [0] * (width - len(t)) for t in host.block_tables]
            _copy(tables[:num_seqs, :width], padded, torch.int32)
            # Stale columns from an earlier, longer step would be read by nobody today, but a
            # captured kernel may scan the whole row: clear them.
            tables[:num_seqs, width:].zero_()
        else:
            qsl[:1].zero_()
        ids[num_tokens:].zero_()
        pos[num_tokens:].zero_()
        slots[num_tokens:].fill_(-1)
        seq_lens[num_seqs:].zero_()
        tables[num_seqs:].zero_()
        qsl[num_seqs + 1 :].fill_(num_tokens)


def _copy(dest: torch.Tensor, data: list, dtype: torch.dtype) -> None:
    host = torch.tensor(data, dtype=dtype)
    if dest.device.type == "cuda":
        host = host.pin_memory()
    dest.copy_(host, non_blocking=True)


def make_metadata(views: tuple[torch.Tensor, ...], backend: str) -> AttentionMetadata:
    """AttentionMetadata over `StaticBuffers.views` (or any tensors in that order)."""
    _, _, slots, tables, seq_lens, qsl = views
    return AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
                             backend=backend)

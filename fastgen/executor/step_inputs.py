"""The step contract: one step's flat inputs on the host, on the wire between tensor-parallel ranks,
and on the device, padded into static buffers per bucket.

The tensors of a step are declared once, in `StepTensors` (their order is the order compiled steps
and CUDA graphs take them) and `STEP_FIELDS` (dtype, what sizes them, padding value);
`HostStepInputs` has the same fields, plus the logits rows, so every other form (device tensors,
static buffers, the TP wire format) is derived from these two declarations.

Compile-first means static shapes: a step of T tokens from S sequences is padded to the smallest
bucket B >= T (and min(B, max_seqs) sequence rows), so each bucket is compiled once and, on a GPU,
captured once as a CUDA graph. Padding uses the conventions every attention backend skips: slot
-1, empty query ranges, seq_len 0. The same code runs on the CPU (compiled, without graphs), so CI
exercises it.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from fastgen.ops import AttentionMetadata


class StepTensors(NamedTuple):
    """A step's device tensors, in the order the model step (compiled or captured) takes them."""

    input_ids: Tensor
    """[T] int64 token ids (padding: 0)."""
    positions: Tensor
    """[T] int64 position of each token in its sequence (padding: 0)."""
    slot_mapping: Tensor
    """[T] int64 KV slot of each token (padding: -1, skipped by the KV write)."""
    block_tables: Tensor
    """[S, max_blocks] int32 KV block ids per sequence (padding: 0)."""
    seq_lens: Tensor
    """[S] int32 tokens with KV after this step (padding: 0)."""
    query_start_loc: Tensor
    """[S + 1] int32 query offsets (padding rows repeat the last offset: empty queries)."""
    long_rope: Tensor
    """[T] bool: the token is rotated with LongRoPE's long factors (padding: False; ignored by
    models without LongRoPE)."""
    state_slots: Tensor
    """[S] int32 recurrent-state slot of each sequence (padding: -1; -1 too for models without state,
    whose layers never read it)."""
    lora_slots: Tensor
    """[T] int32 LoRA adapter slot of each token (padding: -1; -1 too for a token of the base model,
    and for every token of an engine without LoRA)."""

    def metadata(self, backend: str) -> AttentionMetadata:
        """The attention metadata of this step."""
        return AttentionMetadata(slot_mapping=self.slot_mapping, block_tables=self.block_tables,
                                 seq_lens=self.seq_lens, query_start_loc=self.query_start_loc, backend=backend,
                                 long_rope=self.long_rope, state_slots=self.state_slots,
                                 lora_slots=self.lora_slots)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How one step tensor is typed, sized and padded."""

    dtype: torch.dtype
    """Device dtype."""
    rows: str
    """What sizes its first dimension: "tokens" (T), "seqs" (S) or "seqs+1"."""
    pad: int
    """Value of padded entries (query_start_loc pads with the step's token count instead)."""


STEP_FIELDS: dict[str, FieldSpec] = {
    "input_ids": FieldSpec(torch.int64, "tokens", 0),
    "positions": FieldSpec(torch.int64, "tokens", 0),
    "slot_mapping": FieldSpec(torch.int64, "tokens", -1),
    "block_tables": FieldSpec(torch.int32, "seqs", 0),
    "seq_lens": FieldSpec(torch.int32, "seqs", 0),
    "query_start_loc": FieldSpec(torch.int32, "seqs+1", 0),
    "long_rope": FieldSpec(torch.bool, "tokens", 0),
    "state_slots": FieldSpec(torch.int32, "seqs", -1),
    "lora_slots": FieldSpec(torch.int32, "tokens", -1),
}
"""The step tensors, in `StepTensors` order."""
assert tuple(STEP_FIELDS) == StepTensors._fields

_HEADER = ("num_tokens", "num_seqs", "table_width", "num_logits")
"""Sizes a TP worker needs to split a packed step's payload (after the command word)."""


@dataclass(slots=True)
class HostStepInputs:
    """A step's inputs as host lists, before padding or device transfer (fields in `StepTensors`
    order, then the logits rows)."""

    input_ids: list[int]
    """Token ids `[T]`."""
    positions: list[int]
    """Position of each token in its sequence `[T]`."""
    slot_mapping: list[int]
    """KV slot of each token `[T]`."""
    block_tables: list[list[int]]
    """Block ids per sequence (ragged)."""
    seq_lens: list[int]
    """Tokens with KV after this step, per sequence `[S]`."""
    query_start_loc: list[int]
    """Query offsets `[S + 1]`."""
    long_rope: list[bool]
    """Whether each token takes LongRoPE's long factors `[T]` (`LongRopeSwitch`: its sequence has
    outgrown `original_max_position_embeddings`)."""
    state_slots: list[int]
    """Recurrent-state slot of each sequence `[S]` (-1: the model keeps no state)."""
    lora_slots: list[int]
    """LoRA adapter slot of each token `[T]` (-1: the base model), its sequence's adapter's device slot."""
    logits_indices: list[int]
    """Token rows whose logits are computed, per chunk in order: the positions whose logits score
    the next prompt token (the rows of a request that asked for prompt logprobs), then its last
    token if the chunk ends its sequence (the row that is sampled)."""

    @classmethod
    def empty(cls) -> HostStepInputs:
        """A step with no tokens yet (`query_start_loc` holds its leading 0)."""
        return cls([], [], [], [], [], [0], [], [], [], [])

    @classmethod
    def padding(cls, num_tokens: int, num_seqs: int) -> HostStepInputs:
        """An all-padding step of `num_tokens` tokens in `num_seqs` sequence rows (`STEP_FIELDS`' pad
        values; the tokens all fall in the first row, whose seq_len 0 every backend skips): what
        compiles a shape without touching the KV cache."""
        pads = {name: spec.pad for name, spec in STEP_FIELDS.items()}
        tokens = {name: [pad] * num_tokens for name, pad in pads.items() if STEP_FIELDS[name].rows == "tokens"}
        return cls(**tokens, block_tables=[[0]] * num_seqs, seq_lens=[0] * num_seqs,
                   query_start_loc=[0] + [num_tokens] * num_seqs, state_slots=[-1] * num_seqs, logits_indices=[])

    @property
    def num_tokens(self) -> int:
        """T."""
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        """S."""
        return len(self.seq_lens)

    @property
    def table_width(self) -> int:
        """Blocks in the longest block table."""
        return max((len(t) for t in self.block_tables), default=0)

    def padded_block_tables(self, width: int | None = None) -> list[list[int]]:
        """The block tables as a rectangle of `width` (default: the longest) columns, padded with 0."""
        width = self.table_width if width is None else width
        return [t + [0] * (width - len(t)) for t in self.block_tables]

    def to_device(self, device: torch.device) -> StepTensors:
        """Unpadded device tensors of the step (the eager path: no bucket holds it, or no buckets)."""
        values = {name: getattr(self, name) for name in STEP_FIELDS}
        values["block_tables"] = self.padded_block_tables()
        return StepTensors(*(torch.tensor(values[name], dtype=spec.dtype).to(device)
                             for name, spec in STEP_FIELDS.items()))

    def pack(self, command: int) -> tuple[Tensor, Tensor]:
        """The step for the tensor-parallel wire: an int64 header (command, then `_HEADER`) and one
        int64 payload holding every field in order."""
        payload: list[int] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            payload += [b for row in self.padded_block_tables() for b in row] if field.name == "block_tables" else value
        header = [command, self.num_tokens, self.num_seqs, self.table_width, len(self.logits_indices)]
        return torch.tensor(header, dtype=torch.int64), torch.tensor(payload, dtype=torch.int64)

    @staticmethod
    def payload_size(header: list[int]) -> int:
        """Payload length of a packed step with this header."""
        sizes = dict(zip(_HEADER, header[1:]))
        return sum(_field_sizes(sizes).values())

    @classmethod
    def unpack(cls, header: list[int], payload: Tensor) -> HostStepInputs:
        """Inverse of `pack`."""
        sizes = dict(zip(_HEADER, header[1:]))
        values, start, parts = payload.tolist(), 0, {}
        for name, size in _field_sizes(sizes).items():
            parts[name] = values[start:start + size]
            start += size
        width = sizes["table_width"]
        flat = parts["block_tables"]
        parts["block_tables"] = [flat[i * width:(i + 1) * width] for i in range(sizes["num_seqs"])]
        return cls(**parts)


def _field_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """Entries of each field on the wire, in field order."""
    rows = {"tokens": sizes["num_tokens"], "seqs": sizes["num_seqs"], "seqs+1": sizes["num_seqs"] + 1}
    out = {name: rows[spec.rows] for name, spec in STEP_FIELDS.items()}
    out["block_tables"] *= sizes["table_width"]
    out["logits_indices"] = sizes["num_logits"]
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
        rows = {"tokens": max_tokens, "seqs": max_seqs, "seqs+1": max_seqs + 1}
        shapes = {name: (rows[spec.rows],) for name, spec in STEP_FIELDS.items()}
        shapes["block_tables"] = (max_seqs, max_blocks_per_seq)
        self.tensors = StepTensors(*(torch.full(shapes[name], spec.pad, dtype=spec.dtype, device=device)
                                     for name, spec in STEP_FIELDS.items()))

    def views(self, bucket: int) -> StepTensors:
        """The bucket's slices of every step tensor."""
        rows = {"tokens": bucket, "seqs": seqs_for_bucket(bucket, self.max_seqs)}
        rows["seqs+1"] = rows["seqs"] + 1
        return StepTensors(*(t[:rows[spec.rows]] for t, spec in zip(self.tensors, STEP_FIELDS.values())))

    def fill(self, host: HostStepInputs | None, bucket: int) -> None:
        """Copy a step into the bucket's slices and pad the rest (None = an all-padding step)."""
        views = self.views(bucket)
        num_tokens = 0 if host is None else host.num_tokens
        num_seqs = 0 if host is None else host.num_seqs
        used = {"tokens": num_tokens, "seqs": num_seqs, "seqs+1": num_seqs + 1}
        for name, spec in STEP_FIELDS.items():
            view, n = getattr(views, name), used[spec.rows]
            if host is not None:
                if name == "block_tables":
                    width = host.table_width
                    _copy(view[:n, :width], host.padded_block_tables(width), spec.dtype)
                    # Stale columns from an earlier, longer step would be read by nobody today, but
                    # a captured kernel may scan the whole row: clear them.
                    view[:n, width:].zero_()
                else:
                    _copy(view[:n], getattr(host, name), spec.dtype)
            elif name == "query_start_loc":
                view[:1].zero_()
            # Padded queries are empty: they start and end where the step's tokens end.
            view[n:].fill_(num_tokens if name == "query_start_loc" else spec.pad)


def _copy(dest: Tensor, data: list, dtype: torch.dtype) -> None:
    host = torch.tensor(data, dtype=dtype)
    if dest.device.type == "cuda":
        host = host.pin_memory()
    dest.copy_(host, non_blocking=True)

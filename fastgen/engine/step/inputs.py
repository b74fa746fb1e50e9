"""Flattens a scheduled batch into the executor's `HostStepInputs` (the engine's side of the step
contract: which tokens, at which positions, into which KV slots and recurrent-state slots, with which
LongRoPE factors and LoRA adapter, and whose logits are needed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from fastgen.engine.block_manager import BlockManager
from fastgen.engine.sequence import Sequence
from fastgen.executor.step_inputs import HostStepInputs
from fastgen.models.rope import LongRopeSwitch

if TYPE_CHECKING:  # the scheduler imports this module
    from fastgen.engine.scheduler import ScheduledChunk


def long_rope_namespace(switch: LongRopeSwitch, seq: Sequence) -> int:
    """The prefix-cache namespace of `seq`'s KV: 1 once its tokens take LongRoPE's long factors.

    Blocks of the same tokens hold different K under the two factor sets, so they must never be
    shared across; under Phi-3's rule a sequence whose namespace changes (it just outgrew
    `original_max`) has its KV recomputed by the scheduler.
    """
    return int(switch.sequence_is_long(seq.num_prompt_tokens, seq.num_tokens))


def kv_namespace(long_rope: LongRopeSwitch | None, seq: Sequence) -> int:
    """The prefix-cache namespace of `seq`'s KV: its LoRA adapter's (KV computed under one adapter
    never serves another or the base model), split under LongRoPE by `long_rope_namespace`."""
    return 2 * seq.lora_id + (0 if long_rope is None else long_rope_namespace(long_rope, seq))


def prompt_logit_positions(seq: Sequence, num_new: int) -> range:
    """Positions of a chunk (before it runs) whose logits score the next prompt token: only for the
    sequence that collects the request's prompt logprobs."""
    if seq.prompt_logprobs is None:
        return range(0)
    start = seq.num_computed_tokens
    return range(start, min(start + num_new, seq.num_prompt_tokens - 1))


def build_host_inputs(chunks: list[ScheduledChunk], block_manager: BlockManager,
                      long_rope: LongRopeSwitch | None = None,
                      lora_slots: Mapping[int, int] | None = None) -> HostStepInputs:
    """Flatten scheduled chunks into `HostStepInputs`; `long_rope` is the model's LongRoPE switch
    (None: no token takes long factors beyond what its position implies); `lora_slots` maps each
    adapter of the step (`Sequence.lora_id`; 0, the base model, needs none) to the device slot holding it.

    Each chunk's logits rows, in order: its `prompt_logit_positions`, then, when it `samples`, its
    last token and each of its draft tokens (a verification row: k + 1 rows)."""
    bs = block_manager.block_size
    out = HostStepInputs.empty()
    for chunk in chunks:
        seq, num_new, draft = chunk.seq, chunk.num_new_tokens, chunk.draft_token_ids
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        stop = end + len(draft)
        first_row = out.query_start_loc[-1]
        out.logits_indices.extend(first_row + p - start for p in prompt_logit_positions(seq, num_new))
        table = block_manager.block_table(seq.seq_id)
        out.input_ids.extend(seq.token_ids[start:end])
        out.input_ids.extend(draft)
        out.positions.extend(range(start, stop))
        out.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, stop))
        # Positions >= original_max take the long factors by position; the flag covers the ones below.
        long = long_rope is not None and long_rope.sequence_is_long(seq.num_prompt_tokens, seq.num_tokens)
        out.long_rope.extend([long] * (stop - start))
        out.lora_slots.extend([lora_slots[seq.lora_id] if seq.lora_id else -1] * (stop - start))
        out.seq_lens.append(stop)
        out.query_start_loc.append(out.query_start_loc[-1] + stop - start)
        out.block_tables.append(table)
        out.state_slots.append(block_manager.state_slot(seq.seq_id))
        if chunk.samples:
            out.logits_indices.extend(range(out.query_start_loc[-1] - 1 - len(draft), out.query_start_loc[-1]))
    return out

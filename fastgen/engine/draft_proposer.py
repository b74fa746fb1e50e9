"""A draft model: a second, smaller checkpoint proposing k tokens per row greedily from its own KV cache.

The draft has its own `ModelRunner` (weights, optionally quantized, and a paged KV cache as large in
tokens as the target's) and its own `BlockManager` (no prefix caching: its KV only feeds proposals).
What its cache holds of a sequence is remembered as the real tokens it computed plus the drafts it
fed itself; after the target verified them, the part that still matches the sequence stays, the
rest is recomputed (rejected drafts' slots are overwritten, not freed). Each proposal is one
catch-up step over every row's new tokens, which yields the first draft, then k - 1 one-token steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastgen.engine.block_manager import BlockManager
from fastgen.engine.sequence import Sequence
from fastgen.executor.runner import ModelRunner
from fastgen.executor.step_inputs import HostStepInputs


@dataclass(slots=True)
class _DraftState:
    num_real: int = 0
    """Leading tokens of the sequence whose KV the draft cache holds."""
    drafts: list[int] = field(default_factory=list)
    """Draft tokens whose KV follows them in the cache (fed back while proposing)."""


class DraftModelProposer:
    """Proposes up to k tokens per sequence with a draft model's greedy decoding."""

    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._states: dict[int, _DraftState] = {}

    def release(self, keep: set[int]) -> None:
        """Free the draft KV of every sequence not in `keep` (finished, or waiting to be recomputed)."""
        for seq_id in [s for s in self._states if s not in keep]:
            del self._states[seq_id]
            self.block_manager.free(seq_id)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Drafts for `seqs` (each whose every token but the last has the target's KV), at most
        `limits[i]` (and k) tokens for row i; a row the draft cache has no room for gets none."""
        rows, starts = [], []
        for seq, limit in zip(seqs, limits):
            if limit <= 0:
                continue
            start = self._valid_prefix(seq)
            # The catch-up and the k - 1 drafts fed back need slots up to num_tokens + k - 2.
            if not self.block_manager.allocate(seq.seq_id, range(seq.num_tokens + limit), seq.num_tokens + limit - 1):
                self.release({s.seq_id for s in seqs})
                if not self.block_manager.allocate(seq.seq_id, range(seq.num_tokens + limit),
                                                   seq.num_tokens + limit - 1):
                    self.block_manager.free(seq.seq_id)
                    self._states.pop(seq.seq_id, None)
                    continue
            rows.append((seq, min(limit, self.k)))
            starts.append(start)
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in rows}
        if not rows:
            return [[] for _ in seqs]
        # Catch-up: every row's tokens the draft has not seen, ending with its last token.
        chunks = [(seq, start, seq.token_ids[start:]) for (seq, _), start in zip(rows, starts)]
        next_tokens = self._step(chunks)
        for (seq, _), token in zip(rows, next_tokens):
            drafts[seq.seq_id].append(token)
            self._states[seq.seq_id] = _DraftState(seq.num_tokens)
        for step in range(1, max(limit for _, limit in rows)):
            active = [(seq, limit) for seq, limit in rows if limit > step]
            chunks = [(seq, seq.num_tokens + step - 1, [drafts[seq.seq_id][-1]]) for seq, _ in active]
            next_tokens = self._step(chunks)
            for (seq, _), token in zip(active, next_tokens):
                self._states[seq.seq_id].drafts.append(drafts[seq.seq_id][-1])
                drafts[seq.seq_id].append(token)
        return [drafts.get(seq.seq_id, []) for seq in seqs]

    def _valid_prefix(self, seq: Sequence) -> int:
        """Tokens of `seq` whose draft KV is still right (at most all but the last, whose logits are needed)."""
        state = self._states.get(seq.seq_id)
        if state is None:
            return 0
        valid = min(state.num_real, seq.num_tokens)
        for token in state.drafts:
            if valid >= seq.num_tokens or seq.token_ids[valid] != token:
                break
            valid += 1
        return min(valid, seq.num_tokens - 1)

    def _step(self, chunks: list[tuple[Sequence, int, list[int]]]) -> list[int]:
        """Run the draft over `(seq, first position, tokens)` chunks; each row's greedy next token."""
        bs = self.block_manager.block_size
        host = HostStepInputs.empty()
        for seq, start, tokens in chunks:
            table = self.block_manager.block_table(seq.seq_id)
            end = start + len(tokens)
            host.input_ids.extend(tokens)
            host.positions.extend(range(start, end))
            host.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            host.long_rope.extend([False] * len(tokens))
            host.lora_slots.extend([-1] * len(tokens))  # the draft model carries no adapters
            host.seq_lens.append(end)
            host.query_start_loc.append(host.query_start_loc[-1] + len(tokens))
            host.block_tables.append(table)
            host.logits_indices.append(host.query_start_loc[-1] - 1)
        logits = self.runner.execute(host)
        return logits.argmax(dim=-1).tolist()

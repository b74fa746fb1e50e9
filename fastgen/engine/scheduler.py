"""Dynamic SplitFuse scheduling: one token budget per step, decodes first, prompts fill the rest.

Every step spends at most `token_budget` tokens over at most `max_seqs` sequences:
1. one token for every running sequence that is decoding, oldest first;
2. the rest of the budget goes to sequences that still have uncomputed tokens (prompt chunks,
   or the whole history of a preempted sequence), running ones first, then waiting ones in
   arrival order; the last chunk is cut to fill the budget exactly.
Long prompts are thus split across steps and short ones fused into one, so every step costs
about the same and decode latency stays steady (FastGen's Dynamic SplitFuse).

A chunk's tokens also attend over every earlier token of their sequence, so a chunk deep into a
long prompt costs more than one at its start. With `context_per_budget_token` = K > 0 a prompt
chunk of n tokens at offset c spends n + ceil((n*c + n(n+1)/2) / K) of the budget: one token each,
plus one per K attended positions (K = the positions whose attention costs as much as one token's
pass through the linears). Deeper chunks are shorter and the steps stay level. Decode rows spend
one token each: their attention is there whether or not a prompt is chunked beside them, and
charging it could leave a prompt no budget at all. A chunk gets at least one token while any
budget is left, so a prompt always progresses.

With speculative decoding (a `Speculator`) a decode row also computes its draft tokens, charged one
budget token each beside its own, their KV in lookahead slots (see `speculator.py`); a row whose
drafts' slots cannot be had decodes without them rather than preempt anyone.

When the KV cache is full, the newest running sequence is preempted: its blocks are freed and
it goes back to the waiting queue, ahead of every newer request, to be recomputed later (its generated tokens are
kept, so its output does not change). New requests are never admitted by preempting others,
so the oldest request always makes progress: nothing starves.

A running sequence whose KV namespace (`kv_namespace`) changes is requeued the same way, its KV
recomputed: Phi-3's LongRoPE computes every token with other factors once a sequence outgrows
`original_max_position_embeddings`, as Hugging Face's generate does.

With LoRA a step uses at most `max_loras` distinct adapters (the device slots): a running sequence
whose adapter would make one more waits for a later step, and admission stops at the first waiting
sequence whose adapter does not fit, as it stops when blocks run out, so FCFS holds.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fastgen.engine.block_manager import BlockManager
from fastgen.engine.sequence import Sequence, SequenceStatus
from fastgen.engine.speculator import Speculator
from fastgen.engine.step.inputs import prompt_logit_positions
from fastgen.engine.step.output import SequenceUpdate, StepOutput, TokenLogprobs
from fastgen.engine.stop_rules import StopRules

logger = logging.getLogger("fastgen")


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's share of a step: which of its pending tokens are computed, and what rides along.

    Per-row extras of later features are fields here (filled by the scheduler, flattened by
    `step.inputs.build_host_inputs`, read back by the executor), e.g. draft tokens to verify
    (charged to the token budget like any computed token), a grammar bitmask row, a LoRA adapter
    slot, a recurrent-state slot: see docs/architecture.md, "Where to add what".
    """

    seq: Sequence
    """The sequence."""
    num_new_tokens: int
    """How many of its uncomputed tokens this step computes (from `seq.num_computed_tokens` on)."""
    samples: bool
    """Whether this chunk samples: after it every token of `seq` has KV, so the logits of its last
    row choose the next token(s). The one place this rule is decided; inputs, executor and `update`
    all read it."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding's drafts for a decode row, computed after its pending token (their KV in
    lookahead slots) and verified from the k + 1 logits rows; empty for every other chunk."""


@dataclass(slots=True)
class ScheduledBatch:
    """What one step computes: one `ScheduledChunk` per sequence, decodes first."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    """Each sequence and how many of its uncomputed tokens this step computes."""
    preempted: list[Sequence] = field(default_factory=list)
    """Sequences preempted while building this batch (their KV was freed)."""
    budget_spent: int = 0
    """Token budget the chunks spent: their tokens plus the attention charge of prompt chunks."""
    lora_ids: set[int] = field(default_factory=set)
    """The LoRA adapters the chunks run under (`Sequence.lora_id`; the base model's 0 not counted)."""

    @property
    def num_tokens(self) -> int:
        """Tokens computed by this step (drafts included)."""
        return sum(c.num_new_tokens + len(c.draft_token_ids) for c in self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)


class Scheduler:
    """Decides, step by step, which tokens of which sequences are computed."""

    def __init__(self, block_manager: BlockManager, token_budget: int, max_seqs: int,
                 kv_namespace: Callable[[Sequence], int] | None = None, context_per_budget_token: int = 0,
                 stop_rules: StopRules | None = None, speculator: Speculator | None = None,
                 max_loras: int = 0) -> None:
        """`stop_rules`: when sequences finish (default: by their own `SamplingParams` only).
        `max_loras`: distinct LoRA adapters a step may use (0: LoRA is off, every sequence runs the base).
        `speculator`: proposes draft tokens for decode rows (None: no speculative decoding).
        `kv_namespace(seq)`: the prefix-cache namespace a sequence's KV is computed in now (None:
        always 0; see `BlockManager.match_prefix`). `context_per_budget_token`: the attention charge
        of prompt chunks (the module's docstring; 0 = chunks spend their tokens only)."""
        for name, value in (("token_budget", token_budget), ("max_seqs", max_seqs),
                            ("context_per_budget_token", context_per_budget_token)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if context_per_budget_token < 0:
            raise ValueError(f"context_per_budget_token must be >= 0, got {context_per_budget_token}")
        if not 1 <= max_seqs <= token_budget:
            raise ValueError(f"max_seqs must be in [1, token_budget={token_budget}], got {max_seqs}")
        self.block_manager = block_manager
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, list[Sequence]] = {}
        """Every unfinished request's sequences (choices), by request id."""
        self.stop_rules = stop_rules or StopRules()
        self.kv_namespace = kv_namespace
        self.context_per_budget_token = context_per_budget_token
        self.speculator = speculator
        self.max_loras = max_loras

    def add_request(self, seqs: list[Sequence]) -> None:
        """Queue a request's choices (one `Sequence` each, same request id and prompt): the first by
        priority (lower first), then arrival order; the others start once it has computed the
        prompt, sharing its KV blocks (`fork_children`)."""
        request_id = seqs[0].request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = seqs
        seqs[0].children = seqs[1:]
        seqs[0].status = SequenceStatus.WAITING
        self._enqueue(seqs[0])

    def _enqueue(self, seq: Sequence) -> None:
        key = _order(seq)
        # Mostly appends: scan from the back for the first sequence that goes before this one.
        index = len(self.waiting)
        while index > 0 and _order(self.waiting[index - 1]) > key:
            index -= 1
        self.waiting.insert(index, seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Build the next step's batch within the token budget and `max_seqs`."""
        batch = ScheduledBatch()
        scheduled: set[int] = set()
        if self.kv_namespace is not None:
            for seq in [s for s in self.running if self.block_manager.namespace(s.seq_id) != self._namespace(s)]:
                self._requeue(seq)
        # Decodes before chunks; among each, most urgent (priority, then oldest) first, so the least
        # urgent is the one preempted.
        running = sorted(self.running, key=lambda s: (s.num_pending_tokens > 1, _order(s)))
        drafts = self._propose(running)
        for seq in running:
            if self._left(batch) <= 0 or len(batch.chunks) == self.max_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING or not self._lora_fits(batch, seq):
                continue  # preempted earlier in this loop, or its adapter has no device slot this step
            num_new = self.fit(seq, self._left(batch))
            draft = drafts.get(seq.seq_id, [])[:self._left(batch) - num_new]
            if draft and not self.block_manager.allocate(seq.seq_id, seq.token_ids, seq.num_computed_tokens + num_new,
                                                         self._namespace(seq), num_lookahead=len(draft)):
                draft = []  # no room for its drafts: it decodes plainly (and may preempt, as any row)
            if not draft and not self._allocate_or_preempt(seq, num_new, scheduled, batch):
                continue
            self._add(batch, seq, num_new, draft)
            scheduled.add(seq.seq_id)
        if not batch.preempted:
            self._admit_waiting(batch)
        return batch

    def charge(self, seq: Sequence, num_new: int) -> int:
        """Budget tokens that computing `num_new` of `seq`'s pending tokens spends: one each, plus the
        attention charge when they are a prompt chunk (more than one token pending)."""
        if not self.context_per_budget_token or seq.num_pending_tokens == 1:
            return num_new
        attended = num_new * seq.num_computed_tokens + num_new * (num_new + 1) // 2
        return num_new + -(-attended // self.context_per_budget_token)

    def fit(self, seq: Sequence, budget: int) -> int:
        """The most of `seq`'s pending tokens whose charge fits `budget` (at least one, for progress)."""
        low, high = 1, min(seq.num_pending_tokens, budget)
        if self.context_per_budget_token:
            while low < high:  # the charge grows with the chunk: the longest that fits
                mid = (low + high + 1) // 2
                low, high = (mid, high) if self.charge(seq, mid) <= budget else (low, mid - 1)
        return high

    def _lora_fits(self, batch: ScheduledBatch, seq: Sequence) -> bool:
        """Whether `seq` may join the step: it runs the base model, an adapter already in the step, or
        one that a free device slot can take."""
        return not seq.lora_id or seq.lora_id in batch.lora_ids or len(batch.lora_ids) < self.max_loras

    def _left(self, batch: ScheduledBatch) -> int:
        return self.token_budget - batch.budget_spent

    def _propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        """The speculator's drafts for the decode rows among `running` (by `seq_id`)."""
        if self.speculator is None:
            return {}
        self.speculator.release({seq.seq_id for seq in running})
        return self.speculator.propose([seq for seq in running if seq.num_pending_tokens == 1])

    def _add(self, batch: ScheduledBatch, seq: Sequence, num_new: int, draft: list[int] | None = None) -> None:
        draft = draft or []
        batch.budget_spent += self.charge(seq, num_new) + len(draft)
        if seq.lora_id:
            batch.lora_ids.add(seq.lora_id)
        batch.chunks.append(ScheduledChunk(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens, draft))

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
        """Get KV blocks for `seq`, preempting the newest unscheduled running sequences if needed.

        Returns False if `seq` itself had to be preempted.
        """
        target = seq.num_computed_tokens + num_new
        while not self.block_manager.allocate(seq.seq_id, seq.token_ids, target, self._namespace(seq)):
            victims = [s for s in self.running if s.seq_id not in scheduled and s.status is SequenceStatus.RUNNING]
            victim = max(victims, key=_order)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, batch: ScheduledBatch) -> None:
        """Start waiting sequences in arrival order while budget, seats and blocks last (skipping those
        not `ready`: a structured-output grammar still compiling)."""
        while self._left(batch) > 0 and len(batch.chunks) < self.max_seqs:
            # A sequence whose grammar still compiles keeps its place and lets the ones behind it go.
            seq = next((s for s in self.waiting if s.ready), None)
            if seq is None or not self._lora_fits(batch, seq):
                break
            # Cached tokens have no logits: a request for prompt logprobs computes its whole prompt.
            if seq.num_computed_tokens == 0 and seq.prompt_logprobs is None:
                cached = self.block_manager.match_prefix(seq.seq_id, seq.token_ids, self._namespace(seq))
                seq.num_computed_tokens = cached
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt_tokens = cached
            num_new = self.fit(seq, self._left(batch))
            if not self.block_manager.allocate(seq.seq_id, seq.token_ids, seq.num_computed_tokens + num_new,
                                               self._namespace(seq)):
                # Keep the prefix hit for the next try would pin blocks while waiting: let go.
                self.block_manager.free(seq.seq_id)
                seq.num_computed_tokens = 0
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, num_new)

    def _namespace(self, seq: Sequence) -> int:
        return 0 if self.kv_namespace is None else self.kv_namespace(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free `seq`'s KV and put it back in the queue, in arrival order, to be recomputed."""
        self._requeue(seq)
        batch.preempted.append(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Free `seq`'s KV and put it back in the waiting queue, in arrival order."""
        self.block_manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        # Back in (priority, arrival) order, ahead of everything newer, so FCFS holds strictly even
        # when an older sequence preempted itself earlier in the same step.
        index = next((i for i, s in enumerate(self.waiting) if _order(s) > _order(seq)), len(self.waiting))
        self.waiting.insert(index, seq)

    def update(self, batch: ScheduledBatch, output: StepOutput) -> list[SequenceUpdate]:
        """Apply an executed step: end the requests that failed, advance each chunk's
        `num_computed_tokens`, start the other choices of a request whose prompt is now computed,
        append each sampling row's tokens (stopping at the first that finishes it: EOS, stop id or
        string, length), finish and free what ended. Returns, in chunk order, an update per sequence
        that got tokens and one per failed request (its `error`, no tokens)."""
        updates: list[SequenceUpdate] = []
        for request_id, error in output.failed.items():
            seqs = self.requests.get(request_id)
            if seqs is not None:
                self._end_request(request_id, "error")
                updates.append(SequenceUpdate(seqs[0], error=error))
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.is_finished:
                continue  # its request failed or was aborted in this step
            entries = output.prompt_logprobs.get(seq.seq_id, ())
            for position, entry in zip(prompt_logit_positions(seq, chunk.num_new_tokens), entries):
                if len(seq.prompt_logprobs) == position + 1:  # else recomputed after a preemption: recorded
                    seq.prompt_logprobs.append(entry)
            seq.num_computed_tokens += chunk.num_new_tokens
            if not chunk.samples:
                continue
            if seq.children and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.fork_children(seq)
            tokens = output.sampled_token_ids[seq.seq_id]  # a sampling row without tokens is the engine's bug
            try:
                updates.append(self._append(seq, tokens, output.logprobs.get(seq.seq_id)))
                if chunk.draft_token_ids and not seq.is_finished:
                    # Verification emits the accepted drafts, then one more token: the accepted
                    # drafts' KV was written by this step, so every token but the last has KV.
                    seq.num_computed_tokens = seq.num_tokens - 1
            except Exception as exc:  # a detokenizer fault: only this request ends
                error = output.fail(seq.request_id, "detokenizing", exc)
                logger.error("%s", error, exc_info=exc)
                updates = [u for u in updates if u.seq.request_id != seq.request_id]
                self._end_request(seq.request_id, "error")
                updates.append(SequenceUpdate(seq, error=error))
        return updates

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs] | None) -> SequenceUpdate:
        """Append `tokens` to `seq` one by one under the stop rules; the first that stops it is the last."""
        update = SequenceUpdate(seq, logprobs=None if logprobs is None else [])
        texts = []
        for i, token in enumerate(tokens):
            seq.append_token(token)
            update.token_ids.append(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
                update.logprobs.append(logprobs[i])
            text, reason = self.stop_rules.check(seq, token)
            texts.append(text)
            if reason is not None:
                self.finish(seq, reason)
                break
        update.text = "".join(texts)
        return update

    def fork_children(self, parent: Sequence) -> list[Sequence]:
        """Start `parent`'s n-1 sibling choices, sharing its prompt's full KV blocks.

        Called once the parent's prompt KV exists. Each child recomputes only the prompt tail that
        sits in the parent's partly filled last block, then samples its own first token.
        """
        started = []
        for child in parent.children:
            child.num_computed_tokens = self.block_manager.fork(parent.seq_id, child.seq_id, child.num_prompt_tokens)
            child.num_cached_prompt_tokens = child.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            started.append(child)
        parent.children = []
        return started

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished (or aborted) and release its blocks and its unstarted children."""
        for child in seq.children:
            child.status = SequenceStatus.FINISHED
            child.finish_reason = reason
        seq.children = []
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[seq.request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        """End every unfinished choice of a request with "abort" and free its KV; returns all its
        sequences (unknown or already finished id: [])."""
        return self._end_request(request_id, "abort")

    def _end_request(self, request_id: str, reason: str) -> list[Sequence]:
        seqs = self.requests.pop(request_id, [])
        for seq in seqs:
            if not seq.is_finished:
                self.finish(seq, reason)
        return seqs


def _order(seq: Sequence) -> tuple[int, int, int]:
    """Scheduling order: lower priority value first, then first come, first served; the choices of one
    request (one arrival) by their index, so one of them is always the oldest: without a strict order
    two choices recomputing after preemption could preempt each other in turn forever."""
    return (seq.params.priority, seq.arrival, seq.index)

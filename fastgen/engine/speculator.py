"""Speculative decoding in the engine: which rows draft, their drafts, and what verification accepted.

A step's decode rows ask the `Speculator` for drafts before the scheduler places them
(`Scheduler.schedule`), so a row's k drafts are charged to the token budget with its own decode
token and their KV slots are reserved beside it (lookahead slots, never registered in the prefix
cache). The row then computes its last token and the k drafts in one pass; the executor verifies
the k + 1 logits rows with the rejection sampler (`row_sampling.verify_rows`) and `Scheduler.update`
appends what was accepted, plus the bonus or corrected token, under the stop rules. Rejected drafts'
slots stay the sequence's and are rewritten by a later step.

Which rows draft: decode rows (one token pending) while the step has at most
`disable_by_batch_size` of them (the plan's estimate of where verification stops paying) and, below
that, while steps of that many rows measured faster verifying drafts than not (`SpeculationGovernor`;
a seeded row keeps drafting whatever the measurements say, so that its output does not depend on
timing), except
rows below their `min_new_tokens` or with `bad_words` (their bans depend on the tokens before each
position): those decode without drafts, their tokens exactly what plain decoding gives. A row under a
structured-output grammar keeps the drafts its grammar allows, and each verified position gets the
grammar's mask after the drafts before it.

Each row also adapts to what verification accepts of its own drafts: a row proposes at most one
more draft than it had accepted last time (its `k` comes back as its drafts keep being accepted),
and a row whose drafts were all rejected backs off (proposes nothing for 1, 2, 4, ... up to 16
steps). Chat text, where lookup mostly proposes wrong tokens, thus decodes at nearly the plain rate,
while copy-heavy text keeps drafting k tokens a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_BACKOFF_STEPS = 16
"""The longest a row whose drafts keep being rejected goes without proposing (steps)."""

from fastgen.engine.draft_proposer import DraftModelProposer
from fastgen.engine.ngram_proposer import NgramProposer
from fastgen.engine.sequence import Sequence
from fastgen.engine.speculation_governor import SpeculationGovernor
from fastgen.engine.stop_rules import StopRules
from fastgen.planning.speculative import SpeculativeConfig


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters of verification since start-up (vLLM's `vllm:spec_decode_*` metrics read them)."""

    num_drafts: int = 0
    """Rows verified with at least one draft token."""
    num_draft_tokens: int = 0
    """Draft tokens verified."""
    num_accepted_tokens: int = 0
    """Draft tokens accepted."""
    accepted_per_position: list[int] = field(default_factory=list)
    """Per draft position j (0-based), how many rows accepted their j-th draft."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verified row: `num_drafts` drafted, the first `num_accepted` of them accepted."""
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass(slots=True)
class _RowState:
    """How one sequence's drafts fared: its next draft length and its back-off."""

    max_drafts: int
    """Drafts it may propose next (1 more than it had accepted, up to k)."""
    backoff: int = 0
    """Steps it skips after its last all-rejected verification (doubles each time, to MAX_BACKOFF_STEPS)."""
    skip: int = 0
    """Steps left to skip."""


class Speculator:
    """Proposes draft tokens for a step's decode rows (n-gram lookup or a draft model) and counts
    what verification accepted."""

    def __init__(self, config: SpeculativeConfig, stop_rules: StopRules,
                 draft_model: DraftModelProposer | None = None) -> None:
        """`config` is the plan's (its `disable_by_batch_size` set); `draft_model` proposes for
        method "draft_model" (required then, refused otherwise)."""
        if (config.method == "draft_model") != (draft_model is not None):
            raise ValueError(f"speculative_config method {config.method!r} "
                             f"{'needs' if draft_model is None else 'takes no'} draft model: build the engine's "
                             "runners with fastgen.engine.builder.build_runner(config, plan)")
        self.config = config
        self.k = config.num_speculative_tokens
        self.stop_rules = stop_rules
        self.draft_model = draft_model
        self.ngram = None if draft_model is not None else NgramProposer(
            self.k, config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodeStats()
        self.governor = SpeculationGovernor(config.disable_by_batch_size)
        """Which decode batch sizes verify drafts, by what each choice measured (`Engine.step` reports)."""
        self._rows: dict[int, _RowState] = {}

    def limit(self, seq: Sequence) -> int:
        """How many drafts `seq` may verify next step: k, fewer near its length limits (the bonus
        token must still fit), 0 when a rule constrains its next tokens (see the module)."""
        params = seq.params
        if seq.bad_words_ids or len(seq.output_token_ids) < params.min_new_tokens or seq.num_pending_tokens != 1:
            return 0
        state = self._rows.get(seq.seq_id)
        limit = self.k if state is None else (0 if state.skip else state.max_drafts)
        max_len = self.stop_rules.max_length(seq)
        if max_len is not None:
            limit = min(limit, max_len - seq.num_tokens - 1)
        if params.max_new_tokens is not None:
            limit = min(limit, params.max_new_tokens - len(seq.output_token_ids) - 1)
        return max(limit, 0)

    def propose(self, decode_rows: list[Sequence]) -> dict[int, list[int]]:
        """Drafts per `seq_id` for this step's decode rows (those without drafts left out); none at
        all when there are more rows than `disable_by_batch_size`."""
        disable = self.config.disable_by_batch_size
        if not decode_rows or (disable is not None and len(decode_rows) > disable):
            return {}
        measured_faster = self.governor.allows(len(decode_rows))
        limits = [self.limit(seq) if measured_faster or seq.generator is not None else 0 for seq in decode_rows]
        for seq in decode_rows:  # this step counts towards each backing-off row's skip
            state = self._rows.get(seq.seq_id)
            if state is not None and state.skip:
                state.skip -= 1
        if self.draft_model is not None:
            drafts = self.draft_model.propose(decode_rows, limits)
        else:
            drafts = [self.ngram.propose(seq.token_ids, limit) if limit else [] for seq, limit in zip(decode_rows, limits)]
        # A structured-output row verifies only the drafts its grammar allows (one mask per position).
        drafts = [draft[:seq.grammar.valid_prefix(seq.output_token_ids, draft)] if draft and seq.grammar else draft
                  for seq, draft in zip(decode_rows, drafts)]
        return {seq.seq_id: draft for seq, draft in zip(decode_rows, drafts) if draft}

    def observe(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """What verification accepted of one row's drafts: counted, and the row's next draft length
        and back-off set from it (see the module)."""
        self.stats.record(num_drafts, num_accepted)
        if num_drafts == 0:
            return
        state = self._rows.setdefault(seq_id, _RowState(self.k))
        state.max_drafts = min(self.k, num_accepted + 1)
        if num_accepted:
            state.backoff = 0
        else:
            state.backoff = min(MAX_BACKOFF_STEPS, max(1, 2 * state.backoff))
            state.skip = state.backoff

    def release(self, keep: set[int]) -> None:
        """Forget the row state, and the draft model's KV, of every sequence not in `keep` (not
        running any more)."""
        for seq_id in [s for s in self._rows if s not in keep]:
            del self._rows[seq_id]
        if self.draft_model is not None:
            self.draft_model.release(keep)

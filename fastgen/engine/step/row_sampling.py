"""The glue between sequences and the `Sampler`: one step's sampling rows in, token ids and
logprob dicts out (one host sync); the same for verification rows of speculative decoding (through
the `RejectionSampler`); and the scores of the prompt tokens a request asked logprobs for."""

from __future__ import annotations

import torch

from fastgen.engine.grammar import StructuredOutputManager
from fastgen.engine.rejection_sampler import RejectionSampler
from fastgen.engine.step.sampler import Sampler
from fastgen.engine.step.sampling_metadata import SamplingMetadata
from fastgen.engine.sequence import Sequence
from fastgen.engine.step.output import TokenLogprobs
from fastgen.engine.stop_rules import StopRules


def sample_rows(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], vocab_size: int,
                stop_rules: StopRules, structured_outputs: StructuredOutputManager | None = None,
                ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The next token of each sequence (row i of `logits` is `seqs[i]`'s), and per row its logprob
    dict when its request asked (None otherwise). `structured_outputs` fills the grammar bitmask of
    the constrained rows; on a GPU that host work overlaps the forward pass still running."""
    banned = [stop_rules.banned_tokens(s) for s in seqs]
    bitmask, grammar_rows = (None, []) if structured_outputs is None else structured_outputs.fill_bitmask(seqs)
    md = SamplingMetadata.build(
        [s.params for s in seqs], [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
        [s.generator for s in seqs], vocab_size, logits.device, banned if any(banned) else None,
        grammar_bitmask=bitmask, grammar_rows=grammar_rows,
    )
    out = sampler(logits, md)
    tokens = out.sampled_token_ids.tolist()
    if out.logprobs is None:
        return tokens, [None] * len(tokens)
    lp, ids = out.logprobs.tolist(), out.logprob_token_ids.tolist()
    return tokens, [_logprob_dict(seq, lp_row, id_row) for seq, lp_row, id_row in zip(seqs, lp, ids)]


def verify_rows(rejection_sampler: RejectionSampler, logits: torch.Tensor, seqs: list[Sequence],
                drafts: list[list[int]], vocab_size: int, stop_rules: StopRules,
                structured_outputs: StructuredOutputManager | None = None,
                ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """The tokens each verification row emits (its accepted drafts, then the bonus or corrected
    token) and per emitted token its logprob dict when asked. Row i of `seqs` owns `len(drafts[i]) + 1`
    consecutive rows of `logits`, each processed as plain sampling would at that position (penalties
    count the drafts before it, a grammar's mask follows them). Rows without drafts sample as
    `sample_rows` would; only they may have banned tokens (the `Speculator` drafts for no such row)."""
    positions = [seq for seq, draft in zip(seqs, drafts) for _ in range(len(draft) + 1)]
    histories = [seq.output_token_ids + draft[:j] for seq, draft in zip(seqs, drafts) for j in range(len(draft) + 1)]
    banned = [stop_rules.banned_tokens(seq) if not draft else [] for seq, draft in zip(seqs, drafts)
              for _ in range(len(draft) + 1)]
    bitmask, grammar_rows = (None, []) if structured_outputs is None else \
        structured_outputs.fill_bitmask(positions, histories)
    md = SamplingMetadata.build(
        [s.params for s in positions], [s.prompt_token_ids for s in positions], histories,
        [s.generator for s in positions], vocab_size, logits.device, banned if any(banned) else None,
        grammar_bitmask=bitmask, grammar_rows=grammar_rows,
    )
    verified = rejection_sampler(logits, md, drafts, [seq.generator for seq in seqs])
    if verified.logprobs is None:
        return verified.token_ids, [None] * len(seqs)
    rows: list[list[TokenLogprobs] | None] = []
    for seq, lp_rows, id_rows in zip(seqs, verified.logprobs, verified.logprob_token_ids):
        rows.append(None if seq.params.logprobs is None else
                    [_logprob_dict(seq, lp, ids) for lp, ids in zip(lp_rows, id_rows)])
    return verified.token_ids, rows


def _logprob_dict(seq: Sequence, lp_row: list[float], id_row: list[int]) -> TokenLogprobs | None:
    """{token: logprob} of the chosen token and the top-N `seq` asked for (None when it asked none)."""
    n = seq.params.logprobs
    return None if n is None else dict(zip(id_row[: 1 + n], lp_row[: 1 + n]))


def score_prompt_tokens(logits: torch.Tensor, owners: list[tuple[Sequence, int]]) -> list[TokenLogprobs]:
    """Row i of `logits` predicts prompt position `owners[i][1] + 1` of sequence `owners[i][0]`: its
    {token: logprob} for that prompt token and the top-N the request asked (`prompt_logprobs`)."""
    device = logits.device
    scores = logits.float().log_softmax(dim=-1)
    targets = [seq.prompt_token_ids[position + 1] for seq, position in owners]
    chosen = scores.gather(1, torch.tensor(targets, device=device).unsqueeze(1)).squeeze(1).tolist()
    num_top = min(max(seq.params.prompt_logprobs for seq, _ in owners), scores.shape[1])
    top_lp, top_ids = scores.topk(num_top, dim=-1) if num_top else (scores[:, :0], scores[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    entries = []
    for i, (seq, _) in enumerate(owners):
        entry = {targets[i]: chosen[i]}
        n = seq.params.prompt_logprobs
        for token_id, lp in zip(top_ids[i][:n], top_lp[i][:n]):
            entry.setdefault(token_id, lp)
        entries.append(entry)
    return entries

"""Verification of draft tokens on the device: the rejection sampler of speculative decoding.

A verification row carries k draft tokens d_1..d_k and the target's logits at k + 1 positions (after
the last accepted token and after each draft). Each position's logits go through the sampler's own
processing first (bias, masks, penalties, temperature, top-k/p, min-p), so the target distribution
p_j is what plain sampling would draw from. Then, position by position (Leviathan et al. 2023,
Chen et al. 2023):

- a greedy row accepts d_j while it is the argmax of p_j: the output is exactly the greedy chain;
- a sampled row accepts d_j with probability min(1, p_j(d_j) / q_j(d_j)), q_j being the draft's
  distribution (a point mass on d_j for n-gram lookup and a greedy draft model: then p_j(d_j));
- at the first rejection the row emits a token drawn from normalize(max(0, p_j - q_j)) and stops;
  when all k are accepted it emits a bonus token drawn from p_{k+1}.

Every emitted token is then distributed exactly as the target's (the proof is the papers'), and a
row emits between 1 and k + 1 tokens. Seeded rows draw their uniforms and noise from their own
generator, so a seeded request repeats itself whatever it is batched with. One host sync per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fastgen.engine.step.sampler import Sampler, _first_argmax, exponential_noise
from fastgen.engine.step.sampling_metadata import SamplingMetadata


@dataclass(slots=True)
class VerifiedTokens:
    """What verification emitted, per row, on the host."""

    token_ids: list[list[int]]
    """Per row the accepted drafts then the bonus or corrected token (1 to k + 1 tokens)."""
    num_accepted: list[int]
    """Per row how many drafts were accepted."""
    logprobs: list[list[list[float]]] | None = None
    """Per row and emitted token: raw-model logprob of the token, then the top-K (as `SamplerOutput`);
    None when no row asked."""
    logprob_token_ids: list[list[list[int]]] | None = None
    """The token ids of `logprobs`' columns."""


class RejectionSampler:
    """Accepts or rejects each row's draft tokens against the target's logits; stateless."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or Sampler()

    def __call__(self, logits: Tensor, metadata: SamplingMetadata, draft_token_ids: list[list[int]],
                 generators: list[torch.Generator | None], draft_probs: Tensor | None = None) -> VerifiedTokens:
        """Verify the drafts of R rows.

        `logits` [P, V]: row r's k_r + 1 positions in order, rows one after another
        (P = sum(k_r + 1)); `metadata` has one row per position (each position processed with the
        tokens before it: penalties count the drafts ahead of it); `draft_token_ids[r]` has k_r
        tokens; `generators[r]` is row r's request generator (None: the default one); `draft_probs`
        [sum(k_r), V] the draft's distribution at each draft (None: a point mass on the draft).
        """
        device = logits.device
        counts = [len(d) for d in draft_token_ids]
        num_rows, num_positions = len(counts), sum(counts) + len(counts)
        if logits.shape[0] != num_positions:
            raise ValueError(f"logits has {logits.shape[0]} rows; {num_rows} rows with {sum(counts)} drafts "
                             f"need {num_positions}")
        if len(generators) != num_rows:
            raise ValueError(f"generators has {len(generators)} rows, drafts {num_rows}")
        if draft_probs is not None and draft_probs.shape[0] != sum(counts):
            raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows for {sum(counts)} drafts")
        k_max = max(counts)
        starts = [0]
        for k in counts:
            starts.append(starts[-1] + k + 1)
        row_start = torch.tensor(starts[:-1], device=device)
        scores = self.sampler.process_logits(logits, metadata)
        greedy_rows = _greedy_rows(metadata, row_start)
        probs = None if metadata.all_greedy else scores.softmax(dim=-1)
        argmax = _first_argmax(scores)

        # Acceptance of every draft, laid out [R, k_max] (False past a row's drafts).
        draft_pos = [starts[r] + j for r, k in enumerate(counts) for j in range(k)]
        accepted = torch.zeros(num_rows, max(k_max, 1), dtype=torch.bool, device=device)
        if draft_pos:
            pos = torch.tensor(draft_pos, device=device)
            drafts = torch.tensor([t for d in draft_token_ids for t in d], device=device)
            accept = argmax[pos] == drafts
            if probs is not None:
                p = probs[pos, drafts]
                q = torch.ones_like(p) if draft_probs is None else draft_probs[torch.arange(len(draft_pos),
                                                                                          device=device), drafts]
                uniform = self._uniforms(counts, generators, metadata, device)
                accept = torch.where(greedy_rows.repeat_interleave(torch.tensor(counts, device=device)),
                                     accept, uniform * q < p)
            rows = torch.tensor([r for r, k in enumerate(counts) for _ in range(k)], device=device)
            cols = torch.tensor([j for k in counts for j in range(k)], device=device)
            accepted[rows, cols] = accept
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
        final_pos = row_start + num_accepted

        # The token after the accepted drafts: argmax for greedy rows; for sampled rows a draw from p
        # (bonus) or from the residual max(0, p - q) at the rejected draft.
        final = argmax[final_pos]
        if probs is not None:
            dist = probs[final_pos].clone()
            rejected = num_accepted < torch.tensor(counts, device=device)
            if draft_pos:
                flat_draft = (torch.tensor(starts[:-1], device=device) - torch.arange(num_rows, device=device)
                              + num_accepted).clamp(max=max(len(draft_pos) - 1, 0))
                rejected_token = drafts[flat_draft]
                if draft_probs is None:
                    residual = dist.scatter(1, rejected_token.unsqueeze(1), 0.0)
                else:
                    residual = (dist - draft_probs[flat_draft]).clamp_(min=0.0)
                # p == q leaves nothing: then the draft was accepted with probability 1, never rejected.
                residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, dist)
                dist = torch.where(rejected.unsqueeze(1), residual, dist)
            noise = exponential_noise(dist, metadata.any_unseeded,
                                      ((row, g) for row, g in enumerate(generators) if g is not None))
            sampled = _first_argmax(dist.div_(noise))
            final = torch.where(greedy_rows, final, sampled)

        out = torch.zeros(num_rows, k_max + 1, dtype=torch.int64, device=device)
        if draft_pos:
            out[rows, cols] = drafts
        out.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
        lp = ids = None
        if metadata.max_num_logprobs is not None:
            lp, ids = self._logprobs(logits, metadata, out, row_start, counts)
        host_out, host_accepted = out.tolist(), num_accepted.tolist()
        result = VerifiedTokens([row[:a + 1] for row, a in zip(host_out, host_accepted)], host_accepted)
        if lp is not None:
            lp, ids = lp.tolist(), ids.tolist()
            result.logprobs = [lp[r][:a + 1] for r, a in enumerate(host_accepted)]
            result.logprob_token_ids = [ids[r][:a + 1] for r, a in enumerate(host_accepted)]
        return result

    @staticmethod
    def _uniforms(counts: list[int], generators: list[torch.Generator | None], metadata: SamplingMetadata,
                  device: torch.device) -> Tensor:
        """One U(0, 1) per draft; a seeded row's from its own generator."""
        uniform = torch.rand(sum(counts), device=device) if metadata.any_unseeded else torch.empty(
            sum(counts), device=device)
        offset = 0
        for k, generator in zip(counts, generators):
            if generator is not None and k:
                uniform[offset:offset + k] = torch.rand(k, device=device, generator=generator)
            offset += k
        return uniform

    @staticmethod
    def _logprobs(logits: Tensor, metadata: SamplingMetadata, out: Tensor, row_start: Tensor,
                  counts: list[int]) -> tuple[Tensor, Tensor]:
        """Raw-model logprobs [R, k_max + 1, 1 + K] of each emitted token and the top-K at its position."""
        raw = torch.log_softmax(logits.float(), dim=-1)
        width = out.shape[1]
        last = row_start + torch.tensor(counts, device=out.device)
        positions = torch.minimum(row_start.unsqueeze(1) + torch.arange(width, device=out.device), last.unsqueeze(1))
        chosen = raw[positions, out].unsqueeze(2)
        ids = out.unsqueeze(2)
        num_top = min(metadata.max_num_logprobs, metadata.vocab_size)
        if num_top > 0:
            top_lp, top_ids = raw.topk(num_top, dim=-1)
            chosen = torch.cat([chosen, top_lp[positions]], dim=2)
            ids = torch.cat([ids, top_ids[positions]], dim=2)
        return chosen, ids


def _greedy_rows(metadata: SamplingMetadata, row_start: Tensor) -> Tensor:
    """[R] bool on the device: which rows are greedy (read at each row's first position, no sync)."""
    if metadata.greedy_mask is not None:
        return metadata.greedy_mask[row_start]
    return torch.full(row_start.shape, metadata.all_greedy, dtype=torch.bool, device=row_start.device)

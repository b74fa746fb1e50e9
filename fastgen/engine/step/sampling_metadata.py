"""One step's `SamplingParams` as per-row device tensors (`SamplingMetadata`), the contract between the
engine, which builds it on the host once per step, and the `Sampler`, which reads only tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fastgen.sampling_params import SamplingParams

MIN_TEMPERATURE = 1e-5
"""Sampled rows' temperatures are clamped to at least this, so `logits / temperature` stays
finite; the distribution at this temperature is already indistinguishable from greedy."""


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for `seed` on `device` (None when unseeded).

    The engine makes it once per request and passes it to every step, so the request's samples
    depend only on its seed and its own logits, never on what it is batched with.
    """
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when `a` and `b` name one device: torch.device("cuda") and a generator's torch.device("cuda:0") do."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    host = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        # Pinned memory makes the copy asynchronous, so building metadata never waits for the GPU.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _padded_ids(rows: list[list[int]], pad: int, device: torch.device) -> Tensor:
    width = max(1, max(len(row) for row in rows))
    ids = _to_device([row + [pad] * (width - len(row)) for row in rows], torch.int64, device)
    # Ids past the logits' vocab (embedding larger than lm_head) go to the dropped pad column.
    return ids.clamp_(max=pad)


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling parameters as per-row device tensors, built on the host by `build`.

    A tensor is None when no row needs it, so the common cases (all greedy, no penalties, no
    top-k) skip their work entirely.
    """

    num_seqs: int
    """Rows in the step (S): one per sequence that samples a token."""

    vocab_size: int
    """Width of the logits (V)."""

    device: torch.device
    """Device of the logits and of every tensor here."""

    all_greedy: bool
    """Every row takes the argmax: temperature, top-k, top-p and noise are skipped."""

    all_random: bool
    """No row is greedy: the greedy argmax is skipped."""

    greedy_mask: Tensor | None
    """[S] bool, True for greedy rows; None when `all_greedy` or `all_random`."""

    temperature: Tensor | None
    """[S] fp32; greedy rows hold 1.0. None when `all_greedy`."""

    any_top_k: bool
    """Some sampled row has 0 < top_k < V."""

    top_k: Tensor | None
    """[S] int64, 0 = off (also for greedy rows and top_k >= V). None unless `any_top_k`."""

    max_top_k: int
    """Largest top_k in use (0 when none), so one `topk` call serves every row."""

    any_top_p: bool
    """Some sampled row has top_p < 1."""

    top_p: Tensor | None
    """[S] fp32, 1.0 = off (also for greedy rows). None unless `any_top_p`."""

    any_penalties: bool
    """Some row (greedy or not) has a repetition, presence or frequency penalty."""

    repetition_penalty: Tensor | None
    """[S] fp32, 1.0 = off. None when no row uses it."""

    presence_penalty: Tensor | None
    """[S] fp32, 0.0 = off. None when no row uses presence or frequency penalties."""

    frequency_penalty: Tensor | None
    """[S] fp32, 0.0 = off. None when no row uses presence or frequency penalties."""

    prompt_token_mask: Tensor | None
    """[S, V] bool, tokens in each row's prompt; filled only for rows with a repetition penalty.
    None when no row uses it."""

    output_token_counts: Tensor | None
    """[S, V] int32, times each token was generated; filled only for rows with a penalty.
    None unless `any_penalties`."""

    seeded_rows: tuple[int, ...]
    """Sampled rows that draw their noise from their own generator."""

    seeded_generators: tuple[torch.Generator, ...]
    """The generators of `seeded_rows`, in the same order."""

    any_unseeded: bool
    """Some sampled row draws from the default generator."""

    max_num_logprobs: int | None
    """Largest `logprobs` asked for by any row (0 = chosen token only); None when no row asked."""

    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None
    """(rows, token ids, biases) added to the logits first; None when no row has a bias."""

    allowed_mask: Tensor | None = None
    """[S, V] bool, True where a token may be generated (all True for rows without a list); None
    when no row restricts its tokens."""

    banned: tuple[Tensor, Tensor] | None = None
    """(rows, token ids) set to -inf: bad words, and EOS/stop ids before `min_new_tokens`."""

    min_p: Tensor | None = None
    """[S] fp32, 0 = off (also for greedy rows). None unless some sampled row uses min_p."""

    grammar_bitmask: Tensor | None = None
    """[S, ceil(V / 32)] int32 on the host, bit t of row r set where a structured-output grammar allows
    token t (`fastgen.engine.grammar`); None when no row is constrained this step."""

    grammar_rows: list[int] | None = None
    """The rows of `grammar_bitmask` that are constrained (the others are all ones)."""

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], generators: list[torch.Generator | None],
              vocab_size: int, device: torch.device | str,
              banned_token_ids: list[list[int]] | None = None, grammar_bitmask: Tensor | None = None,
              grammar_rows: list[int] | None = None) -> SamplingMetadata:
        """Turn one step's per-row parameters and token histories into device tensors.

        `prompt_token_ids[i]`/`output_token_ids[i]` are row i's prompt and generated ids (read only
        for rows with penalties); `generators[i]` is row i's `make_generator(seed)` (None when
        unseeded; ignored for greedy rows); `banned_token_ids[i]` are ids row i must not generate
        this step (bad words' next tokens, EOS before `min_new_tokens`); `grammar_bitmask` and
        `grammar_rows` are the structured-output mask (see the fields). Host work only: the copies
        to the device are asynchronous.
        """
        device = torch.device(device)
        num_seqs = len(params)
        if num_seqs == 0:
            raise ValueError("SamplingMetadata.build needs at least one row, got an empty batch")
        for name, rows in (("prompt_token_ids", prompt_token_ids),
                           ("output_token_ids", output_token_ids), ("generators", generators)):
            if len(rows) != num_seqs:
                raise ValueError(f"{name} has {len(rows)} rows but params has {num_seqs}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        greedy, temperature, top_k, top_p = [], [], [], []
        repetition, presence, frequency = [], [], []
        seeded_rows, seeded_generators = [], []
        any_unseeded = False
        max_num_logprobs = None
        for i, (p, gen) in enumerate(zip(params, generators)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be SamplingParams, got {type(p).__name__}")
            # A seed only matters to sampled rows: greedy rows take the argmax (vLLM and HF agree).
            if p.seed is not None and gen is None and not p.greedy:
                raise ValueError(f"row {i} has seed={p.seed} but no generator: pass "
                                 f"make_generator(seed, device) made once for the request")
            if gen is not None and not same_device(gen.device, device):
                raise ValueError(f"row {i}'s generator is on {gen.device}, logits on {device}")
            greedy.append(p.greedy)
            temperature.append(1.0 if p.greedy else max(p.temperature, MIN_TEMPERATURE))
            top_k.append(0 if p.greedy or p.top_k >= vocab_size else p.top_k)
            top_p.append(1.0 if p.greedy else p.top_p)
            repetition.append(p.repetition_penalty)
            presence.append(p.presence_penalty)
            frequency.append(p.frequency_penalty)
            if not p.greedy:
                if gen is None:
                    any_unseeded = True
                else:
                    seeded_rows.append(i)
                    seeded_generators.append(gen)
            if p.logprobs is not None:
                max_num_logprobs = max(p.logprobs, max_num_logprobs or 0)

        all_greedy, all_random = all(greedy), not any(greedy)
        any_top_k = any(k > 0 for k in top_k)
        any_top_p = any(p < 1.0 for p in top_p)
        any_repetition = any(r != 1.0 for r in repetition)
        any_presence_frequency = any(a != 0.0 or b != 0.0 for a, b in zip(presence, frequency))
        any_penalties = any_repetition or any_presence_frequency

        prompt_token_mask = output_token_counts = None
        if any_penalties:
            penalised = [r != 1.0 or a != 0.0 or b != 0.0
                         for r, a, b in zip(repetition, presence, frequency)]
            # One extra column catches padding and out-of-vocab ids; it is sliced off.
            out_ids = _padded_ids([list(ids) if use else []
                                   for ids, use in zip(output_token_ids, penalised)],
                                  vocab_size, device)
            output_token_counts = torch.zeros(num_seqs, vocab_size + 1, dtype=torch.int32,
                                              device=device)
            ones = torch.ones_like(out_ids, dtype=torch.int32)
            output_token_counts.scatter_add_(1, out_ids, ones)
            output_token_counts = output_token_counts[:, :vocab_size]
            if any_repetition:
                prompt_ids = _padded_ids([list(ids) if r != 1.0 else []
                                          for ids, r in zip(prompt_token_ids, repetition)],
                                         vocab_size, device)
                prompt_token_mask = torch.zeros(num_seqs, vocab_size + 1, dtype=torch.bool,
                                                device=device)
                prompt_token_mask.scatter_(1, prompt_ids, True)
                prompt_token_mask = prompt_token_mask[:, :vocab_size]

        def maybe(flag: bool, data: list, dtype: torch.dtype) -> Tensor | None:
            return _to_device(data, dtype, device) if flag else None

        bias_rows, bias_ids, bias_values = [], [], []
        for i, p in enumerate(params):
            for token_id, value in (p.logit_bias or {}).items():
                if token_id < vocab_size:
                    bias_rows.append(i)
                    bias_ids.append(token_id)
                    bias_values.append(value)
        logit_bias = None
        if bias_rows:
            logit_bias = (_to_device(bias_rows, torch.int64, device), _to_device(bias_ids, torch.int64, device),
                          _to_device(bias_values, torch.float32, device))
        allowed_mask = None
        if any(p.allowed_token_ids is not None for p in params):
            allowed = [list(range(vocab_size)) if p.allowed_token_ids is None else list(p.allowed_token_ids)
                       for p in params]
            allowed_mask = torch.zeros(num_seqs, vocab_size + 1, dtype=torch.bool, device=device)
            allowed_mask.scatter_(1, _padded_ids(allowed, vocab_size, device), True)
            allowed_mask = allowed_mask[:, :vocab_size]
        banned = None
        if banned_token_ids is not None:
            if len(banned_token_ids) != num_seqs:
                raise ValueError(f"banned_token_ids has {len(banned_token_ids)} rows but params has {num_seqs}")
            rows = [i for i, ids in enumerate(banned_token_ids) for t in ids if t < vocab_size]
            cols = [t for ids in banned_token_ids for t in ids if t < vocab_size]
            if rows:
                banned = (_to_device(rows, torch.int64, device), _to_device(cols, torch.int64, device))
        min_p = [0.0 if p.greedy else p.min_p for p in params]

        return cls(
            num_seqs=num_seqs, vocab_size=vocab_size, device=device,
            all_greedy=all_greedy, all_random=all_random,
            greedy_mask=maybe(not (all_greedy or all_random), greedy, torch.bool),
            temperature=maybe(not all_greedy, temperature, torch.float32),
            any_top_k=any_top_k, top_k=maybe(any_top_k, top_k, torch.int64),
            max_top_k=max(top_k),
            any_top_p=any_top_p, top_p=maybe(any_top_p, top_p, torch.float32),
            any_penalties=any_penalties,
            repetition_penalty=maybe(any_repetition, repetition, torch.float32),
            presence_penalty=maybe(any_presence_frequency, presence, torch.float32),
            frequency_penalty=maybe(any_presence_frequency, frequency, torch.float32),
            prompt_token_mask=prompt_token_mask, output_token_counts=output_token_counts,
            seeded_rows=tuple(seeded_rows), seeded_generators=tuple(seeded_generators),
            any_unseeded=any_unseeded, max_num_logprobs=max_num_logprobs,
            logit_bias=logit_bias, allowed_mask=allowed_mask, banned=banned,
            min_p=maybe(any(m > 0.0 for m in min_p), min_p, torch.float32),
            grammar_bitmask=grammar_bitmask if grammar_rows else None, grammar_rows=grammar_rows or None,
        )

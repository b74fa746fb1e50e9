"""One generation stream: its tokens, how many have KV in the cache, and why it finished.

There is no prefill/decode phase: a sequence simply has tokens whose KV is not computed yet
(`num_tokens - num_computed_tokens`), whether they come from the prompt, from a preemption
that threw its KV away, or from the last sampled token.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from fastgen.engine.grammar import SequenceGrammar
from fastgen.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens and bookkeeping of one output stream (one of a request's `n` choices)."""

    __slots__ = (
        "seq_id", "request_id", "index", "arrival", "params", "prompt_token_ids", "output_token_ids", "token_ids",
        "num_computed_tokens", "status", "finish_reason", "generator", "logprobs", "stream", "text",
        "children", "num_cached_prompt_tokens", "num_preemptions", "bad_words_ids", "prompt_logprobs", "grammar",
        "lora_id",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: int,
        index: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.arrival = arrival
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        """Generated tokens; grow them only through `append_token`."""
        self.token_ids: list[int] = list(prompt_token_ids)
        """Prompt plus generated tokens as one list, kept in step by `append_token` so the scheduler's
        and step builder's per-step reads cost no copy of the history. Read-only for everyone else."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.generator = generator
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # The first prompt token has nothing before it to predict it (None, as in vLLM and OpenAI).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.bad_words_ids: tuple[tuple[int, ...], ...] = ()
        self.stream: Any = None
        self.text = ""
        self.children: list[Sequence] = []
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        self.grammar: SequenceGrammar | None = None
        """Its structured-output constraint (None: unconstrained)."""
        self.lora_id = 0
        """The LoRA adapter it runs under (`LoRAManager.lora_id`; 0: the base model)."""

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    def append_token(self, token: int) -> None:
        """Add one generated token."""
        self.output_token_ids.append(token)
        self.token_ids.append(token)

    @property
    def ready(self) -> bool:
        """Whether it may be scheduled: its grammar (if any) has finished compiling."""
        return self.grammar is None or self.grammar.ready

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once a stop condition, the length limit or an abort ended it."""
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")

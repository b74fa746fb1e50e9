"""What one executed step hands back to the scheduler: `StepOutput`, keyed by sequence.

The step is three calls (`Engine.step`): the scheduler decides (`ScheduledBatch`), the executor runs
the model and samples (`StepOutput`), the scheduler applies the result (`Scheduler.update`, which
returns one `SequenceUpdate` per sequence that moved and per request that failed). Nothing in a
`StepOutput` is positional: a row is found by its sequence's `seq_id`, so a feature that returns
more per row (speculative decoding: several accepted tokens) or skips rows changes no index math.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastgen.engine.sequence import Sequence

TokenLogprobs = dict[int, float]
"""{token_id: logprob}: the chosen (or prompt) token and the top-N."""


class RequestFailed(RuntimeError):
    """One request failed inside the engine after it was admitted (a sampler, detokenizer or model
    error that only its rows hit). Only that request ends; it is a server error (gRPC INTERNAL,
    HTTP 500), never the caller's INVALID_ARGUMENT, since admission had accepted the request."""


@dataclass(slots=True)
class StepOutput:
    """The result of executing one `ScheduledBatch`, per sequence (`seq_id`) and per failed request."""

    sampled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """Per sampling row (`ScheduledChunk.samples`), the tokens it produced this step, in order: one
    today, several when a feature accepts several per step. `Scheduler.update` appends them one by
    one and stops at the first that finishes the sequence (the rest are dropped)."""
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    """Per sampling row whose request asked for `logprobs`, one entry per token of `sampled_token_ids`."""
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    """Per chunk that scores prompt tokens (`prompt_logit_positions`), one entry per such position, in order."""
    failed: dict[str, RequestFailed] = field(default_factory=dict)
    """Requests that failed while this step ran (request id -> error): every sequence of theirs ends."""

    def fail(self, request_id: str, what: str, exc: BaseException) -> RequestFailed:
        """Record that `request_id` failed while doing `what` (the first failure of a request wins)."""
        if request_id not in self.failed:
            failure = RequestFailed(
                f"request {request_id} failed in the engine while {what}: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            self.failed[request_id] = failure
        return self.failed[request_id]


@dataclass(slots=True)
class SequenceUpdate:
    """What one step did to one sequence, as `Scheduler.update` reports it (the engine makes it a
    `Response` delta). For a failed request, one update carries the `error` and no tokens."""

    seq: Sequence
    """The sequence (choice); `seq.is_finished` and `seq.finish_reason` say whether it ended."""
    token_ids: list[int] = field(default_factory=list)
    """Tokens appended this step."""
    text: str = ""
    """Text those tokens completed (held-back text is released when the sequence finishes)."""
    logprobs: list[TokenLogprobs] | None = None
    """Per appended token, its logprobs (None when the request did not ask)."""
    error: RequestFailed | None = None
    """Set when the request failed: its final update, after which it delivers nothing more."""

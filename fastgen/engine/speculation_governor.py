"""Whether a step of B decoding rows should verify drafts, from the tok/s each choice measured at B.

The plan sizes `disable_by_batch_size` from a cost model before any step runs (weights streamed once,
matmuls at the machine's rate, an assumed acceptance). What it cannot know is what verification
really costs here (a row of k + 1 queries may take a slower attention path than a one-row decode)
and what this traffic's drafts really earn. So below the plan's cap the governor keeps, per decode
batch size, a moving average of the tok/s of steps that verified drafts and of steps that did not,
and lets a step speculate only while speculating measured at least as fast. The losing choice is
tried again every `RETRY_EVERY` steps at that size, since both rates drift (acceptance changes with
the text, contexts grow). Only steps of decode rows alone are measured: a prompt chunk's cost would
be charged to whichever choice its step happened to make.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RETRY_EVERY = 32
"""Steps at one batch size between tries of the choice that measured slower."""

SMOOTHING = 0.2
"""Weight of the newest step in each moving average."""


@dataclass(slots=True)
class _Rates:
    """The measured tok/s of both choices at one decode batch size."""

    speculating: float | None = None
    """Steps that verified drafts (None: not measured yet)."""
    plain: float | None = None
    """Steps that did not."""
    since_retry: int = 0
    """Steps decided since the slower choice was last tried."""


@dataclass(slots=True)
class SpeculationGovernor:
    """Per decode batch size, speculation on or off by what each measured (see the module)."""

    cap: int | None
    """The plan's `disable_by_batch_size`: above it no step speculates (None: no cap)."""
    _rates: dict[int, _Rates] = field(default_factory=dict)

    def allows(self, num_rows: int) -> bool:
        """Whether a step of `num_rows` decoding rows may verify drafts."""
        if self.cap is not None and num_rows > self.cap:
            return False
        rates = self._rates.setdefault(num_rows, _Rates())
        if rates.speculating is None or rates.plain is None:
            # Measure what is missing: drafts first (the plan expects them to pay), then a plain step.
            return rates.speculating is None
        faster = rates.speculating >= rates.plain
        rates.since_retry += 1
        if rates.since_retry >= RETRY_EVERY:
            rates.since_retry = 0
            return not faster
        return faster

    def record(self, num_rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One step of `num_rows` decoding rows (and nothing else) made `tokens` in `seconds`;
        `speculated`: it verified drafts."""
        if seconds <= 0 or (self.cap is not None and num_rows > self.cap):
            return
        rates = self._rates.setdefault(num_rows, _Rates())
        rate = tokens / seconds
        name = "speculating" if speculated else "plain"
        old = getattr(rates, name)
        setattr(rates, name, rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate)

    def rates(self, num_rows: int) -> tuple[float | None, float | None]:
        """The (speculating, plain) tok/s measured at `num_rows` decoding rows."""
        rates = self._rates.get(num_rows, _Rates())
        return rates.speculating, rates.plain

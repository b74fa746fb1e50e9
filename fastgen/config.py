"""Engine configuration: the keywords of `fastgen.pipeline(...)`.

The plan fields are not written here: `EngineConfig` gets one field per `Plan` field, declared once
in `fastgen/planning/plan.py`, defaulting to None ("let the policy choose": the policy validates
them and says why it chose each value); a value given here always wins over the policy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fastgen.planning.plan import PLAN_FIELDS, PLAN_SPECS, argument_type

__all__ = ["EngineConfig", "argument_type"]
"""`argument_type` is re-exported for `scripts/serve.py`'s parser, which parses plan fields as
`python -m fastgen.planning` does."""


@dataclass(slots=True)
class _EngineOptions:
    """The engine options that are not plan fields (see `EngineConfig`)."""

    model: str | None = None
    """Checkpoint directory or cached hub id; None = the bundled demo model."""
    device: str | None = None
    """"cpu" or "cuda[:i]"; None = CUDA when available, else CPU."""
    max_length: int | None = None
    """Longest prompt + output a request may have (MII's `max_length`); None = the model's context."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides the plan's `kv_cache_memory`."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks shared with earlier prompts."""
    seed: int | None = None
    """Seed of the default generator used by unseeded sampled requests."""
    progress: bool = True
    """Show progress bars while loading weights and compiling buckets."""
    offline: bool = False
    """What the plan sizes steps for: False (`serve`) the streams' inter-token latency, True (`pipeline`'s
    default) a batch's total throughput (on a CPU, larger steps; see `fastgen.planning.policy.make_plan`)."""

    def __post_init__(self) -> None:
        for name in ("max_length", "num_kv_blocks", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < (0 if name == "seed" else 1)):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'seed' else 'positive'} int or None, "
                                 f"got {value!r}")
        for name in ("enable_prefix_caching", "progress", "offline"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.device is not None:
            torch.device(self.device)  # raises on a malformed device string
        if self.tensor_parallel is not None and (isinstance(self.tensor_parallel, bool)
                                                 or not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1):
            raise ValueError(f"tensor_parallel must be a positive int or None, got {self.tensor_parallel!r}")
        if self.replica_num not in (None, 1):
            raise ValueError("replica_num > 1 runs several engine processes: use fastgen.serve(..., replica_num=N)")

    def plan_overrides(self) -> dict[str, Any]:
        """The plan fields the user set (None = the policy chooses)."""
        return {name: getattr(self, name) for name in PLAN_FIELDS}

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> "EngineConfig":
        """Build from `pipeline` keywords; an unknown keyword is a TypeError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(map(repr, unknown))} "
                            f"(supported: {', '.join(sorted(known - {'model'}))})")
        return cls(model=model, **kwargs)


if TYPE_CHECKING:
    from fastgen.planning.speculative import SpeculativeConfig

    @dataclass(slots=True)
    class EngineConfig(_EngineOptions):
        """What type checkers and IDEs see: the class built below, one field per plan field with the
        annotation its declaration gives (`tests/test_engine_config.py` checks this list against it)."""

        dtype: torch.dtype | str | None = None
        quantization: str | None = None
        quantization_group_size: int | None = None
        attention_backend: str | None = None
        compile: str | None = None
        cuda_graphs: bool | None = None
        buckets: tuple[int, ...] | None = None
        token_budget: int | None = None
        context_per_budget_token: int | None = None
        max_seqs: int | None = None
        block_size: int | None = None
        state_slots: int | None = None
        kv_prefault: bool | None = None
        kv_cache_memory: int | float | None = None
        offload: str | None = None
        weight_memory: int | float | None = None
        weight_prepack: bool | None = None
        gemv_weights: bool | None = None
        lm_head_quantization: str | None = None
        decode_layer_kernel: bool | None = None
        adaptive_threads: bool | None = None
        tensor_parallel: int | None = None
        replica_num: int | None = None
        speculative_config: SpeculativeConfig | dict | str | None = None
        structured_outputs_backend: str | None = None
        enable_lora: bool | None = None
        max_loras: int | None = None
        max_lora_rank: int | None = None
        max_cpu_loras: int | None = None
else:
    EngineConfig = dataclasses.make_dataclass(
        "EngineConfig",
        [(name, spec.metadata["option"], dataclasses.field(default=None, metadata=spec.metadata))
         for name, spec in PLAN_SPECS.items()],
        bases=(_EngineOptions,), slots=True,
        namespace={"__doc__": "How one engine instance is built. Every field is a keyword of `fastgen.pipeline`: "
                              "the options above, then one per plan field (None = the policy chooses; see "
                              "`fastgen.planning.plan.Plan` for their meaning)."},
    )
    EngineConfig.__module__ = __name__  # so it pickles (replicas, TP specs) and reprs as fastgen.config's

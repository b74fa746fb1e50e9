"""The sparse mixture-of-experts layer shared by mixtral, qwen2_moe, qwen3_moe and glm4_moe.

A router (one linear) scores the experts per token; softmax in fp32, top-k, and optionally the
top-k weights renormalised to sum to one (Mixtral always, the Qwen MoEs when `norm_topk_prob`);
or (GLM-4.5) sigmoid scores, a correction bias steering the choice, group-limited top-k and a
scaling factor (`route_grouped`). Each token's output is the weighted sum of its k experts'
gated MLPs, plus an always-on shared expert where the family has one.

Expert weights are stacked, exactly as transformers 5 holds them in memory:
`experts.gate_up_proj [E, 2*I, H]` (gate rows then up rows) and `experts.down_proj [E, H, I]`.
A checkpoint in transformers 5's fused layout therefore loads name for name, and the loader
stacks per-expert checkpoint tensors (`experts.{i}.gate_proj.weight`, ...) into these through a
model's `stacked_experts_mapping`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import GatedMLP, get_activation
from fastgen.models.parallel import SINGLE, TensorParallel, all_reduce, read_slice, read_whole, shape_of

# Reading one selected expert's weights through a gather costs about three passes over them (read,
# write the copy, read the copy) against one pass over every expert for the dense path.
_GATHER_COST = 3


@dataclass(slots=True, frozen=True)
class MoeConfig:
    """The settings of one sparse MoE layer, read by each family from its HF config."""

    num_experts: int
    """Routed experts per layer (E)."""
    top_k: int
    """Experts each token is sent to (k)."""
    intermediate_size: int
    """Hidden width of each routed expert's gated MLP (I)."""
    renormalize: bool
    """Rescale the top-k routing weights to sum to one (Mixtral; Qwen's `norm_topk_prob`)."""
    hidden_act: str = "silu"
    """Activation of the experts' gated MLPs."""
    shared_expert_intermediate_size: int = 0
    """Width of an always-on shared expert (all shared experts together); 0 = none."""
    shared_expert_gate: bool = True
    """The shared expert's output is scaled by a sigmoid gate (Qwen2-MoE); False: added as it is (GLM-4.5)."""
    scoring: str = "softmax"
    """Router scores: "softmax" over the experts, or "sigmoid" per expert (GLM-4.5, DeepSeek-V3)."""
    score_correction_bias: bool = False
    """The router holds `e_score_correction_bias`, added to the scores for the choice only (not the weights)."""
    num_groups: int = 1
    """Expert groups; a token picks its experts within its `topk_groups` best groups (each scored by its top two)."""
    topk_groups: int = 1
    """Groups a token may route into."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routing weights (after renormalisation)."""

    def __post_init__(self) -> None:
        """Refuse settings no MoE layer can run with, naming the field."""
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoE {name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoE top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"MoE shared_expert_intermediate_size must be >= 0, got {self.shared_expert_intermediate_size}"
            )
        get_activation(self.hidden_act)
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.num_groups < 1 or self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"MoE groups: {self.num_experts} experts in {self.num_groups} groups, top {self.topk_groups} "
                             "groups: the groups must divide the experts and topk_groups lie in [1, groups]")
        if self.num_groups > 1 and self.scoring != "sigmoid":
            raise ValueError("MoE expert groups are implemented for sigmoid scoring only (n_group > 1 with softmax)")

    @classmethod
    def from_model_config(cls, config: ModelConfig, keys: dict[str, tuple[str, ...]], **fixed) -> "MoeConfig":
        """Read the fields named in `keys` from `config.raw`, each from the first of its HF keys present
        (`{"num_experts": ("num_experts", "num_local_experts")}`); `fixed` gives the other fields."""
        values = dict(fixed)
        for field_name, names in keys.items():
            present = [n for n in names if config.raw.get(n) is not None]
            if not present:
                raise ValueError(f"{config.model_type} config.json lacks {' or '.join(map(repr, names))}")
            values[field_name] = config.raw[present[0]]
        return cls(**values)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 routing weights `[T, k]` and expert ids `[T, k]` from router logits `[T, E]`.

    The same operations in the same order as transformers, so ties and near-ties pick the same
    experts.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, moe: MoeConfig
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 routing weights and expert ids `[T, k]` of a sigmoid router with group-limited top-k
    (GLM-4.5's and DeepSeek-V3's `noaux_tc`), in transformers' order of operations: the
    correction bias steers the choice, the weights are the plain sigmoid scores."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.num_groups > 1:
        grouped = choice.view(num_tokens, moe.num_groups, num_experts // moe.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_ids = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class Router(nn.Linear):
    """The router's linear (`gate.weight` `[E, H]`), with `e_score_correction_bias` when the MoE has one."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__(hidden_size, moe.num_experts, bias=False)
        if moe.score_correction_bias:
            # A persistent buffer, as in transformers (a statistic, not a trained weight: not counted as a
            # parameter), loaded from the checkpoint and kept in fp32 as transformers keeps it.
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts, dtype=torch.float32))


class StackedExperts(nn.Module):
    """E gated MLPs held as two stacked weights and run without a Python loop over tokens.

    On a CPU outside torch.compile, each picked expert runs over its tokens (`_per_expert`). Compiled
    and GPU steps take one of two static-shape formulations, picked by the token count (static per
    compiled bucket, so the choice is not data-dependent and the step stays one graph, capturable as a
    CUDA graph):

    - dense: every expert runs on every token as one GEMM (`x @ gate_up_proj` viewed as
      `[E*2I, H]`) and one batched GEMM for `down_proj`, the routing weights zero for experts
      a token did not pick. It reads each expert once and costs E/k times the sparse FLOPs.
    - gathered: each (token, expert) pair gathers its expert's weights and runs a batched
      matrix-vector product. It reads only the picked experts, which wins for a few tokens
      (batch-1 decode of a many-expert model) and loses once many tokens hit most experts.

    A loop over experts with `nonzero`/`index_add` would do the sparse FLOPs but has
    data-dependent shapes: a host sync per layer, a graph break, and no CUDA-graph capture.
    Doing the sparse FLOPs with static shapes needs a grouped-GEMM kernel (a job for `ops/`).

    Under tensor parallelism every rank holds every expert's slice of the intermediate columns
    (vLLM's default, rather than whole experts per rank): the load stays even whatever the router
    picks, and the output is a partial sum the MoE block all-reduces once.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str,
                 tp: TensorParallel = SINGLE, bias: bool = False,
                 glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        """`bias`: per-expert biases on both projections (gpt-oss). `glu(gate, up)`: the gated activation,
        by default `act(gate) * up` with `hidden_act`'s activation."""
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.full_intermediate_size = intermediate_size
        intermediate_size = tp.split(intermediate_size, "the experts' intermediate size")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.has_bias = bias
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        act = get_activation(hidden_act)
        self.glu = glu if glu is not None else (lambda gate, up: act(gate) * up)
        # Checkpoints keep gate and up apart: the loader fills these rows of each expert separately.
        self.output_sizes = {"gate_up_proj": [intermediate_size, intermediate_size]}

    def load_checkpoint_shard(self, attr: str, shard: int | None, full) -> torch.Tensor:
        """This rank's intermediate columns of one expert's tensor (2-D) or of the fused stack (3-D)."""
        size, start = self.intermediate_size, self.tp.rank * self.intermediate_size
        if attr == "down_proj_bias":  # [E, H]: whole on every rank (rank 0 adds it)
            return read_whole(full)
        if attr == "gate_up_proj_bias":  # [E, 2I]: this rank's gate columns, then its up columns
            return torch.cat([read_slice(full, 1, start, size),
                              read_slice(full, 1, self.full_intermediate_size + start, size)], dim=1)
        fused = len(shape_of(full)) == 3
        if attr == "down_proj":
            return read_slice(full, 2 if fused else 1, start, size)
        if not fused:
            return read_slice(full, 0, start, size)
        # Fused gate|up rows: this rank's gate rows, then its up rows.
        return torch.cat([read_slice(full, 1, start, size),
                          read_slice(full, 1, self.full_intermediate_size + start, size)], dim=1)

    def _adds_down_bias(self) -> bool:
        """The down projection's bias is added once: by rank 0, before the all-reduce sums the ranks."""
        return self.has_bias and self.tp.rank == 0

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's selected experts: `hidden [T, H]`, weights/ids `[T, k]` -> `[T, H]`."""
        num_tokens, top_k = topk_ids.shape
        if hidden.device.type == "cpu" and not torch.compiler.is_compiling():
            return self._per_expert(hidden, topk_weights, topk_ids)
        if _GATHER_COST * num_tokens * top_k <= self.num_experts:
            return self._gathered(hidden, topk_weights, topk_ids)
        return self._dense(hidden, topk_weights, topk_ids)

    def _dense(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token; unpicked experts weigh zero."""
        num_tokens = hidden.shape[0]
        combine = torch.zeros(num_tokens, self.num_experts, dtype=hidden.dtype, device=hidden.device)
        combine.scatter_(1, topk_ids, topk_weights.to(hidden.dtype))
        gate_up = F.linear(hidden, self.gate_up_proj.flatten(0, 1))  # [T, E*2I]
        gate_up = gate_up.view(num_tokens, self.num_experts, 2 * self.intermediate_size)
        if self.has_bias:
            gate_up = gate_up + self.gate_up_proj_bias
        gate, up = gate_up.transpose(0, 1).split(self.intermediate_size, dim=-1)
        # Weighting before down_proj (it is linear) leaves only a sum over experts afterwards.
        act = self.glu(gate, up) * combine.t().unsqueeze(-1)  # [E, T, I]
        out = torch.bmm(act, self.down_proj.transpose(1, 2)).sum(dim=0)
        if self._adds_down_bias():
            out = out + combine @ self.down_proj_bias  # each picked expert's bias, by its weight
        return out

    def _per_expert(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each picked expert once, over the tokens that picked it, its weights read where they lie.

        The sparse FLOPs and each picked expert's weights read once, at the price of data-dependent
        shapes: right for eager CPU steps, where reading the routing on the host costs no device sync
        (a batch-1 decode step of the gathered form copied its experts' weights before multiplying)."""
        out = torch.zeros_like(hidden)
        weights = topk_weights.to(hidden.dtype)
        for expert in sorted(set(topk_ids.flatten().tolist())):
            tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
            gate_up = F.linear(hidden[tokens], self.gate_up_proj[expert],
                               self.gate_up_proj_bias[expert] if self.has_bias else None)
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            down = F.linear(self.glu(gate, up), self.down_proj[expert],
                            self.down_proj_bias[expert] if self._adds_down_bias() else None)
            out.index_add_(0, tokens, down * weights[tokens, slots].unsqueeze(-1))
        return out

    def _gathered(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """One batched matrix-vector product per (token, expert) pair over gathered weights."""
        num_tokens, top_k = topk_ids.shape
        ids = topk_ids.flatten()
        pairs = hidden.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        gate_up = torch.bmm(self.gate_up_proj[ids], pairs).squeeze(-1)  # [T*k, 2I]
        if self.has_bias:
            gate_up = gate_up + self.gate_up_proj_bias[ids]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        out = torch.bmm(self.down_proj[ids], self.glu(gate, up).unsqueeze(-1)).squeeze(-1)  # [T*k, H]
        if self._adds_down_bias():
            out = out + self.down_proj_bias[ids]
        out = out.view(num_tokens, top_k, -1)
        return (out * topk_weights.to(hidden.dtype).unsqueeze(-1)).sum(dim=1)


class SparseMoeBlock(nn.Module):
    """Router + stacked experts (+ an optional gated shared expert), in place of a dense MLP.

    Parameter names follow transformers: `gate.weight` (the router; `gate.e_score_correction_bias`
    for sigmoid routers), `experts.gate_up_proj`, `experts.down_proj`, and for Qwen2-MoE
    `shared_expert.*` and `shared_expert_gate.weight` (GLM-4.5's `shared_experts` is renamed to it).
    """

    unquantized_children = ("gate", "shared_expert_gate")
    """Kept in the plan dtype under `quantization`: the router's top-k choice (and the shared expert's
    gate) decide which weights a token meets at all, and they are a sliver of the layer's bytes."""

    def __init__(self, hidden_size: int, moe: MoeConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.moe = moe
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.gate = Router(hidden_size, moe)
        self.experts = StackedExperts(moe.num_experts, hidden_size, moe.intermediate_size, moe.hidden_act, tp)
        self.has_shared_expert = moe.shared_expert_intermediate_size > 0
        self.gated_shared_expert = self.has_shared_expert and moe.shared_expert_gate
        if self.has_shared_expert:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size, moe.hidden_act,
                                          tp=tp, reduce=False)
        if self.gated_shared_expert:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the layer to `hidden` `[T, H]`."""
        if self.moe.scoring == "sigmoid":
            # transformers runs this router in fp32 whatever the model dtype.
            logits = F.linear(hidden.float(), self.gate.weight.float())
            topk_weights, topk_ids = route_grouped(logits, getattr(self.gate, "e_score_correction_bias", None), self.moe)
        else:
            topk_weights, topk_ids = route(self.gate(hidden), self.top_k, self.renormalize)
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.gated_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        elif self.has_shared_expert:
            out = out + self.shared_expert(hidden)
        # One all-reduce sums the ranks' partial routed and shared outputs together.
        return all_reduce(out, self.tp)

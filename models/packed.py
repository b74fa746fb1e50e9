"""Decoder linears with their weights prepacked for the CPU's oneDNN kernels (`fastgen.ops.packed_linear`).

Applied after loading, on the loaded model: each linear the quantizer would take (those inside the
decoder layers, less the LM head and `unquantized_children`) is replaced by a `PackedLinear` holding
the same weight in oneDNN's blocked layout, and the plain weight is dropped, so memory stays the same.
The LM head is packed too (`PackedLMHead`): it multiplies every sampled row by the whole vocabulary.
A tied head keeps the embedding's plain weight beside the packed copy (the lookup needs it), so
tying costs one more vocabulary x hidden matrix; an untied head drops its plain weight.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.parallel import SINGLE, ParallelLMHead, RowParallelLinear, all_reduce
from fastgen.models.quant import quantizable_linears
from fastgen.ops.packed_linear import pack_linear_weight, packed_linear


class PackedLinear(nn.Module):
    """A loaded linear (plain, merged column-parallel or row-parallel) over a prepacked weight.

    Keeps the layer's bias and tensor-parallel behaviour: a row-parallel layer of several ranks sums
    the partial products first and adds its bias after, as `RowParallelLinear` does.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tp = getattr(linear, "tp", SINGLE)
        self.reduce = isinstance(linear, RowParallelLinear) and self.tp.size > 1 and linear.reduce
        # A buffer, not an attribute: regional compilation then passes it as a graph input, so the
        # layers keep sharing one graph.
        self.register_buffer("packed_weight", pack_linear_weight(linear.weight), persistent=False)
        self.bias = linear.bias
        if hasattr(linear, "output_sizes"):
            self.output_sizes = linear.output_sizes

    def extra_repr(self) -> str:
        """Sizes shown by `print(model)`."""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T (+ bias)` over the last dimension of `x` (this rank's input columns if row-parallel)."""
        if not self.reduce:
            return packed_linear(x, self.packed_weight, self.bias, self.out_features)
        out = all_reduce(packed_linear(x, self.packed_weight, None, self.out_features), self.tp)
        return out if self.bias is None else out + self.bias


class PackedLMHead(nn.Module):
    """A loaded `ParallelLMHead` over a prepacked weight; `logits` as the head's (fp32, rank 0 only)."""

    def __init__(self, head: ParallelLMHead, tied: bool) -> None:
        super().__init__()
        self.tp = head.tp
        self.vocab_size = head.vocab_size
        self.out_features = head.out_features
        self.register_buffer("packed_weight", pack_linear_weight(head.weight), persistent=False)
        # Tied: the embedding owns the plain weight; keep the reference so `tie_weights` still finds it.
        self.weight = head.weight if tied else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary rows of the logits, in the hidden dtype (what `nn.Linear` returns)."""
        return packed_linear(hidden, self.packed_weight, None, self.out_features)

    # The head's own gather-to-rank-0 and fp32 cast, over this module's `forward`.
    logits = ParallelLMHead.logits


@torch.no_grad()
def prepack_linears(model: nn.Module) -> list[str]:
    """Replace the decoder layers' plain linears and the LM head of a loaded CPU model by packed ones,
    in place; returns their names. Quantized linears and other linears outside the layers are left
    as they are."""
    targets: dict[str, nn.Module] = dict(quantizable_linears(model))
    heads = {name: m for name, m in model.named_modules() if isinstance(m, ParallelLMHead)}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, module in {**targets, **heads}.items():
        parent_name, _, child = name.rpartition(".")
        packed = PackedLMHead(module, tied) if name in heads else PackedLinear(module)
        setattr(model.get_submodule(parent_name), child, packed)
    return [*targets, *heads]

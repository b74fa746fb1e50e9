"""Decoder linears with their weights prepacked for the CPU's oneDNN kernels (`fastgen.ops.packed_linear`).

Applied after loading, on the loaded model: each linear the quantizer would take (those inside the
decoder layers, less the LM head and `unquantized_children`) is replaced by a `PackedLinear` holding
the same weight in oneDNN's blocked layout, and the plain weight is dropped, so memory stays the same.
The LM head is packed too (`PackedLMHead`): it multiplies every sampled row by the whole vocabulary.
A tied head keeps the embedding's plain weight beside the packed copy (the lookup needs it), so
tying costs one more vocabulary x hidden matrix; an untied head drops its plain weight.

Inputs of a few rows (batch-1 decode) multiply faster over another form of the weight than through the
packed kernel (`fastgen.ops.gemv.gemv_weight`): bf16 weights in the tiles of fastgen's C++ kernel where it
builds, else the plain weight split over the cores (fp32). `apply_packed_linear` does so when given that form,
which the linears keep only when asked (`gemv=True`, the plan's `gemv_weights`): a second copy of their
weights, but for a tied head's plain weight, which the embedding keeps anyway (its bf16 tiles are a copy).
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.parallel import SINGLE, ParallelLMHead, copy_parallel_layout, finish_row_parallel
from fastgen.models.quant import quantizable_linears
from fastgen.ops.gemv import gemv_weight
from fastgen.ops.packed_linear import apply_packed_linear, pack_linear_weight


def _grouped(weight: torch.Tensor | None, threads: int) -> torch.Tensor | None:
    """`weight` in the form `gemv_linear` multiplies over `threads` cores (None stays None)."""
    return None if weight is None else gemv_weight(weight.detach(), threads)


class PackedLinear(nn.Module):
    """A loaded linear (plain, merged column-parallel or row-parallel) over a prepacked weight.

    Keeps the layer's bias and tensor-parallel behaviour: a row-parallel layer of several ranks sums
    the partial products first and adds its bias after, as `RowParallelLinear` does. With `gemv`
    it also keeps the plain weight, which inputs of a few rows multiply over (`gemv_linear`, its
    output rows split over `threads` cores).
    """

    def __init__(self, linear: nn.Linear, gemv: bool = False, threads: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tp = getattr(linear, "tp", SINGLE)
        self.reduce = getattr(linear, "reduce", True)
        """Under tensor parallelism, whether a row-parallel layer sums its ranks' products itself."""
        # A buffer, not an attribute: regional compilation then passes it as a graph input, so the
        # layers keep sharing one graph.
        self.register_buffer("packed_weight", pack_linear_weight(linear.weight), persistent=False)
        self.register_buffer("gemv_weight", _grouped(linear.weight if gemv else None, threads), persistent=False)
        self.bias = linear.bias
        copy_parallel_layout(linear, self)

    def extra_repr(self) -> str:
        """Sizes shown by `print(model)`."""
        gemv = ", gemv" if self.gemv_weight is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed{gemv}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T (+ bias)` over the last dimension of `x` (this rank's input columns if row-parallel)."""
        if not (self.row_parallel and self.tp.size > 1):
            return apply_packed_linear(x, self.packed_weight, self.bias, self.out_features, self.gemv_weight)
        out = apply_packed_linear(x, self.packed_weight, None, self.out_features, self.gemv_weight)
        return finish_row_parallel(out, self.bias, self.tp, self.reduce)


class PackedLMHead(nn.Module):
    """A loaded `ParallelLMHead` over a prepacked weight; `logits` as the head's (fp32, rank 0 only).

    With `gemv`, a few sampled rows multiply over `gemv_weight`'s form of the weight instead (`gemv_linear`):
    bf16 tiles (a copy), or the plain weight over `threads` cores: a tied head's, which the embedding keeps
    anyway, or an untied head's, then kept too.
    """

    def __init__(self, head: ParallelLMHead, tied: bool, gemv: bool = False, threads: int = 1) -> None:
        super().__init__()
        self.tp = head.tp
        self.vocab_size = head.vocab_size
        self.out_features = head.out_features
        self.register_buffer("packed_weight", pack_linear_weight(head.weight), persistent=False)
        # Tied: the embedding owns the plain weight; keep the reference so `tie_weights` still finds it.
        self.weight = head.weight if tied else None
        self.register_buffer("gemv_weight", _grouped(head.weight if gemv else None, threads),
                             persistent=False)
        self.bias = head.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary rows of the logits, in the hidden dtype (what `nn.Linear` returns)."""
        return apply_packed_linear(hidden, self.packed_weight, self.bias, self.out_features, self.gemv_weight)

    # The head's own gather-to-rank-0 and fp32 cast, over this module's `forward`.
    logits = ParallelLMHead.logits


@torch.no_grad()
def prepack_linears(model: nn.Module, gemv: bool = False, threads: int | None = None) -> list[str]:
    """Replace the decoder layers' plain linears and the LM head of a loaded CPU model by packed ones,
    in place; returns their names. Quantized linears and other linears outside the layers are left
    as they are. `gemv`: keep the plain weights too, for inputs of a few rows, split over `threads`
    cores (default: torch's intra-op threads now)."""
    threads = torch.get_num_threads() if threads is None else threads
    targets: dict[str, nn.Module] = dict(quantizable_linears(model))
    heads = {name: m for name, m in model.named_modules() if isinstance(m, ParallelLMHead)}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, module in {**targets, **heads}.items():
        parent_name, _, child = name.rpartition(".")
        packed = PackedLMHead(module, tied, gemv, threads) if name in heads else PackedLinear(module, gemv, threads)
        setattr(model.get_submodule(parent_name), child, packed)
    return [*targets, *heads]

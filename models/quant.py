"""Weight-only quantization of the decoder's linear layers, run by fastgen's C++ CPU kernels where they
build, else by PyTorch's own packed ATen kernels.

- int8 on a CPU with the kernels: GGUF's Q8_0, one fp16 scale per 32 inputs (`w ~ q * scale`, q in
  [-127, 127]), multiplied by `q8_matmul.cpp` (x quantized to Q8_0 too, integer dot products, as llama.cpp
  does). Elsewhere: symmetric, one scale per output channel, `aten._weight_int8pack_mm(x, q, scales)`.
- int4: asymmetric, one scale and zero per `group_size` input features of each output channel
  (`w ~ (q - 8) * scale + zero`, q in [0, 15]); on a CPU with the kernels and groups of whole 64-input
  chunks `q4_matmul.cpp` (x quantized to int8 per group, integer dot products), else
  `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu`; on CUDA
  `aten._convert_weight_to_int4pack` + `aten._weight_int4pack_mm` (unverified on a GPU: no GPU ran
  these tests).

Activations stay in the plan dtype (bf16, fp16 or fp32) between layers; the kernels dequantize on the fly
or quantize x, so a decode step streams ~1 (int8) or ~0.5 (int4) bytes per weight instead of 2. The loader quantizes
each checkpoint tensor as it places it (`QuantizedLinear.load_rows`): the full-precision model never
exists, only one tensor of it at a time. Quantized are the linears inside the decoder layers (q/k/v/o,
gate/up/down, fc1/fc2, shared experts); embeddings, the LM head, MoE routers and the stacked routed
experts keep the plan dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.ops.cpu_kernels.q4 import pack_q4, q4_blocker, q4_matmul_op
from fastgen.ops.cpu_kernels.q8 import BLOCK as Q8_BLOCK, pack_q8_0, q8_matmul_op, quantize_q8_0
from fastgen.models.parallel import SINGLE, ParallelLMHead, copy_parallel_layout, finish_row_parallel

QUANTIZATIONS = ("none", "int8", "int4")
"""`quantization` settings: full precision, int8 per output channel, int4 group-wise."""

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes the int4 kernels accept (CPU: exactly these; CUDA: multiples of 32 up to 256)."""

DEFAULT_GROUP_SIZE = 128
"""Input features per int4 scale/zero pair: torchao's and GPTQ's usual choice."""

INT4_ROW_MULTIPLE = 16
"""The CPU int4 packing takes output channels in multiples of 16 (the CUDA tiles need 8)."""


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values `[N, K]` and `dtype` scales `[N]` of `weight` `[N, K]`, symmetric per output channel.

    The scale is rounded to `dtype` before the values are computed, so the values are the nearest
    ones for the scale the kernel will actually multiply by.
    """
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(dtype).tiny).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group_size: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 values in [0, 15] `[N, K]`, `dtype` scales and zeros `[N, K / group_size]` of `weight`.

    Asymmetric per group (min to max over 16 levels): `w ~ (q - 8) * scale + zero`. Scale and zero
    are rounded to `dtype` first, as for int8.
    """
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(dtype).tiny).to(dtype)
    zeros = (low + 8 * scales.float()).to(dtype)
    q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp(0, 15)
    return q.view(n, k).to(torch.uint8), scales, zeros


def check_int4_shape(name: str, out_features: int, in_features: int, group_size: int) -> None:
    """Raise ValueError naming the layer when the int4 kernels cannot take its shape."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"int4: {name} has {in_features} input features, not a multiple of quantization_group_size "
                         f"{group_size} (pick a group size that divides it)")
    if out_features % INT4_ROW_MULTIPLE:
        raise ValueError(f"int4: {name} has {out_features} output features; the packed kernel needs a multiple of "
                         f"{INT4_ROW_MULTIPLE}")


class QuantizedLinear(nn.Module):
    """A linear layer (plain, merged column-parallel or row-parallel) holding its weight quantized.

    Built on the meta device from the layer it replaces: it keeps that layer's `weight` (meta, so the
    loader sees the same parameter name, shape and shard layout), its bias (loaded in the plan dtype)
    and its tensor-parallel behaviour (`load_checkpoint_shard`, `output_sizes`, the row-parallel
    all-reduce). The loader hands it checkpoint rows (`load_rows`); once every row is in, the weight is
    packed for the kernel and the meta placeholder dropped.
    """

    def __init__(self, linear: nn.Linear, mode: str, dtype: torch.dtype, group_size: int = DEFAULT_GROUP_SIZE,
                 name: str = "linear") -> None:
        super().__init__()
        if mode not in ("int8", "int4"):
            raise ValueError(f"QuantizedLinear mode must be 'int8' or 'int4', got {mode!r}")
        self.mode = mode
        self.group_size = group_size
        self.dtype = dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if mode == "int4":
            check_int4_shape(name, self.out_features, self.in_features, group_size)
        self.weight = linear.weight
        self.bias = linear.bias
        self.tp = getattr(linear, "tp", SINGLE)
        # A row-parallel layer sums the ranks' partial products before its bias (as RowParallelLinear does).
        self.reduce = getattr(linear, "reduce", True)
        """Under tensor parallelism, whether a row-parallel layer sums its ranks' products itself."""
        copy_parallel_layout(linear, self)
        if hasattr(linear, "load_checkpoint_shard"):
            self.load_checkpoint_shard = linear.load_checkpoint_shard
        self.kernel = ""
        """Which packed kernel `forward` calls: "int8_q8_0" (fastgen's C++ CPU kernel, `q8_matmul.cpp`), "int8"
        (torch's, where that one cannot run), "int4_q4" (fastgen's C++ CPU kernel, `q4_matmul.cpp`),
        "int4_cpu" (torch's, where that one cannot run) or "int4_cuda" ("" until packed)."""
        self.q8_matmul: torch._ops.OpOverload | None = None
        """The C++ op of kernel "int8_q8_0" (`fastgen.ops.cpu_kernels.q8.q8_matmul_op`), picked before the
        first rows are quantized, for their layout."""
        self.q4_matmul: torch._ops.OpOverload | None = None
        """The C++ op of kernel "int4_q4" (`fastgen.ops.cpu_kernels.q4.q4_matmul_op`)."""
        self._staged: dict[str, torch.Tensor] = {}
        self._rows_in: torch.Tensor | None = None

    def extra_repr(self) -> str:
        """Sizes and format shown by `print(model)`."""
        group = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.mode}{group}")

    @torch.no_grad()
    def load_rows(self, start: int, rows: torch.Tensor, device: torch.device) -> None:
        """Quantize checkpoint rows `start : start + len(rows)` of the (this rank's) weight on `device`;
        the last of them packs the weight."""
        if self.kernel:
            raise ValueError("weight rows arrived after the layer was complete (a tensor appears twice?)")
        n, k = self.out_features, self.in_features
        if not self._staged:
            self._rows_in = torch.zeros(n, dtype=torch.bool)
            if self.mode == "int8" and device.type == "cpu" and k % Q8_BLOCK == 0:
                self.q8_matmul = q8_matmul_op()
            if self.q8_matmul is not None:
                self._staged = {"q": torch.empty(n, k, dtype=torch.int8, device=device),
                                "scales": torch.empty(n, k // Q8_BLOCK, dtype=torch.float16, device=device)}
            elif self.mode == "int8":
                self._staged = {"q": torch.empty(n, k, dtype=torch.int8, device=device),
                                "scales": torch.empty(n, dtype=self.dtype, device=device)}
            else:
                groups = k // self.group_size
                self._staged = {"q": torch.empty(n, k, dtype=torch.uint8, device=device),
                                "scales": torch.empty(n, groups, dtype=self.dtype, device=device),
                                "zeros": torch.empty(n, groups, dtype=self.dtype, device=device)}
        rows = rows.to(device)
        end = start + rows.shape[0]
        if self.mode == "int8":
            parts = quantize_q8_0(rows) if self.q8_matmul is not None else quantize_int8(rows, self.dtype)
        else:
            parts = quantize_int4(rows, self.group_size, self.dtype)
        for name, part in zip(self._staged, parts):
            self._staged[name][start:end] = part
        self._rows_in[start:end] = True
        if bool(self._rows_in.all()):
            self._pack(device)

    def _pack(self, device: torch.device) -> None:
        """Turn the staged values into the kernel's layout and drop the meta weight."""
        staged, self._staged, self._rows_in = self._staged, {}, None
        if self.mode == "int8":
            q, scales = staged["q"], staged["scales"]
            if self.q8_matmul is not None:
                q, scales = pack_q8_0(q, scales)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales)
            self.kernel = "int8_q8_0" if self.q8_matmul is not None else "int8"
        else:
            q = staged["q"]
            if device.type == "cpu" and q4_blocker(device, self.group_size) is None:
                packed, scales_zeros = pack_q4(q, staged["scales"], staged["zeros"])
                self.q4_matmul = q4_matmul_op()
                self.kernel = "int4_q4"
            else:
                if device.type == "cuda":
                    # The CUDA converter takes two values per byte, the even column in the high nibble.
                    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(),
                                                                        _inner_k_tiles(self.in_features))
                    self.kernel = "int4_cuda"
                else:
                    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32),
                                                                                _inner_k_tiles(self.in_features))
                    self.kernel = "int4_cpu"
                # [K / group, N, 2]: each group's scale and zero side by side, as the kernels read them.
                scales_zeros = torch.stack((staged["scales"], staged["zeros"]), dim=-1).transpose(0, 1).contiguous()
            self.register_buffer("qweight", packed)
            self.register_buffer("scales_zeros", scales_zeros)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T (+ bias)` over the last dimension of `x` (this rank's input columns if row-parallel)."""
        flat = x.reshape(-1, self.in_features)
        if self.kernel == "int8_q8_0":
            out = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32, device=flat.device)
            self.q8_matmul(out, flat if flat.stride(1) == 1 else flat.contiguous(), self.qweight, self.scales)
            out = out.to(x.dtype)
        elif self.kernel == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        elif self.kernel == "int4_q4":
            out = self.q4_matmul(flat if flat.stride(1) == 1 else flat.contiguous(), self.qweight, self.scales_zeros,
                                 self.group_size)
        elif self.kernel == "int4_cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group_size, self.scales_zeros)
        elif self.kernel == "int4_cuda":
            out = torch.ops.aten._weight_int4pack_mm(flat, self.qweight, self.group_size, self.scales_zeros)
        else:
            raise RuntimeError("QuantizedLinear ran before its weight was loaded")
        out = out.view(*x.shape[:-1], self.out_features)
        if self.row_parallel and self.tp.size > 1:
            return finish_row_parallel(out, self.bias, self.tp, self.reduce)
        return out if self.bias is None else out + self.bias


def _inner_k_tiles(in_features: int) -> int:
    """The CUDA int4 tiling (K tiles of 16 per inner loop), as large as K allows; the CPU ignores it."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def quantizable_linears(model: nn.Module, quantized: bool = False) -> dict[str, nn.Module]:
    """The linears `quantize_decoder_linears` replaces, by name: those inside the model's decoder
    layers (the children of its `nn.ModuleList`s), less the LM head and the children a module lists
    in `unquantized_children`; with `quantized`, those it has already replaced too. The planner sizes
    quantized weights from the same list, and LoRA adapts the same linears."""
    kinds = (nn.Linear, QuantizedLinear) if quantized else nn.Linear
    targets: dict[str, nn.Module] = {}
    for list_name, layers in model.named_modules():
        if not isinstance(layers, nn.ModuleList):
            continue
        for name, module in layers.named_modules(prefix=list_name):
            if not isinstance(module, kinds) or isinstance(module, ParallelLMHead):
                continue
            parent_name, _, child = name.rpartition(".")
            if child in getattr(model.get_submodule(parent_name), "unquantized_children", ()):
                continue
            targets[name] = module
    return targets


def quantized_weight_bytes(out_features: int, in_features: int, mode: str, dtype: torch.dtype,
                           group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """Bytes a `QuantizedLinear`'s packed weight holds (its bias aside): int8 values plus, per output
    channel, the larger of one `dtype` scale and Q8_0's fp16 scale per 32 inputs (the layout of CPUs that
    run fastgen's kernels), or int4 values (two per byte) plus a `dtype` scale and zero per group of
    `group_size` input features (a partial group counted whole, for shapes int4 would refuse)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if mode == "int8":
        return out_features * in_features + out_features * max(itemsize, 2 * -(-in_features // Q8_BLOCK))
    if mode == "int4":
        return out_features * in_features // 2 + 2 * out_features * -(-in_features // group_size) * itemsize
    raise ValueError(f"quantized_weight_bytes: mode must be 'int8' or 'int4', got {mode!r}")


def quantize_decoder_linears(model: nn.Module, mode: str, dtype: torch.dtype,
                             group_size: int = DEFAULT_GROUP_SIZE) -> list[str]:
    """Replace the linears inside the model's decoder layers (the children of its `nn.ModuleList`s)
    by `QuantizedLinear`s, in place, before the weights are loaded; returns their names.

    The LM head and every linear outside the layers (embedding projections) keep the plan dtype, and
    so do the children a module lists in `unquantized_children` (MoE routers: their top-k choice is
    what the experts' outputs hinge on).
    """
    if mode == "none":
        return []
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(map(repr, QUANTIZATIONS))}, got {mode!r}")
    targets = quantizable_linears(model)
    for name, linear in targets.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, QuantizedLinear(linear, mode, dtype, group_size, name))
    return list(targets)

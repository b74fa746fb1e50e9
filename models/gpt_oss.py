"""gpt-oss (OpenAI's open-weight MoE): Llama-style attention with attention sinks, sliding and full
layers alternating (`layer_types`), and a sparse MoE of biased experts with a clamped SwiGLU.

What differs from the Llama decoder, each as HF's `modeling_gpt_oss.py` does it:
- attention: q/k/v/o biases, and per query head a learned sink logit (`self_attn.sinks`) that joins
  the softmax's denominator and weighs no value (`fastgen.ops.attention(..., sinks=)`);
- `layer_types`: "sliding_attention" layers see `sliding_window` keys, "full_attention" layers all;
- the MoE (`mlp.router`, `mlp.experts`): router logits with a bias, the top-k logits softmaxed among
  themselves; experts with biases on both projections and the gate `min(g, limit) * sigmoid(alpha *
  min(g, limit))` times `(clamp(u, -limit, limit) + 1)` (`swiglu_alpha`, `swiglu_limit`).

Checkpoint layout: the experts' stacks are `[E, H, 2I]` with gate and up interleaved (column `2i` is
gate `i`, `2i + 1` up `i`) and `down_proj` `[E, I, H]`; `adapt_checkpoint_tensor` turns them into
`StackedExperts`' `[E, 2I, H]` (gate rows, then up rows) and `[E, H, I]`. OpenAI's own checkpoints
store the expert matrices in MXFP4 (`*_blocks` uint8 `[E, rows, in / 32, 16]`, two 4-bit e2m1 values a
byte, low nibble first, and `*_scales` uint8 `[E, rows, in / 32]`, a power-of-two exponent + 127 per
32 values, rows in the output dimension): they are dequantized as they load (`dequantize_mxfp4`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM
from fastgen.models.layers import QKV_PACKING
from fastgen.models.llama import LlamaDecoderLayer
from fastgen.models.moe import StackedExperts
from fastgen.models.parallel import all_reduce, read_slice
from fastgen.ops import AttentionMetadata, attention

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The `layer_types` entries gpt-oss defines; any other is refused at load."""

# e2m1 values of the 16 four-bit codes (sign bit high): OCP Microscaling's FP4.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 `[..., rows, groups * 32]` from MXFP4 `blocks` (uint8 `[..., rows, groups, 16]`) and `scales`
    (uint8 `[..., rows, groups]`): each byte holds two values (low nibble first), each group of 32 shares
    the factor `2 ** (scale - 127)`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., groups, 16] and scales uint8 [..., groups], got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).sub(127).unsqueeze(-1))
    return values.flatten(-2)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate/up pairs interleaved along `dim` (gate 0, up 0, gate 1, ...) -> all gates, then all ups."""
    size = t.shape[dim]
    return torch.cat((t.index_select(dim, torch.arange(0, size, 2)), t.index_select(dim, torch.arange(1, size, 2))),
                     dim=dim)


def resolve_config(config: ModelConfig) -> ModelConfig:
    """`config` with gpt-oss's layer windows (HF's default when `layer_types` is absent: even layers
    slide); ValueError naming what it asks for that this file does not implement."""
    raw = config.raw
    types = raw.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(config.num_layers)]
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"gpt_oss layer_types entries {unknown} are not implemented (supported: {list(LAYER_TYPES)})")
    if len(types) != config.num_layers:
        raise ValueError(f"gpt_oss layer_types has {len(types)} entries for {config.num_layers} layers")
    if config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"gpt_oss hidden_act {config.hidden_act!r} is not implemented (the experts' gate is "
                         "its clamped SwiGLU)")
    quant = raw.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise ValueError(f"gpt_oss quantization_config quant_method {quant.get('quant_method')!r} is not "
                         "implemented (MXFP4 expert weights are dequantized at load)")
    window = raw.get("sliding_window") or 0
    return dataclasses.replace(config, layer_sliding_windows=[window if t == "sliding_attention" else 0 for t in types])


class GptOssAttention(Attention):
    """The shared attention with q/k/v/o biases and attention sinks (this rank's heads under TP)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__(config, layer_idx, rotary, qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def load_checkpoint_shard(self, attr: str, shard: int | None, full) -> torch.Tensor:
        """This rank's heads of the sinks."""
        return read_slice(full, 0, self.num_heads * self.qkv_proj.tp.rank, self.num_heads)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Attend this step's tokens `hidden` `[T, hidden]` over their sequences' cached K/V."""
        q, k, v = self.project(positions, hidden, attn_metadata)
        out = attention(q, k, v, kv_cache, attn_metadata, self.scale, self.sliding_window, self.softcap, self.sinks)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))


class GptOssMLP(nn.Module):
    """Router (top-k logits, softmax among them) and biased experts with the clamped SwiGLU."""

    unquantized_children = ("router",)
    """Kept in the plan dtype under `quantization`: the router picks which experts a token meets."""

    has_shared_expert = False
    """No always-on expert (the planner asks)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        raw = config.raw
        self.tp = config.parallel
        self.top_k = raw["num_experts_per_tok"]
        self.alpha = float(raw.get("swiglu_alpha", 1.702))
        self.limit = float(raw.get("swiglu_limit", 7.0))
        self.router = nn.Linear(config.hidden_size, raw["num_local_experts"], bias=True)
        self.experts = StackedExperts(raw["num_local_experts"], config.hidden_size, config.intermediate_size,
                                      config.hidden_act, config.parallel, bias=True, glu=self._clamped_swiglu)

    def _clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the layer to `hidden` `[T, H]`."""
        top_logits, ids = torch.topk(self.router(hidden), self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
        return all_reduce(self.experts(hidden, weights, ids), self.tp)


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Pre-norm residual block: attention with sinks, then the MoE."""

    def build_attention(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> nn.Module:
        """Biased attention with sinks."""
        return GptOssAttention(config, layer_idx, rotary)

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The MoE (every layer)."""
        return GptOssMLP(config)


class GptOssForCausalLM(DecoderLM):
    """Causal LM over the gpt-oss decoder."""

    layer_cls = GptOssDecoderLayer
    packed_modules_mapping = dict(QKV_PACKING)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # MXFP4 halves (`*_blocks`, `*_scales`) held until their partner arrives, by parameter name.
        self._mxfp4_pending: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """gpt-oss's layer windows; what it cannot run refused (`resolve_config`)."""
        return resolve_config(config)

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Expert stacks into `StackedExperts`' layout; MXFP4 pairs dequantized once both halves arrived."""
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix) and ".experts." in name:
                base = name.removesuffix(suffix)
                halves = self._mxfp4_pending.setdefault(base, {})
                halves[suffix] = tensor
                if len(halves) < 2:
                    return None
                del self._mxfp4_pending[base]
                # Dequantized rows are the output dimension: [E, out, in], StackedExperts' own orientation.
                weight = dequantize_mxfp4(halves["_blocks"], halves["_scales"])
                return base, _deinterleave(weight, 1) if base.endswith("gate_up_proj") else weight
        if name.endswith("experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H] gates then ups
            return name, _deinterleave(tensor.transpose(1, 2), 1)
        if name.endswith("experts.gate_up_proj_bias"):
            return name, _deinterleave(tensor, 1)
        if name.endswith("experts.down_proj"):  # [E, I, H] -> [E, H, I]
            return name, tensor.transpose(1, 2)
        return name, tensor

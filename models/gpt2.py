"""The GPT-2 family (`GPT2LMHeadModel`: gpt2, distilgpt2, and GPT-2 style fine-tunes).

Pre-LayerNorm blocks, learned absolute positions (`wpe`), a fused q|k|v projection (`c_attn`), a
gelu_new MLP (`c_fc`/`c_proj`) and a tied LM head. Attention is scaled by head_dim**-0.5 unless
`scale_attn_weights=False`, and further by 1/(layer index + 1) when `scale_attn_by_inverse_layer_idx`.

GPT-2's checkpoints store their projections as `Conv1D` weights `[in, out]`: we keep the shared
attention and MLP (tensor-parallel linears) and transpose and rename those tensors at load time
(`adapt_checkpoint_tensor`), which also accepts old files whose names lack the `transformer.` prefix and skips the causal-mask
buffers (`attn.bias`, `attn.masked_bias`) they saved. LoRA adapters of those modules take the same names
(`adapt_lora_pair`) but no transpose: PEFT's A `[r, in]` and B `[out, r]` are a Linear's for a Conv1D too.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM, ShellNames
from fastgen.models.layers import MLP
from fastgen.ops import AttentionMetadata

_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_MASK_BUFFERS = ("bias", "masked_bias")
# GPT-2's module names -> the shared attention's and MLP's (both call their output `c_proj`).
_RENAMES = {".attn.qkv_proj.": ".attn.c_attn.", ".attn.o_proj.": ".attn.c_proj.", ".mlp.fc1.": ".mlp.c_fc.",
            ".mlp.fc2.": ".mlp.c_proj."}


def _our_name(name: str) -> str:
    """Our name for a GPT-2 checkpoint name: the `transformer.` prefix old files lack, and HF's module names
    replaced by the shared attention's and MLP's."""
    if not name.startswith(("transformer.", "lm_head.")):
        name = "transformer." + name
    for ours, theirs in _RENAMES.items():
        name = name.replace(theirs, ours)
    return name


def check_gpt2_config(config: ModelConfig) -> None:
    """Raise ValueError for the GPT-2 variants fastgen cannot serve."""
    if config.raw.get("add_cross_attention", False):
        raise ValueError(
            "gpt2 config sets add_cross_attention: cross-attention needs encoder states, which a "
            "decoder-only engine does not have"
        )
    if config.num_kv_heads != config.num_heads:
        raise ValueError(
            f"gpt2 config gives {config.num_kv_heads} key/value heads for {config.num_heads} query heads; "
            "GPT-2 attention has no grouped-query variant (drop num_key_value_heads from config.json)"
        )


def gpt2_attention(config: ModelConfig, layer_idx: int) -> Attention:
    """Multi-head attention scaled by head_dim ** -0.5 unless `scale_attn_weights=False`, and by
    1 / (layer index + 1) more when `scale_attn_by_inverse_layer_idx`. (`reorder_and_upcast_attn`
    only changes where HF upcasts to fp32; our attention op computes scores and softmax in fp32.)"""
    raw = config.raw
    scale = config.head_dim**-0.5 if raw.get("scale_attn_weights", True) else 1.0
    if raw.get("scale_attn_by_inverse_layer_idx", False):
        scale /= float(layer_idx + 1)
    return Attention(config, layer_idx, None, qkv_bias=True, o_bias=True, scale=scale, sliding_window=0)


class GPT2Block(nn.Module):
    """Pre-LN residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__()
        eps = config.raw.get("layer_norm_epsilon", 1e-5)
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = gpt2_attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        # HF's rule: n_inner, or 4 x hidden when null (a generic intermediate_size key is ignored).
        inner = config.raw.get("n_inner") or 4 * config.hidden_size
        self.mlp = MLP(config.hidden_size, inner, config.raw.get("activation_function", "gelu_new"),
                       tp=config.parallel)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        hidden = hidden + self.attn(positions, self.ln_1(hidden), attn_metadata, kv_cache)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2LMHeadModel(DecoderLM):
    """Causal LM over the GPT-2 decoder (HF's `GPT2LMHeadModel`)."""

    names = ShellNames(base="transformer", embed="wte", layers="h", norm="ln_f")
    layer_cls = GPT2Block
    conv1d_modules = tuple(name.removesuffix(".weight") for name in _CONV1D_WEIGHTS)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.body.wpe = nn.Embedding(self.config.max_position_embeddings, self.config.hidden_size)

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """`config`, refused for the GPT-2 variants fastgen cannot serve (`check_gpt2_config`)."""
        check_gpt2_config(config)
        return config

    def build_rotary(self, config: ModelConfig) -> None:
        """None: GPT-2 has learned absolute positions (`wpe`)."""
        return None

    def build_norm(self, config: ModelConfig) -> nn.Module:
        """A LayerNorm with GPT-2's `layer_norm_epsilon`."""
        return nn.LayerNorm(config.hidden_size, eps=config.raw.get("layer_norm_epsilon", 1e-5))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token plus learned position embeddings."""
        return self.embed_tokens(input_ids) + self.body.wpe(positions)

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Our name and layout for a checkpoint tensor; None for the saved attention-mask buffers."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "attn" and parts[-1] in _MASK_BUFFERS:
            return None
        if name.endswith(_CONV1D_WEIGHTS):
            tensor = tensor.t()
        return _our_name(name), tensor

    def adapt_lora_pair(self, hf_module: str, a: torch.Tensor, b: torch.Tensor
                        ) -> tuple[str, torch.Tensor, torch.Tensor]:
        """The pair under our module name, as it is: only the base weight of a Conv1D is stored `[in, out]`."""
        return _our_name(f"{hf_module}.weight").removesuffix(".weight"), a, b

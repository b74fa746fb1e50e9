"""The OPT family (facebook/opt-125m ... 66b).

A classic decoder: learned absolute positions (stored with an offset of 2, a fairseq legacy),
LayerNorm before each block (`do_layer_norm_before=True`, most sizes) or after it (opt-350m), a
ReLU MLP (fc1/fc2), biases everywhere unless `enable_bias=False`, and optional `project_in` /
`project_out` when the embedding width (`word_embed_proj_dim`) differs from the hidden size.
Checkpoint names carry HF's `model.decoder.` prefix (older files: `decoder.`).
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.models.attention import Attention, KVCache
from fastgen.models.config import ModelConfig
from fastgen.models.decoder import DecoderLM, ShellNames
from fastgen.models.layers import QKV_PACKING, get_activation
from fastgen.models.parallel import MergedLinear, RowParallelLinear
from fastgen.ops import AttentionMetadata

POSITION_OFFSET = 2
"""OPT's learned position table starts at row 2: position p reads row p + 2."""


def _layer_norm(config: ModelConfig, dim: int) -> nn.LayerNorm:
    """OPT's LayerNorm: torch's default eps, affine unless `layer_norm_elementwise_affine=False`."""
    return nn.LayerNorm(dim, elementwise_affine=config.raw.get("layer_norm_elementwise_affine", True))


class OPTDecoderLayer(nn.Module):
    """Attention then MLP, each with a residual; LayerNorm before (pre-LN) or after (post-LN) each."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: nn.Module | None) -> None:
        super().__init__()
        bias = config.raw.get("enable_bias", True)
        tp = config.parallel
        self.norm_before = config.raw.get("do_layer_norm_before", True)
        # HF scales the projected queries and attends with scale 1: same rounding as theirs.
        self.self_attn = Attention(config, layer_idx, None, qkv_bias=bias, o_bias=bias, sliding_window=0,
                                   prescale_query=True)
        self.self_attn_layer_norm = _layer_norm(config, config.hidden_size)
        self.fc1 = MergedLinear(config.hidden_size, [config.intermediate_size], bias=bias, tp=tp)
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, tp=tp)
        self.act = get_activation(config.raw.get("activation_function", "relu"))
        self.final_layer_norm = _layer_norm(config, config.hidden_size)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one layer over the flat batch."""
        if self.norm_before:
            hidden = hidden + self.self_attn(positions, self.self_attn_layer_norm(hidden), attn_metadata, kv_cache)
            return hidden + self.fc2(self.act(self.fc1(self.final_layer_norm(hidden))))
        hidden = self.self_attn_layer_norm(hidden + self.self_attn(positions, hidden, attn_metadata, kv_cache))
        return self.final_layer_norm(hidden + self.fc2(self.act(self.fc1(hidden))))


class OPTForCausalLM(DecoderLM):
    """Causal LM over the OPT decoder; the LM head reads the (projected) embedding width."""

    names = ShellNames(base="model.decoder", norm="final_layer_norm")
    layer_cls = OPTDecoderLayer
    packed_modules_mapping = {**QKV_PACKING, "out_proj": ("o_proj", None)}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        config = self.config
        decoder = self.body
        decoder.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        decoder.project_in = decoder.project_out = None
        if self.embed_dim != config.hidden_size:
            decoder.project_in = nn.Linear(self.embed_dim, config.hidden_size, bias=False)
            decoder.project_out = nn.Linear(config.hidden_size, self.embed_dim, bias=False)

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """`config`, refused when it claims grouped-query attention (OPT has none)."""
        if config.num_kv_heads != config.num_heads:
            raise ValueError(
                f"opt config gives {config.num_kv_heads} key/value heads for {config.num_heads} query heads; "
                "OPT attention has no grouped-query variant (drop num_key_value_heads from config.json)"
            )
        return config

    @property
    def embed_dim(self) -> int:
        """`word_embed_proj_dim` when set: the embedding and LM head width, projected to/from hidden."""
        return self.config.raw.get("word_embed_proj_dim") or self.config.hidden_size

    def build_rotary(self, config: ModelConfig) -> None:
        """None: OPT has learned absolute positions."""
        return None

    def build_norm(self, config: ModelConfig) -> nn.Module | None:
        """Pre-LN models end with a norm; post-LN ones (opt-350m) and pre-4.20 fine-tunes marked
        `_remove_final_layer_norm` have none."""
        raw = config.raw
        if raw.get("do_layer_norm_before", True) and not raw.get("_remove_final_layer_norm", False):
            return _layer_norm(config, config.hidden_size)
        return None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embedding (projected in) plus the learned position embedding."""
        decoder = self.body
        hidden = self.embed_tokens(input_ids)
        if decoder.project_in is not None:
            hidden = decoder.project_in(hidden)
        return hidden + decoder.embed_positions(positions + POSITION_OFFSET)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm (if any), then projected out to the embedding width."""
        hidden = super().finish(hidden)
        project_out = self.body.project_out
        return hidden if project_out is None else project_out(hidden)

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Give old checkpoints' bare `decoder.` names HF's `model.decoder.` prefix."""
        if name.startswith("decoder."):
            name = "model." + name
        return name, tensor

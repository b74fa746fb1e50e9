"""The decoder-LM shell every family is built on.

A decoder-only LM is, around its blocks, always the same: a token embedding (maybe scaled), the
stack of blocks run over the flat ragged batch with one KV cache each, a final norm, an LM head
(maybe tied to the embedding, maybe biased) and a last touch on the logits (soft-capping,
scaling). `DecoderLM` owns all of that, in its tensor-parallel form (vocabulary-parallel
embedding and head from `parallel.py`), so a family file holds only its block, the hooks it
changes and its checkpoint names.

Everything else the engine does to a model works through this shape: quantization and
oneDNN prepacking replace the linears inside the layer stack (`quant.py`, `packed.py`), weight
offload streams the layers (`decoder_layers`), and compilation compiles each layer.

A family subclass sets:
- `names`: where HF keeps the embedding, layer list and final norm (`model.embed_tokens`,
  `transformer.h`, ...), so checkpoint names load 1:1;
- `layer_cls(config, layer_idx, rotary)`: its block, whose forward is
  `(positions, hidden, attn_metadata, kv_cache) -> hidden`;
- `packed_modules_mapping` (and `stacked_experts_mapping`, `adapt_checkpoint_tensor`) for the
  checkpoint names that differ from its modules' (LoRA adapters follow them: `adapt_lora_pair`);
- any of the hooks below it changes: `model_config`, `build_rotary`, `build_norm`, `embed`,
  `finish`, `process_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from fastgen.models.config import ModelConfig
from fastgen.models.layers import RMSNorm, rotary_embedding
from fastgen.models.parallel import ParallelLMHead, VocabParallelEmbedding
from fastgen.ops import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class ShellNames:
    """Where HF's modeling code keeps the shell's parts, so the module tree mirrors checkpoint names."""

    base: str = "model"
    """Dotted prefix of the body (`model`, `transformer`, `model.decoder`)."""
    embed: str = "embed_tokens"
    """Token embedding under `base`."""
    layers: str = "layers"
    """The `nn.ModuleList` of blocks under `base`."""
    norm: str = "norm"
    """Final norm under `base` ("" = the family has none, or decides in `build_norm`)."""
    rotary: str = "rotary_emb"
    """The shared rotary embedding under `base` (non-persistent buffers only)."""


def softcap_value(raw: dict, key: str) -> float:
    """A soft-capping value from the config, 0.0 when absent or null (no capping)."""
    value = raw.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{key} must be a positive number or null, got {value!r}")
    return float(value)


class DecoderLM(nn.Module):
    """Embedding, layer stack, final norm, LM head and logits of a decoder-only causal LM.

    The forward takes the engine's flat ragged batch: `input_ids[T]`, `positions[T]`, the step's
    `AttentionMetadata` and one `(k_cache, v_cache)` per layer, and returns hidden states `[T, H]`;
    `compute_logits` turns the rows that need logits into fp32 `[N, vocab]` (None on
    tensor-parallel ranks > 0, which only send their vocabulary slice).
    """

    names: ClassVar[ShellNames] = ShellNames()
    """Where the shell's parts sit in HF's module tree."""
    layer_cls: ClassVar[type[nn.Module]]
    """The family's block, built as `layer_cls(config, layer_idx, rotary)`."""
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int | None]]] = {}
    """Checkpoint module name -> (our module, shard index or None for a plain rename); the loader uses it."""
    lm_head_bias: ClassVar[bool] = False
    """The LM head has a bias (Phi); it stays separate when the weight is tied."""
    long_rope_whole_sequence: ClassVar[bool] = False
    """HF recomputes a sequence with LongRoPE's long factors once it outgrows the original length."""
    supported_layer_types: ClassVar[frozenset[str]] = frozenset({"full_attention", "sliding_attention"})
    """The `layer_types` entries the family implements; any other fails at load, naming it."""
    conv1d_modules: ClassVar[tuple[str, ...]] = ()
    """Modules (dotted name suffixes, `attn.c_attn`) HF keeps as `Conv1D`, weight stored `[in, out]`: PEFT
    marks adapters of them `fan_in_fan_out`, which changes only how PEFT merges them (its A and B are a
    Linear's either way)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config = self.model_config(config)
        unknown = sorted(set(config.raw.get("layer_types") or ()) - self.supported_layer_types)
        if unknown:
            raise ValueError(f"{config.model_type} config.json: layer_types entries {unknown} are not implemented "
                             f"(supported: {sorted(self.supported_layer_types)})")
        self.config = config
        tp = config.parallel
        body = self._body_container()
        rotary = self.build_rotary(config)
        if rotary is not None:
            setattr(body, self.names.rotary, rotary)
        setattr(body, self.names.embed, VocabParallelEmbedding(config.vocab_size, self.embed_dim, tp))
        setattr(body, self.names.layers,
                nn.ModuleList(self.layer_cls(config, i, rotary) for i in range(config.num_layers)))
        norm = self.build_norm(config)
        if norm is not None:
            setattr(body, self.names.norm, norm)
        self.lm_head = ParallelLMHead(self.embed_dim, config.vocab_size, tp, bias=self.lm_head_bias)
        self.tie_weights()

    # --- hooks a family may override -------------------------------------------------------------

    @classmethod
    def model_config(cls, config: ModelConfig) -> ModelConfig:
        """`config` with the family's reading of shared fields resolved (and what it cannot run refused)."""
        return config

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding and the LM head's input (OPT projects it to `hidden_size`)."""
        return self.config.hidden_size

    def build_rotary(self, config: ModelConfig) -> nn.Module | None:
        """The rotary embedding the layers share (None: the family has learned positions or none)."""
        return rotary_embedding(config)

    def build_norm(self, config: ModelConfig) -> nn.Module | None:
        """The final norm (None: none)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual stream's input `[T, H]` for the step's tokens."""
        return self.embed_tokens(input_ids)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output through the final norm: what the LM head reads."""
        norm = self.final_norm
        return hidden if norm is None else norm(hidden)

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's fp32 logits after the family's last touch (soft-capping, scaling)."""
        return logits

    def adapt_lora_pair(self, hf_module: str, a: torch.Tensor, b: torch.Tensor
                        ) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """A LoRA pair of HF module `hf_module` (A `[r, in]`, B `[out, r]`) under our module name and
        layout, or None when the loader skips that module's weights (HF ignores it too).

        A family's `adapt_checkpoint_tensor(name, tensor)`, when it has one, sees B as the module's
        weight: B's rows are the linear's output rows, so the hook's renames, skips and reorderings of a
        weight's rows serve B as they serve the weight, and A (its input side) stays as it is. A family
        whose hook rewrites a linear's weight in any other way (GPT-2's `[in, out]` Conv1D transpose,
        which an adapter's pair does not share) overrides this.
        """
        adapt = getattr(self, "adapt_checkpoint_tensor", None)
        if adapt is None:
            return hf_module, a, b
        adapted = adapt(f"{hf_module}.weight", b)
        if adapted is None:
            return None
        name, b = adapted
        return name.removesuffix(".weight"), a, b

    # --- the shell -------------------------------------------------------------------------------

    def _body_container(self) -> nn.Module:
        """The (new, empty) module at `names.base`, creating the intermediate containers."""
        parent: nn.Module = self
        for part in self.names.base.split("."):
            child = getattr(parent, part, None) if part in parent._modules else None
            if child is None:
                child = nn.Module()
                setattr(parent, part, child)
            parent = child
        return parent

    @property
    def body(self) -> nn.Module:
        """The module at `names.base` (HF's `model.` or `transformer.`)."""
        return self.get_submodule(self.names.base)

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        """The token embedding."""
        return getattr(self.body, self.names.embed)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers."""
        return getattr(self.body, self.names.layers)

    @property
    def final_norm(self) -> nn.Module | None:
        """The final norm, None when the family has none."""
        return getattr(self.body, self.names.norm, None) if self.names.norm else None

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (a head bias stays its own)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` (what the head reads); call `compute_logits` on the rows that need logits."""
        hidden = self.embed(input_ids, positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, attn_metadata, kv_cache)
        return self.finish(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits `[N, vocab]` for the selected hidden rows (None on tensor-parallel ranks > 0)."""
        logits = self.lm_head.logits(hidden)
        return None if logits is None else self.process_logits(logits)

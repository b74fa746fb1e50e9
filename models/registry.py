"""HF `model_type` -> model class. Adding an architecture adds one line here."""

from __future__ import annotations

from types import MappingProxyType

from torch import nn

from fastgen.models.deepseek_v3 import DeepseekV3ForCausalLM
from fastgen.models.falcon import FalconForCausalLM
from fastgen.models.gemma import GemmaForCausalLM
from fastgen.models.gemma3 import Gemma3ForCausalLM
from fastgen.models.gemma4 import Gemma4ForCausalLM
from fastgen.models.glm4_moe import Glm4MoeForCausalLM
from fastgen.models.gpt2 import GPT2LMHeadModel
from fastgen.models.granite import GraniteForCausalLM
from fastgen.models.gpt_oss import GptOssForCausalLM
from fastgen.models.llama import LlamaForCausalLM
from fastgen.models.llama4 import Llama4ForCausalLM
from fastgen.models.mixtral import MixtralForCausalLM
from fastgen.models.olmo import OlmoForCausalLM
from fastgen.models.opt import OPTForCausalLM
from fastgen.models.phi import PhiForCausalLM
from fastgen.models.phi3 import Phi3ForCausalLM
from fastgen.models.qwen3_5 import Qwen3_5ForCausalLM
from fastgen.models.qwen_moe import QwenMoeForCausalLM

MODEL_REGISTRY: MappingProxyType[str, type[nn.Module]] = MappingProxyType({
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": QwenMoeForCausalLM,
    "qwen3_moe": QwenMoeForCausalLM,
    "falcon": FalconForCausalLM,
    "opt": OPTForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "phi": PhiForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma": GemmaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma4_text": Gemma4ForCausalLM,
    "olmo2": OlmoForCausalLM,
    "granite": GraniteForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "olmo3": OlmoForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "llama4_text": Llama4ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "kimi_k2": DeepseekV3ForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_moe_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5ForCausalLM,
    "qwen3_next": Qwen3_5ForCausalLM,
})
"""Every supported `model_type` and the class that serves it."""


def supported_model_types() -> list[str]:
    """Sorted list of the `model_type` values fastgen can load."""
    return sorted(MODEL_REGISTRY)


def get_model_class(model_type: str) -> type[nn.Module]:
    """The class for `model_type`, or a ValueError listing what is supported."""
    if model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model_type {model_type!r}; fastgen supports: {', '.join(supported_model_types())}"
        )
    return MODEL_REGISTRY[model_type]


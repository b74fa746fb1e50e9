"""Shared fixtures: offline mode, the test-kit path, tiny checkpoints and HF references built once per session."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compilation costs seconds per bucket; the tests that are about it ask for it explicitly.
os.environ.setdefault("FASTGEN_COMPILE", "off")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from kit import TINY_CONFIGS, build_checkpoint, hf_greedy  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """model_type -> directory of a tiny fp32 checkpoint with tokenizer (built once)."""
    root = tmp_path_factory.mktemp("tiny")
    return {mt: build_checkpoint(str(root / mt), mt) for mt in TINY_CONFIGS}


@pytest.fixture(scope="session")
def hf_reference():
    """`reference(path, prompts, max_new_tokens)` -> HF's greedy (tokens, logprobs [new, vocab]) per
    prompt, EOS off; computed once per session (HF generation dominates the parity tests' time)."""
    cache = {}

    def reference(path: str, prompts: list[list[int]], max_new_tokens: int):
        key = (path, tuple(map(tuple, prompts)), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(path, prompts, max_new_tokens)
        return cache[key]

    return reference


@pytest.fixture(scope="session")
def lora_families(tmp_path_factory):
    """`lora_families(model_type)` -> `kit_lora.Family`: a tiny checkpoint, two random PEFT adapters and
    the oracle's greedy tokens, built once per session (peft is imported only by the tests that use it)."""
    from kit_lora import build_family

    built = {}

    def get(model_type: str):
        if model_type not in built:
            built[model_type] = build_family(tmp_path_factory.mktemp(f"lora_{model_type}"), model_type)
        return built[model_type]

    return get

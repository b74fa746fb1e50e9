"""From an `EngineConfig` to what an `Engine` is made of: the plan (`plan_engine`), then the loaded
runner on every rank, its tokenizer and EOS ids (`build_runner`). `Engine.from_config` chains the two;
code that already holds a `Plan` (a tuned one, a test's) calls `build_runner` and `Engine(...)` itself.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import AutoTokenizer

from fastgen.config import EngineConfig
from fastgen.executor.distributed import TensorParallelGroup, torchrun_env
from fastgen.executor.runner import ModelRunner, RunnerSpec, kv_bytes_per_block, load_for_spec
from fastgen.models.config import ModelConfig
from fastgen.models.loader import check_tensor_parallel, resolve_model_dir
from fastgen.planning.hardware import detect_hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.plan import Plan
from fastgen.planning.policy import make_plan

logger = logging.getLogger("fastgen")

DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_model")
"""The small Llama-architecture model shipped inside the package (used when no model is named)."""


def plan_engine(config: EngineConfig) -> Plan:
    """The plan for `config`'s model on this machine: the policy's choices, overridden by every plan
    field `config` sets (`FASTGEN_COMPILE` sets `compile`, a torchrun launch `tensor_parallel`, unless given)."""
    model_path = config.model or DEMO_MODEL_DIR
    if config.model is None:
        logger.info("fastgen: no model named, using the bundled demo model %s", DEMO_MODEL_DIR)
    overrides = config.plan_overrides()
    if overrides["compile"] is None and os.environ.get("FASTGEN_COMPILE"):
        overrides["compile"] = os.environ["FASTGEN_COMPILE"]
    launch = torchrun_env()
    if launch is not None and overrides["tensor_parallel"] is None:
        overrides["tensor_parallel"] = launch.world_size
    return make_plan(model_facts(model_path), detect_hardware(config.device), offline=config.offline, **overrides)


@dataclass(slots=True)
class BuiltRunner:
    """A loaded model behind its runner, with what the engine needs from the checkpoint besides."""

    runner: ModelRunner
    """This rank's runner (model, KV cache, compiled steps); its `spec` sizes the engine."""
    tokenizer: Any
    """The checkpoint's Hugging Face tokenizer."""
    eos_token_ids: set[int]
    """The model's end-of-sequence ids (generation config, else the tokenizer's)."""
    tp_group: TensorParallelGroup | None = None
    """The other ranks' workers when `plan.tensor_parallel` > 1 (the engine owns and stops them)."""
    threads_before: int = 0
    """This process's CPU threads before they were split across ranks (restored when the group stops)."""
    draft_runner: ModelRunner | None = None
    """The draft model's runner (its own KV cache, as many tokens as the target's) when the plan's
    `speculative_config` names one."""


def build_runner(config: EngineConfig, plan: Plan) -> BuiltRunner:
    """Load `config`'s model as `plan` says (this rank's share; the workers of a tensor-parallel
    group load theirs meanwhile), size the KV cache and build the runner."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_dir = resolve_model_dir(config.model or DEMO_MODEL_DIR)
    logger.info("fastgen plan for %s on %s:\n%s", model_dir, device, plan.table())
    model_config = ModelConfig.from_file(os.path.join(model_dir, "config.json"))
    model_max = model_config.max_position_embeddings
    if config.max_length is not None and config.max_length > model_max:
        raise ValueError(f"max_length {config.max_length} exceeds the model's context of {model_max} tokens")
    threads_before = torch.get_num_threads()
    group = None
    if plan.tensor_parallel > 1:
        check_tensor_parallel(model_config, plan.tensor_parallel)
        group = TensorParallelGroup(plan.tensor_parallel, device.type, device.index or 0)
        model_config.parallel = group.parallel
    try:
        threads = 0
        if group is not None and device.type == "cpu":
            # Ranks share this machine's cores: split them so the ranks do not fight over threads.
            threads = max(1, threads_before // plan.tensor_parallel)
            logger.info("fastgen: %d CPU threads per tensor-parallel rank", threads)
            torch.set_num_threads(threads)
        wanted_len = config.max_length or model_max
        num_blocks = config.num_kv_blocks or _num_kv_blocks(plan, model_config, wanted_len)
        max_model_len = min(wanted_len, num_blocks * plan.block_size)
        # Without compilation or graphs, padding to a bucket only adds work: run exact shapes.
        static = plan.compile != "off" or plan.cuda_graphs or config.buckets is not None
        spec = RunnerSpec(plan, model_dir=model_dir, device_type=device.type, device_index=device.index or 0,
                          num_blocks=num_blocks, max_model_len=max_model_len,
                          buckets=tuple(plan.buckets) if static else (), num_threads=threads, progress=config.progress)
        if group is not None:
            group.send_spec(spec)  # workers load their shards while this rank loads its own
        loaded = load_for_spec(spec, device, model_config.parallel, config.progress)
        eos_token_ids = set(loaded.eos_token_ids)
        tokenizer = AutoTokenizer.from_pretrained(loaded.model_dir)
        if tokenizer.eos_token_id is not None and not eos_token_ids:
            eos_token_ids = {tokenizer.eos_token_id}
        runner = ModelRunner(loaded.model, loaded.config, spec, device)
        draft_runner = _build_draft_runner(plan, spec, device, config.progress)
    except BaseException:
        if group is not None:
            group.shutdown(graceful=False)  # workers may be loading or warming up
            torch.set_num_threads(threads_before)
        raise
    return BuiltRunner(runner, tokenizer, eos_token_ids, group, threads_before, draft_runner)


def _build_draft_runner(plan: Plan, target: RunnerSpec, device: torch.device, progress: bool) -> ModelRunner | None:
    """The draft model of `plan.speculative_config` (None for n-gram lookup or no speculation): the
    target's plan with the draft's own quantization (its LM head in the plan dtype), on this rank alone,
    with a KV cache of as many tokens as the target's, exact shapes (its steps are a few tokens a row)."""
    speculative = plan.speculative_config
    if speculative is None or speculative.model is None:
        return None
    draft_dir = resolve_model_dir(speculative.model)
    quantization = speculative.quantization or "none"
    draft_plan = replace(plan, quantization=quantization, offload="none", cuda_graphs=False, tensor_parallel=1,
                         replica_num=1, speculative_config=None, lm_head_quantization="none",
                         decode_layer_kernel=plan.decode_layer_kernel and quantization != "none")
    spec = RunnerSpec(draft_plan, model_dir=draft_dir, device_type=device.type, device_index=device.index or 0,
                      num_blocks=target.num_blocks, max_model_len=target.max_model_len, buckets=(),
                      num_threads=target.num_threads, progress=progress)
    loaded = load_for_spec(spec, device, progress=progress)
    return ModelRunner(loaded.model, loaded.config, spec, device)


def _num_kv_blocks(plan: Plan, model_config: ModelConfig, max_len: int) -> int:
    """KV blocks from the plan's KV memory, capped at what max_seqs full-length sequences could ever use."""
    per_block = kv_bytes_per_block(model_config, plan.block_size, plan.dtype)
    useful = plan.max_seqs * -(-max_len // plan.block_size)
    return max(1, min(plan.kv_cache_memory // per_block, useful))




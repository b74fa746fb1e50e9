"""An engine built from a given plan: plan, then runner, then `Engine(plan, runner, ...)`, as code
holding a tuned plan does; and a runner built for one plan refused by an engine given another."""

import dataclasses

import pytest
import torch

from fastgen.config import EngineConfig
from fastgen.engine import Engine
from fastgen.engine.builder import build_runner, plan_engine
from fastgen.sampling_params import SamplingParams


def test_an_engine_serves_the_plan_it_is_given(tiny_checkpoints, hf_reference):
    path = tiny_checkpoints["llama"]
    config = EngineConfig(model=path, dtype=torch.float32, compile="off", progress=False, enable_prefix_caching=False)
    # A tuned plan: steps of 8 tokens, so the 11-token prompt is split over chunks.
    plan = dataclasses.replace(plan_engine(config), token_budget=8, max_seqs=4, block_size=4)
    built = build_runner(config, plan)
    assert built.runner.spec.plan is plan and built.runner.block_size == 4
    engine = Engine(plan, built.runner, built.tokenizer, eos_token_ids=(), config=config)
    assert engine.scheduler.token_budget == 8
    prompts = [[5, 9, 33, 7, 100, 21, 8, 40, 41, 300, 12], [3, 4]]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=6, do_sample=False, ignore_eos=True)) for p in prompts]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    assert [tokens[i] for i in ids] == [t for t, _ in hf_reference(path, prompts, 6)]

    with pytest.raises(ValueError, match="built for another plan"):
        Engine(dataclasses.replace(plan, token_budget=16), built.runner, built.tokenizer, config=config)

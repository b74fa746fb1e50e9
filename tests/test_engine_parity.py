"""The whole engine vs Hugging Face greedy generation, under pressure.

32+ prompts from 1 token to several times the token budget, submitted together, with a KV cache
small enough to force preemption and a group of prompts sharing a prefix (prefix-cache hits):
every output must equal HF's greedy tokens and the logprobs must be close to HF's.
"""

import pydoc_data.topics
import pytest
import torch

from fastgen import EngineConfig, SamplingParams
from fastgen.engine import Engine
from kit import TINY_CONFIGS, run_to_end

NUM_NEW = 24
TOKEN_BUDGET = 16


def _workload(tokenizer) -> list[list[int]]:
    text = " ".join(pydoc_data.topics.topics[k] for k in ("if", "while", "for", "try"))
    ids = tokenizer.encode(text)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 64] * 3
    prompts = [ids[i * 11 : i * 11 + n] for i, n in enumerate(lengths)]
    shared = ids[400:420]
    prompts += [shared + ids[500 + 7 * i : 503 + 7 * i] for i in range(4)]
    return prompts


@pytest.mark.parametrize("context_per_budget_token", [0, 16])
@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_engine_greedy_equals_hf_with_preemption_and_prefix_hits(model_type, context_per_budget_token,
                                                                  tiny_checkpoints, hf_reference):
    """Also with prompt chunks charged for their attention (16: a chunk at offset 48 gets 3 tokens of 16)."""
    path = tiny_checkpoints[model_type]
    engine = Engine.from_config(EngineConfig(model=path, num_kv_blocks=40, block_size=4, token_budget=TOKEN_BUDGET,
                                 max_seqs=8, progress=False, context_per_budget_token=context_per_budget_token))
    engine.eos_token_ids = set()  # compare full-length outputs, whatever EOS the random model hits
    prompts = _workload(engine.tokenizer)
    assert len(prompts) >= 32 and max(map(len, prompts)) >= 3 * TOKEN_BUDGET
    params = SamplingParams(do_sample=False, max_new_tokens=NUM_NEW, logprobs=1)
    seqs = run_to_end(engine, prompts, params, max_steps=2000)
    assert sum(s.num_preemptions for s in seqs) > 0, "the KV cache was meant to force preemption"
    if engine.plan.state_slots:  # a hybrid model: no prefix caching (a cached block holds no recurrent state)
        assert not engine.block_manager.enable_prefix_caching
        assert sum(s.num_cached_prompt_tokens for s in seqs) == 0
        assert engine.block_manager.num_free_state_slots == engine.plan.state_slots == 8
    else:
        assert sum(s.num_cached_prompt_tokens for s in seqs[-4:]) > 0, "the shared prefix was meant to hit the cache"
    assert engine.block_manager.num_free_blocks == 40

    for seq, (expected, hf_logprobs) in zip(seqs, hf_reference(path, prompts, NUM_NEW)):
        assert seq.output_token_ids == expected
        assert seq.finish_reason == "length"
        ours = torch.tensor([lp[tok] for lp, tok in zip(seq.logprobs, expected)])
        theirs = hf_logprobs[torch.arange(NUM_NEW), torch.tensor(expected)]
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)

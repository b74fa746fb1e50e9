"""The draft-model proposer: greedy drafts from its own paged KV cache, kept across steps where they
still match the sequence and recomputed where the target rejected them."""

import torch

from fastgen.engine.draft_proposer import DraftModelProposer
from fastgen.engine.sequence import Sequence
from fastgen.executor.runner import ModelRunner, RunnerSpec, load_for_spec
from fastgen.sampling_params import SamplingParams
from kit import cpu_plan


def _proposer(path: str, k: int, num_blocks: int = 64) -> DraftModelProposer:
    plan = cpu_plan(path, dtype=torch.float32, block_size=4, max_seqs=8, compile="off", weight_prepack=False)
    spec = RunnerSpec(plan, model_dir=path, device_type="cpu", device_index=0, num_blocks=num_blocks,
                      max_model_len=256)
    loaded = load_for_spec(spec, torch.device("cpu"))
    return DraftModelProposer(ModelRunner(loaded.model, loaded.config, spec, torch.device("cpu")), num_blocks, 4, k)


def test_drafts_are_the_drafts_greedy_continuation(tiny_checkpoints, hf_reference):
    path = tiny_checkpoints["llama"]
    prompts = [[5, 9, 33, 7, 100, 21, 8], [40, 41], [300, 12, 12, 77, 5]]
    expected = [tokens for tokens, _ in hf_reference(path, prompts, 12)]
    proposer = _proposer(path, k=3)
    seqs = [Sequence(i, str(i), p, SamplingParams(do_sample=False), i) for i, p in enumerate(prompts)]
    assert proposer.propose(seqs, [3, 2, 3]) == [expected[0][:3], expected[1][:2], expected[2][:3]]
    # The target accepted 2 of row 0's drafts and corrected the third to a token of its own; row 1 took
    # both drafts and a bonus; row 2 rejected its first draft.
    for token in expected[0][:2] + [499]:
        seqs[0].append_token(token)
    for token in expected[1][:3]:
        seqs[1].append_token(token)
    seqs[2].append_token(498)
    drafts = proposer.propose(seqs, [3, 3, 3])
    # Row 1's continuation is HF's; the others continue text HF never saw: compare with a fresh proposer.
    assert drafts[1] == expected[1][3:6]
    fresh = _proposer(path, k=3)
    others = [Sequence(10 + i, "x", seqs[i].token_ids, SamplingParams(do_sample=False), 0) for i in (0, 2)]
    assert fresh.propose(others, [3, 3]) == [drafts[0], drafts[2]]


def test_a_full_draft_cache_proposes_nothing_instead_of_failing(tiny_checkpoints):
    proposer = _proposer(tiny_checkpoints["llama"], k=2, num_blocks=3)  # 12 slots
    small = Sequence(0, "0", [1, 2, 3], SamplingParams(do_sample=False), 0)
    large = Sequence(1, "1", list(range(5, 20)), SamplingParams(do_sample=False), 1)
    drafts = proposer.propose([small, large], [2, 2])
    assert len(drafts[0]) == 2 and drafts[1] == []
    proposer.release(set())
    assert proposer.block_manager.num_free_blocks == 3

"""The rejection sampler: greedy is exactly the argmax chain, sampling keeps the target's distribution
(chi-square on a small vocabulary with a fixed seed), seeded rows repeat themselves."""

import math

import pytest
import torch
from scipy.stats import chi2

from fastgen.engine.rejection_sampler import RejectionSampler
from fastgen.engine.step.sampling_metadata import SamplingMetadata, make_generator
from fastgen.sampling_params import SamplingParams

V = 6
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3],    # position 1
                       [0.1, 1.5, -0.5, 1.0, 0.0, 0.2],    # position 2 (after draft 1)
                       [0.0, 0.0, 1.0, 2.0, -2.0, 0.5]])   # position 3 (bonus)
CRITICAL = chi2.ppf(1 - 1e-4, V - 1)  # a correct sampler fails this with probability 1e-4


def _metadata(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[]] * n, [[]] * n, generators or [None] * n, V, "cpu")


def _chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _run(rows: int, drafts: list[int], params: SamplingParams, draft_probs=None, draft_rows=None):
    torch.manual_seed(1234)
    k = len(drafts)
    logits = LOGITS[:k + 1].repeat(rows, 1)
    md = _metadata([params] * (rows * (k + 1)))
    draft_ids = draft_rows if draft_rows is not None else [list(drafts)] * rows
    return RejectionSampler()(logits, md, draft_ids, [None] * rows, draft_probs)


@pytest.mark.parametrize("params,target", [
    (SamplingParams(top_p=1.0, temperature=1.0, max_new_tokens=4), lambda x: x.softmax(-1)),
    (SamplingParams(top_p=1.0, temperature=0.7, top_k=3, max_new_tokens=4),
     lambda x: torch.where(x >= x.topk(3).values[-1], x / 0.7, -math.inf).softmax(-1)),
])
def test_point_mass_drafts_keep_the_target_distribution(params, target):
    rows = 30000
    out = _run(rows, [0, 1], params)  # drafts: the likely token 0, then 1
    first = torch.tensor([t[0] for t in out.token_ids])
    p1 = target(LOGITS[0])
    assert _chi_square(first, p1) < CRITICAL
    # The test has power: accepting every draft (the distribution of the draft) is far off.
    assert _chi_square(first, torch.nn.functional.one_hot(torch.tensor(0), V).double() * 0.999 + 0.001 / V) > 1e3
    # Given the first draft was accepted, the next token follows the target at position 2.
    second = torch.tensor([t[1] for t in out.token_ids if t[0] == 0 and len(t) > 1])
    assert second.numel() > 5000
    assert _chi_square(second, target(LOGITS[1])) < CRITICAL
    assert all(1 <= len(t) <= 3 for t in out.token_ids)
    assert [len(t) - 1 for t in out.token_ids] == out.num_accepted


def test_sampled_drafts_with_their_probabilities_keep_the_target_distribution():
    rows = 30000
    q = torch.tensor([0.05, 0.05, 0.1, 0.5, 0.2, 0.1])  # a draft distribution far from the target's
    torch.manual_seed(99)
    drafts = torch.multinomial(q, rows, replacement=True)
    out = _run(rows, [0], SamplingParams(top_p=1.0, temperature=1.0), draft_probs=q.repeat(rows, 1),
               draft_rows=[[int(d)] for d in drafts])
    first = torch.tensor([t[0] for t in out.token_ids])
    assert _chi_square(first, LOGITS[0].softmax(-1)) < CRITICAL
    assert _chi_square(first, q) > 1e3


def test_greedy_rows_follow_the_argmax_chain_exactly():
    argmax = LOGITS.argmax(-1).tolist()  # [0, 1, 3]
    cases = {(argmax[0], argmax[1]): [argmax[0], argmax[1], argmax[2]],   # all accepted + bonus
             (argmax[0], 5): [argmax[0], argmax[1]],                      # second rejected, corrected
             (4, argmax[1]): [argmax[0]]}                                 # first rejected
    for drafts, expected in cases.items():
        out = RejectionSampler()(LOGITS.clone(), _metadata([SamplingParams(do_sample=False)] * 3), [list(drafts)], [None])
        assert out.token_ids == [expected]


def test_rows_without_drafts_sample_one_token_and_mixed_rows_line_up():
    logits = torch.cat([LOGITS[:1], LOGITS, LOGITS[:2]])
    params = [SamplingParams(do_sample=False)] * 6
    out = RejectionSampler()(logits, _metadata(params), [[], [0, 1], [9 % V]], [None] * 3)
    assert out.token_ids[0] == [0]
    assert out.token_ids[1] == [0, 1, 3]
    assert out.token_ids[2] == [0]  # draft 3 rejected at position 1: the argmax instead
    assert out.num_accepted == [0, 2, 0]


def test_seeded_rows_repeat_whatever_they_are_batched_with():
    params = SamplingParams(top_p=1.0, temperature=1.0, seed=7)

    def alone():
        gen = make_generator(7, "cpu")
        md = _metadata([params] * 3, [gen] * 3)
        return RejectionSampler()(LOGITS.clone(), md, [[0, 1]], [gen]).token_ids[0]

    def batched():
        gen = make_generator(7, "cpu")
        other = SamplingParams(top_p=1.0, temperature=1.0)
        logits = torch.cat([LOGITS[:2], LOGITS])
        md = _metadata([other] * 2 + [params] * 3, [None] * 2 + [gen] * 3)
        return RejectionSampler()(logits, md, [[2], [0, 1]], [None, gen]).token_ids[1]

    runs = [alone() for _ in range(3)] + [batched() for _ in range(3)]
    assert all(r == runs[0] for r in runs)
    # Different seeds do differ somewhere (the draws are the seed's, not fixed).
    outs = set()
    for seed in range(20):
        gen = make_generator(seed, "cpu")
        md = _metadata([SamplingParams(top_p=1.0, temperature=1.0, seed=seed)] * 3, [gen] * 3)
        outs.add(tuple(RejectionSampler()(LOGITS.clone(), md, [[0, 1]], [gen]).token_ids[0]))
    assert len(outs) > 1


def test_logprobs_describe_each_emitted_token():
    params = SamplingParams(do_sample=False, logprobs=2)
    out = RejectionSampler()(LOGITS.clone(), _metadata([params] * 3), [[0, 1]], [None])
    raw = LOGITS.log_softmax(-1)
    assert out.token_ids == [[0, 1, 3]]
    for j, token in enumerate(out.token_ids[0]):
        assert out.logprob_token_ids[0][j][0] == token
        assert out.logprobs[0][j][0] == pytest.approx(float(raw[j, token]), abs=1e-5)
        assert out.logprob_token_ids[0][j][1:] == raw[j].topk(2).indices.tolist()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="need 3"):
        RejectionSampler()(LOGITS[:2].clone(), _metadata([SamplingParams(do_sample=False)] * 2), [[0, 1]], [None])

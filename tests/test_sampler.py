"""Sampler: Hugging Face's processors as oracle, sampling statistics, seeds, greedy, logprobs."""

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fastgen.engine.step.sampler import TOP_P_CANDIDATES, Sampler, _top_p_of_candidates  # noqa: E402
from fastgen.engine.step.sampling_metadata import SamplingMetadata, make_generator  # noqa: E402
from fastgen.sampling_params import SamplingParams  # noqa: E402


def build(params, prompts=None, outputs=None, vocab_size=64, device="cpu", generators=None):
    """Metadata for `params`, with a fresh generator for every seeded row unless given."""
    num = len(params)
    if generators is None:
        generators = [make_generator(p.seed, device) for p in params]
    return SamplingMetadata.build(params, prompts or [[] for _ in range(num)],
                                  outputs or [[] for _ in range(num)], generators,
                                  vocab_size, device)


def hf_process(logits_row, params, prompt, output, greedy_only=False):
    """Hugging Face's processors (plus OpenAI's presence/frequency formula) on one row."""
    vocab_size = logits_row.numel()
    scores = logits_row.float().clone().unsqueeze(0)
    input_ids = torch.tensor([prompt + output], dtype=torch.long)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(input_ids, scores)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab_size).float()
    scores = scores - params.presence_penalty * (counts > 0) - params.frequency_penalty * counts
    if greedy_only:
        return scores[0]
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(float(params.temperature))(input_ids, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(input_ids, scores)
    return scores[0]


def random_history(gen, vocab_size, length):
    # Draw from a few tokens so that histories repeat ids (counts > 1 matter for frequency).
    pool = torch.randperm(vocab_size, generator=gen)[:8]
    return pool[torch.randint(0, 8, (length,), generator=gen)].tolist()


MIXED_PARAMS = [
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(top_k=5, top_p=1.0),
    SamplingParams(top_k=10, top_p=0.7, temperature=1.5, repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, top_p=1.0),
    SamplingParams(temperature=0.3, top_k=3, top_p=0.95),
    SamplingParams(top_p=0.5, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.2),
    SamplingParams(top_k=100, top_p=1.0, frequency_penalty=-1.0),
    SamplingParams(temperature=2.0, top_p=0.9, seed=5),
]


def test_processed_distribution_matches_hf_per_row():
    vocab_size = 64
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED_PARAMS), vocab_size, generator=gen) * 3
    prompts = [random_history(gen, vocab_size, 12) for _ in MIXED_PARAMS]
    outputs = [random_history(gen, vocab_size, 6) for _ in MIXED_PARAMS]
    md = build(MIXED_PARAMS, prompts, outputs, vocab_size)
    assert md.any_top_k and md.any_top_p and md.any_penalties and md.all_random
    ours = Sampler().process_logits(logits, md)

    num_filtered = []
    for i, params in enumerate(MIXED_PARAMS):
        expected = hf_process(logits[i], params, prompts[i], outputs[i])
        kept = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(ours[i]), kept), f"row {i}: different surviving tokens"
        torch.testing.assert_close(ours[i].softmax(-1), expected.softmax(-1),
                                   atol=1e-6, rtol=1e-5, msg=f"row {i}")
        num_filtered.append(int((~kept).sum()))
    # The warpers really cut in the rows that ask for it, so the comparison is not vacuous.
    assert all(num_filtered[i] > 0 for i in (0, 1, 2, 4, 5, 7))
    assert num_filtered[3] == num_filtered[6] == 0


def test_top_k_keeps_ties_like_hf():
    logits = torch.tensor([[3.0, 1.0, 3.0, 3.0, 0.5, 2.0]])
    params = SamplingParams(top_k=2, top_p=1.0)
    ours = Sampler().process_logits(logits, build([params], vocab_size=6))
    expected = hf_process(logits[0], params, [], [])
    assert torch.equal(torch.isfinite(ours[0]), torch.isfinite(expected))
    assert int(torch.isfinite(ours[0]).sum()) == 3


def test_top_p_boundary_like_hf():
    # Exact fp32 probabilities 1/4: the cumulative sum hits 1 - top_p = 0.5 exactly, and HF
    # removes a token whose cumulative probability equals the bound.
    logits = torch.zeros(1, 4)
    params = SamplingParams(top_p=0.5)
    ours = Sampler().process_logits(logits, build([params], vocab_size=4))
    expected = hf_process(logits[0], params, [], [])
    assert int(torch.isfinite(ours[0]).sum()) == int(torch.isfinite(expected).sum()) == 2


def test_top_p_from_the_candidates_equals_the_full_sort_and_hf():
    """A vocabulary wider than TOP_P_CANDIDATES: peaked rows (the candidates hold the nucleus) take the
    top-k path, and a batch with one flat row (they do not) falls back to the full sort; both keep
    exactly HF's tokens, and a top_p = 1 row beside cutting ones is untouched."""
    vocab_size = 4096
    gen = torch.Generator().manual_seed(2)
    peaked = torch.randn(4, vocab_size, generator=gen) * 4
    flat = torch.randn(1, vocab_size, generator=gen) * 0.1
    params = [SamplingParams(top_p=p) for p in (0.9, 0.5, 0.99, 1.0)]
    md = build(params, vocab_size=vocab_size)
    assert _top_p_of_candidates(peaked.clone(), md.top_p) is not None
    mixed = [SamplingParams(top_p=0.9)] * 4 + [SamplingParams(top_p=0.9)]
    assert _top_p_of_candidates(torch.cat([peaked, flat]), build(mixed, vocab_size=vocab_size).top_p) is None
    for logits, batch in ((peaked, params), (torch.cat([peaked, flat]), mixed)):
        ours = Sampler().process_logits(logits.clone(), build(batch, vocab_size=vocab_size))
        for i, p in enumerate(batch):
            expected = hf_process(logits[i], p, [], [])
            assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(expected)), f"row {i}"
            torch.testing.assert_close(ours[i].softmax(-1), expected.softmax(-1), atol=1e-6, rtol=1e-5)
    kept = torch.isfinite(Sampler().process_logits(peaked.clone(), md)).sum(-1).tolist()
    assert 1 < kept[1] < kept[0] < kept[2] < TOP_P_CANDIDATES and kept[3] == vocab_size


def test_tiny_top_p_keeps_the_most_likely_token():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 32, generator=gen)
    # 1 - 1e-9 rounds to 1.0 in fp32: every cumulative sum is <= it, yet one token must stay.
    md = build([SamplingParams(top_p=1e-9)] * 4, vocab_size=32)
    processed = Sampler().process_logits(logits, md)
    assert torch.isfinite(processed).sum(-1).tolist() == [1] * 4
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))


def _empirical(logits_row, params, draws):
    md = build([params] * draws, vocab_size=logits_row.numel())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        tokens = Sampler()(logits_row.expand(draws, -1).contiguous(), md).sampled_token_ids
    return torch.bincount(tokens, minlength=logits_row.numel()).double() / draws


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=2.0, top_p=0.6),
    SamplingParams(temperature=0.5, top_k=4, top_p=0.8),
])
def test_sample_frequencies_follow_processed_softmax(params):
    logits = torch.tensor([2.0, 1.6, 1.2, 0.8, 0.4, 0.0, -0.5, -1.0])
    draws = 20_000
    expected = hf_process(logits, params, [], []).softmax(-1).double()
    # The same warpers with temperature applied last (MII's order) give another distribution.
    scores = logits.unsqueeze(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    scores = TopPLogitsWarper(params.top_p)(ids, scores)
    wrong_order = TemperatureLogitsWarper(params.temperature)(ids, scores)[0].softmax(-1).double()
    assert (expected - wrong_order).abs().max() > 0.1

    empirical = _empirical(logits, params, draws)
    # Binomial std <= sqrt(0.25 / 20000) = 0.0035: 0.02 is over 5 sigma.
    assert (empirical - expected).abs().max() < 0.02
    assert (empirical - wrong_order).abs().max() > 0.08
    assert torch.equal(empirical > 0, expected > 0)


def _run_seeded(target_logits, position, others, seed, default_seed):
    """Sample `len(target_logits)` steps for a row with `seed` at `position` among `others`."""
    target = SamplingParams(seed=seed, top_p=1.0)
    params = list(others)
    params.insert(position, target)
    generators = [make_generator(p.seed, "cpu") for p in params]
    vocab_size = target_logits.shape[1]
    noise_gen = torch.Generator().manual_seed(default_seed)
    tokens = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(default_seed)
        for step_logits in target_logits:
            logits = torch.randn(len(params), vocab_size, generator=noise_gen)
            logits[position] = step_logits
            md = build(params, vocab_size=vocab_size, generators=generators)
            tokens.append(int(Sampler()(logits, md).sampled_token_ids[position]))
    return tokens


def test_seeded_row_is_reproducible_in_any_batch():
    steps, vocab_size = 8, 100
    target_logits = torch.randn(steps, vocab_size, generator=torch.Generator().manual_seed(3))
    alone = _run_seeded(target_logits, 0, [], seed=42, default_seed=0)
    compositions = [
        (3, [SamplingParams(), SamplingParams(seed=9), SamplingParams(do_sample=False)]),
        (0, [SamplingParams(top_k=3)] * 3),
        (2, [SamplingParams(seed=42), SamplingParams(temperature=0.0), SamplingParams(),
             SamplingParams(repetition_penalty=1.5, seed=1)]),
    ]
    for default_seed, (position, others) in enumerate(compositions, start=1):
        assert _run_seeded(target_logits, position, others, 42, default_seed) == alone
    assert len(set(alone)) > 1
    assert _run_seeded(target_logits, 0, [], seed=43, default_seed=0) != alone


def test_unseeded_rows_follow_the_default_generator():
    logits = torch.zeros(64, 50)
    md = build([SamplingParams(top_p=1.0)] * 64, vocab_size=50)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        first = Sampler()(logits, md).sampled_token_ids
        torch.manual_seed(7)
        again = Sampler()(logits, md).sampled_token_ids
        second = Sampler()(logits, md).sampled_token_ids
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 40, generator=gen, dtype=torch.bfloat16)
    greedy = [SamplingParams(do_sample=False), SamplingParams(temperature=0.0, top_k=2),
              SamplingParams(do_sample=False, top_p=0.1, temperature=3.0)]
    md = build(greedy * 2, vocab_size=40)
    assert md.all_greedy and md.temperature is None
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.float().argmax(-1))

    mixed = [SamplingParams(do_sample=False), SamplingParams(temperature=5.0, top_p=1.0)] * 3
    md = build(mixed, vocab_size=40)
    assert not md.all_greedy and not md.all_random and md.greedy_mask is not None
    tokens = Sampler()(logits, md).sampled_token_ids
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert torch.equal(tokens[0::2], logits.float().argmax(-1)[0::2])


def test_penalties_move_the_argmax_like_hf():
    vocab_size = 10
    logits = torch.full((5, vocab_size), -1.0)
    logits[:, 3], logits[:, 7] = 5.0, 4.0
    logits[4] = -3.0
    logits[4, 3], logits[4, 7], logits[4, 5] = -1.0, -1.2, -1.1
    rows = [
        # 3 seen in the prompt: 5 / 1.5 < 4, so 7 wins.
        (SamplingParams(do_sample=False, repetition_penalty=1.5), [3, 1], []),
        # Presence and frequency count generated tokens: 5 - 0.5 - 2 * 0.4 < 4.
        (SamplingParams(do_sample=False, presence_penalty=0.5, frequency_penalty=0.4), [], [3, 3]),
        # They ignore prompt tokens: 3 keeps the argmax.
        (SamplingParams(do_sample=False, presence_penalty=2.0), [3, 3, 3], []),
        # A reward (< 1) lifts a seen token: 7 / 0.5 > 5.
        (SamplingParams(do_sample=False, repetition_penalty=0.5), [7], []),
        # Negative logits are multiplied: -1 * 1.3 < -1.1, so 5 wins.
        (SamplingParams(do_sample=False, repetition_penalty=1.3), [], [3]),
    ]
    params, prompts, outputs = map(list, zip(*rows))
    tokens = Sampler()(logits, build(params, prompts, outputs, vocab_size)).sampled_token_ids
    expected = [int(hf_process(logits[i], *row, greedy_only=True).argmax()) for i, row in
                enumerate(rows)]
    assert tokens.tolist() == expected == [7, 7, 3, 7, 5]


def test_greedy_with_penalties_matches_hf_on_random_logits():
    vocab_size, rows = 48, 12
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab_size, generator=gen)
    params = [SamplingParams(do_sample=False, repetition_penalty=1.0 + 0.3 * (i % 4),
                             presence_penalty=0.5 * (i % 3), frequency_penalty=-0.3 * (i % 2))
              for i in range(rows)]
    prompts = [random_history(gen, vocab_size, 10) for _ in range(rows)]
    outputs = [random_history(gen, vocab_size, 5) for _ in range(rows)]
    # Put each row's raw argmax in its history so that penalties have something to move.
    for i, top in enumerate(logits.argmax(-1).tolist()):
        (prompts if i % 2 else outputs)[i].append(top)
    tokens = Sampler()(logits, build(params, prompts, outputs, vocab_size)).sampled_token_ids
    expected = [int(hf_process(logits[i], params[i], prompts[i], outputs[i], greedy_only=True)
                    .argmax()) for i in range(rows)]
    assert tokens.tolist() == expected
    assert tokens.tolist() != logits.argmax(-1).tolist()


def test_logprobs_are_raw_log_softmax():
    vocab_size = 30
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(4, vocab_size, generator=gen) * 2).to(torch.bfloat16)
    params = [SamplingParams(logprobs=0, temperature=0.5, repetition_penalty=1.4),
              SamplingParams(logprobs=3, top_k=2),
              SamplingParams(do_sample=False, presence_penalty=1.0),
              SamplingParams(logprobs=1, seed=11)]
    md = build(params, [[1, 2]] * 4, [[2, 4]] * 4, vocab_size)
    assert md.max_num_logprobs == 3
    out = Sampler()(logits, md)
    assert out.logprobs.shape == out.logprob_token_ids.shape == (4, 4)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    raw = torch.log_softmax(logits.float(), -1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    chosen = raw.gather(1, out.sampled_token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs[:, 0], chosen)
    top_values, top_ids = raw.topk(3, dim=-1)
    torch.testing.assert_close(out.logprobs[:, 1:], top_values)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(raw.gather(1, out.logprob_token_ids), out.logprobs)


def test_no_logprobs_when_nobody_asks():
    md = build([SamplingParams(), SamplingParams(do_sample=False)], vocab_size=8)
    assert md.max_num_logprobs is None
    out = Sampler()(torch.randn(2, 8), md)
    assert out.logprobs is None and out.logprob_token_ids is None
    md = build([SamplingParams(logprobs=0)] * 2, vocab_size=8)
    only_chosen = Sampler()(torch.randn(2, 8), md)
    assert only_chosen.logprobs.shape == (2, 1)


def test_common_cases_skip_work():
    md = build([SamplingParams(top_p=1.0)] * 3, vocab_size=16)
    assert md.all_random and not md.any_top_k and not md.any_top_p and not md.any_penalties
    assert md.top_k is None and md.top_p is None and md.output_token_counts is None
    assert md.prompt_token_mask is None and md.greedy_mask is None
    md = build([SamplingParams(presence_penalty=0.1, top_k=50)], [[1]], [[2, 2]], vocab_size=16)
    assert md.any_penalties and md.repetition_penalty is None and md.prompt_token_mask is None
    assert not md.any_top_k  # top_k >= vocab_size is off
    assert md.output_token_counts[0, 2] == 2


def test_token_counts_and_out_of_vocab_ids():
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(),
              SamplingParams(frequency_penalty=0.5)]
    md = build(params, [[0, 5, 5, 99], [1], [3]], [[2, 2, 2], [4], [6, 6, 7, 120]], 8)
    assert md.output_token_counts.shape == md.prompt_token_mask.shape == (3, 8)
    assert md.output_token_counts[0].tolist() == [0, 0, 3, 0, 0, 0, 0, 0]
    assert md.output_token_counts[1].sum() == 0  # no penalty: history not read
    assert md.output_token_counts[2].tolist() == [0, 0, 0, 0, 0, 0, 2, 1]
    assert md.prompt_token_mask[0].nonzero().flatten().tolist() == [0, 5]
    assert not md.prompt_token_mask[1:].any()


def test_input_logits_untouched():
    logits = torch.randn(3, 20)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=3, repetition_penalty=2.0),
              SamplingParams(do_sample=False, presence_penalty=1.0), SamplingParams()]
    Sampler()(logits, build(params, [[1, 2]] * 3, [[3]] * 3, 20))
    assert torch.equal(logits, before)


def test_bad_inputs_raise():
    md = build([SamplingParams()] * 2, vocab_size=8)
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.randn(3, 8), md)
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.randn(2, 9), md)
    with pytest.raises(TypeError, match="float"):
        Sampler()(torch.zeros(2, 8, dtype=torch.long), md)
    with pytest.raises(ValueError, match="seed=3 but no generator"):
        build([SamplingParams(seed=3)], vocab_size=8, generators=[None])
    with pytest.raises(ValueError, match="output_token_ids has 1 rows"):
        SamplingMetadata.build([SamplingParams()] * 2, [[], []], [[]], [None, None], 8, "cpu")
    with pytest.raises(ValueError, match="empty batch"):
        SamplingMetadata.build([], [], [], [], 8, "cpu")
    with pytest.raises(ValueError, match="vocab_size"):
        build([SamplingParams()], vocab_size=0)
    with pytest.raises(TypeError, match=r"params\[0\]"):
        SamplingMetadata.build([{"top_p": 1.0}], [[]], [[]], [None], 8, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_never_syncs():
    vocab_size = 1000
    params = MIXED_PARAMS + [SamplingParams(do_sample=False, logprobs=5), SamplingParams(seed=1)]
    gen = torch.Generator().manual_seed(0)
    prompts = [random_history(gen, vocab_size, 30) for _ in params]
    outputs = [random_history(gen, vocab_size, 10) for _ in params]
    md = build(params, prompts, outputs, vocab_size, device="cuda")
    logits = torch.randn(len(params), vocab_size, device="cuda", dtype=torch.bfloat16)
    sampler = Sampler()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_md = build(params, prompts, outputs, vocab_size)
    cpu_processed = sampler.process_logits(logits.cpu(), cpu_md)
    processed = sampler.process_logits(logits, md).cpu()
    assert torch.equal(torch.isfinite(processed), torch.isfinite(cpu_processed))
    assert out.sampled_token_ids.device.type == "cuda"
    assert torch.isfinite(cpu_processed.gather(1, out.sampled_token_ids.cpu()[:, None])).all()


def test_min_p_and_logit_bias_match_hf():
    from transformers import MinPLogitsWarper, SequenceBiasLogitsProcessor

    vocab_size = 64
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab_size, generator=gen) * 3
    params = [SamplingParams(min_p=0.1, top_p=1.0, temperature=0.8),
              SamplingParams(min_p=0.3, top_k=20, top_p=0.95, logit_bias={3: 5.0, 9: -100.0}),
              SamplingParams(top_p=1.0, logit_bias={"7": 2.5}),
              SamplingParams(do_sample=False, logit_bias={11: 50.0}, min_p=0.5)]
    md = build(params, vocab_size=vocab_size)
    ours = Sampler().process_logits(logits, md)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for i, p in enumerate(params):
        scores = logits[i].clone().unsqueeze(0)
        if p.logit_bias:
            scores = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})(ids, scores)
        if not p.greedy:
            scores = hf_process(scores[0], dataclasses.replace(p, logit_bias=None, min_p=0.0), [], []).unsqueeze(0)
            if p.min_p:
                scores = MinPLogitsWarper(p.min_p)(ids, scores)
        assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(scores[0])), f"row {i}"
        torch.testing.assert_close(ours[i].softmax(-1), scores[0].softmax(-1), atol=1e-6, rtol=1e-5)
    assert int((~torch.isfinite(ours[0])).sum()) > 0  # min_p really cut something
    # Greedy rows see the bias (argmax moves to the biased token) but not min_p.
    out = Sampler()(logits, md)
    assert out.sampled_token_ids[3].item() == 11


def test_allowed_and_banned_tokens_mask_every_row():
    vocab_size = 32
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(do_sample=False, allowed_token_ids=[4, 5]), SamplingParams(do_sample=False),
              SamplingParams(top_p=1.0, allowed_token_ids=[6])]
    banned = [[5], [int(logits[1].argmax())], []]
    md = SamplingMetadata.build(params, [[]] * 3, [[]] * 3, [None] * 3, vocab_size, "cpu", banned)
    out = Sampler()(logits, md).sampled_token_ids.tolist()
    assert out[0] == 4 and out[2] == 6
    assert out[1] == int(logits[1].clone().index_fill_(0, torch.tensor(banned[1]), float("-inf")).argmax())


def test_first_argmax_matches_argmax_on_ties_and_nan():
    from fastgen.engine.step.sampler import _first_argmax
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (33, 5000), generator=generator).float()  # many tied maxima per row
    scores[3, 17] = float("nan")
    scores[5, [9, 4000]] = float("nan")
    assert torch.equal(_first_argmax(scores), scores.argmax(dim=-1))
    assert _first_argmax(scores)[5] == 9


def test_greedy_rows_of_bf16_logits_take_the_fp32_argmax():
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
    metadata = build([SamplingParams(do_sample=False)] * 7, vocab_size=300)
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))

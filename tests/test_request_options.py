"""Request options beyond MII's, against Hugging Face on the same checkpoint: prompt logprobs, bad
words, logit bias, allowed token ids, prompt truncation, stop strings kept, priorities."""

import pytest
import torch
import transformers

import fastgen
from fastgen import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
           [30, 31],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 99]]


@pytest.fixture(scope="module")
def hf(tiny_checkpoints):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"]).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def pipe(tiny_checkpoints):
    # A small budget so that prompts are split over several steps; prefix caching on.
    pipe = fastgen.pipeline(tiny_checkpoints["llama"], num_kv_blocks=64, block_size=4, token_budget=8,
                            max_seqs=4, progress=False)
    pipe.engine.eos_token_ids = set()
    yield pipe
    pipe.destroy()


def hf_generate(hf, prompt, n, **kw):
    ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kw)
    return ids[0, len(prompt):].tolist()


def test_prompt_logprobs_match_hf_through_chunks_and_the_prefix_cache(pipe, hf):
    out = pipe(PROMPTS, do_sample=False, max_new_tokens=2, prompt_logprobs=3)
    # The same prompts again: their blocks are cached now, yet every logprob must come back.
    again = pipe(PROMPTS[:1], do_sample=False, max_new_tokens=1, prompt_logprobs=0)
    # Its blocks are cached (a plain request hits them), but it recomputed its whole prompt.
    assert again[0].num_cached_tokens == 0
    assert pipe(PROMPTS[:1], do_sample=False, max_new_tokens=1)[0].num_cached_tokens > 0
    for prompt, response in zip(PROMPTS, out):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        got = response.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for position in range(1, len(prompt)):
            entry = got[position]
            token = prompt[position]
            assert abs(entry[token] - expected[position - 1, token].item()) < 1e-4
            top = expected[position - 1].topk(3)
            assert set(top.indices.tolist()) <= set(entry)
            for token_id, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[token_id] - lp) < 1e-4
    assert [list(e) if e else e for e in again[0].prompt_logprobs] == \
        [[PROMPTS[0][p]] if p else None for p in range(len(PROMPTS[0]))]
    # As close as each is to HF's: alone, its last 3-token chunk takes the few-row linear (`gemv_weights`),
    # which sums in another order than the packed kernel its batched run took.
    assert all(abs(again[0].prompt_logprobs[p][PROMPTS[0][p]] - out[0].prompt_logprobs[p][PROMPTS[0][p]]) < 1e-4
               for p in range(1, len(PROMPTS[0])))


def test_prompt_logprobs_stream_on_the_first_delta(pipe):
    deltas = list(pipe.stream([PROMPTS[2]], do_sample=False, max_new_tokens=3, prompt_logprobs=1, n=2))
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].index == 0 and len(carrying[0].prompt_logprobs) == len(PROMPTS[2])


def test_bad_words_match_hf_bad_words_ids(pipe, hf):
    prompt = PROMPTS[2]
    plain = pipe([prompt], do_sample=False, max_new_tokens=12)[0].token_ids
    assert len(set(plain)) > 3
    # A word made of two tokens of the plain output (one whose text tokenizes back to them), so
    # banning it must change the output there.
    for k in range(len(plain) - 1):
        word = pipe.tokenizer.decode(plain[k:k + 2])
        prepared = pipe.engine.prepare(prompt, SamplingParams(bad_words=[word]))
        if tuple(plain[k:k + 2]) in prepared.bad_words_ids:
            break
    else:
        pytest.fail(f"no two-token word of {plain} tokenizes back to its tokens")
    got = pipe([prompt], do_sample=False, max_new_tokens=12, bad_words=[word])[0].token_ids
    expected = hf_generate(hf, prompt, 12, bad_words_ids=[list(ids) for ids in prepared.bad_words_ids])
    assert got == expected and got != plain


def test_logit_bias_and_allowed_token_ids_match_hf(pipe, hf):
    prompt = PROMPTS[1]
    bias = {17: 6.0, 3: -100.0, 25: 3.0}
    got = pipe([prompt], do_sample=False, max_new_tokens=10, logit_bias={str(k): v for k, v in bias.items()})
    expected = hf_generate(hf, prompt, 10, sequence_bias={(k,): v for k, v in bias.items()})
    assert got[0].token_ids == expected
    allowed = [8, 9, 10, 11, 40]
    got = pipe([prompt], do_sample=False, max_new_tokens=10, allowed_token_ids=allowed)[0].token_ids
    vocab = hf.config.vocab_size
    banned = [[t] for t in range(vocab) if t not in allowed]
    assert got == hf_generate(hf, prompt, 10, bad_words_ids=banned)
    assert set(got) <= set(allowed) and len(set(got)) > 1
    with pytest.raises(ValueError, match="logit_bias contains 100000"):
        pipe([prompt], logit_bias={100000: 1.0})
    with pytest.raises(ValueError, match="allowed_token_ids contains"):
        pipe([prompt], allowed_token_ids=[10**7])


def test_truncate_prompt_tokens_keeps_the_tail(pipe, hf):
    out = pipe([PROMPTS[0]], do_sample=False, max_new_tokens=6, truncate_prompt_tokens=5)[0]
    assert out.prompt_length == 5
    assert out.token_ids == hf_generate(hf, PROMPTS[0][-5:], 6)


def test_include_stop_str_in_output(pipe):
    text = pipe(["hello world"], do_sample=False, max_new_tokens=24, ignore_eos=True)[0].generated_text
    assert len(text) > 4
    stop = text[2:4]
    cut = pipe(["hello world"], do_sample=False, max_new_tokens=24, stop=[stop])[0]
    kept = pipe(["hello world"], do_sample=False, max_new_tokens=24, stop=[stop], include_stop_str_in_output=True)[0]
    assert cut.generated_text == text[: text.index(stop)]
    assert kept.generated_text == text[: text.index(stop)] + stop
    assert cut.finish_reason == kept.finish_reason == "stop"


def test_priority_orders_admission(tiny_checkpoints):
    engine = fastgen.pipeline(tiny_checkpoints["llama"], num_kv_blocks=64, block_size=4, token_budget=4,
                              max_seqs=1, progress=False).engine
    try:
        engine.eos_token_ids = set()
        ids = {}
        for name, priority in (("late", 5), ("urgent", -1), ("normal", 0), ("urgent2", -1)):
            ids[engine.add_request([5, 6, 7], SamplingParams(do_sample=False, max_new_tokens=2, priority=priority))] = name
        order = []
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.finish_reason != "none":
                    order.append(ids[delta.request_id])
        assert order == ["urgent", "urgent2", "normal", "late"]
    finally:
        engine.shutdown()

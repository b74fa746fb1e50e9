"""The public notebook API, `fastgen.pipeline(model)(prompts, **gen)`, against Hugging Face.

One small pipeline (block_size 8, token_budget 32) serves most tests; HF `generate` on the same
tiny fp32 checkpoint is the oracle for greedy tokens, EOS / min_new_tokens handling and logprobs.
"""

from __future__ import annotations

import itertools
import warnings

import pydoc_data.topics
import pytest
import torch
import transformers

import fastgen
from fastgen.mii_options import MIICompatibilityWarning, mii_options
from fastgen.sampling_params import SamplingParams
from fastgen.serving.deploy.deployment import SERVE_OPTIONS

SMALL = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
PROMPTS = ["The quick brown fox", "def f(x):", "Hello world, this is a longer prompt with more tokens"]
TEXT = "".join(pydoc_data.topics.topics.values())


@pytest.fixture(scope="module")
def path(tiny_checkpoints) -> str:
    """The tiny Llama checkpoint (fp32, byte-level BPE tokenizer)."""
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def pipe(path):
    """One small pipeline shared by the module (building one takes about a second)."""
    with fastgen.pipeline(path, **SMALL) as p:
        yield p


@pytest.fixture(scope="module")
def hf(path):
    """The Hugging Face reference model of the same checkpoint."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS only where a test asks for it
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(hf, ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    """HF greedy continuation of `ids` (EOS kept, as the engine keeps it in `token_ids`)."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


def encode(pipe, text: str) -> list[int]:
    """Prompt ids as the engine encodes a text prompt."""
    return pipe.tokenizer.encode(text)


def assert_idle(pipe) -> None:
    """No request left behind and every KV block free."""
    engine = pipe.engine
    assert not engine.has_unfinished() and not engine.scheduler.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def stop_string_at_boundary(tok, ids: list[int], start: int = 3) -> tuple[str, int]:
    """A 4-char substring of decode(ids) spanning the end of token i-1 and the start of token i (its
    first occurrence, without U+FFFD); returns it and the number of tokens that complete it."""
    text = tok.decode(ids)
    for i in range(start, len(ids) - 2):
        b = len(tok.decode(ids[:i]))
        s = text[b - 2 : b + 2]
        if len(s) == 4 and "\ufffd" not in s and text.find(s) == b - 2 and text[:b] == tok.decode(ids[:i]):
            return s, next(n for n in range(1, len(ids) + 1) if s in tok.decode(ids[:n]))
    raise AssertionError(f"no usable stop string in {text!r}")


def test_call_forms_return_one_response_per_prompt_matching_hf_greedy(pipe, hf):
    tok = pipe.tokenizer
    (r,) = pipe(PROMPTS[0], max_new_tokens=8, do_sample=False)
    ids = encode(pipe, PROMPTS[0])
    assert isinstance(r, fastgen.Response)
    assert r.token_ids == hf_greedy(hf, ids, 8)
    assert (r.prompt_length, r.generated_length, r.finish_reason) == (len(ids), 8, "length")
    assert str(r) == r.generated_text == tok.decode(r.token_ids)
    assert len(set(r.token_ids)) > 3, "flat logits would make this parity test meaningless"

    by_text = pipe(PROMPTS, max_new_tokens=6, do_sample=False)
    by_ids = pipe([encode(pipe, p) for p in PROMPTS], max_new_tokens=6, do_sample=False)
    assert len(by_text) == len(by_ids) == len(PROMPTS)
    for i, (a, b, prompt) in enumerate(zip(by_text, by_ids, PROMPTS)):
        expected = hf_greedy(hf, encode(pipe, prompt), 6)
        assert a.token_ids == b.token_ids == expected
        assert a.prompt_index == b.prompt_index == i
        assert a.generated_text == b.generated_text == tok.decode(expected)
        assert a.prompt_length == len(encode(pipe, prompt))
    assert_idle(pipe)


def test_max_new_tokens_and_max_length(pipe):
    ids = encode(pipe, PROMPTS[2])
    (r,) = pipe([ids], max_new_tokens=3, do_sample=False)
    assert (r.generated_length, len(r.token_ids), r.finish_reason) == (3, 3, "length")
    (r,) = pipe([ids], max_length=len(ids) + 5, do_sample=False)
    assert (r.generated_length, r.finish_reason) == (5, "length")
    (r,) = pipe([ids], max_length=len(ids) + 5, max_new_tokens=50, do_sample=False)
    assert r.prompt_length + r.generated_length == len(ids) + 5
    for max_length in (len(ids), len(ids) - 1):
        with pytest.raises(ValueError, match="max_length"):
            pipe([ids], max_length=max_length)
    assert_idle(pipe)


def test_eos_stops_and_ignore_eos_keeps_stop_strings(pipe, hf):
    # The random model never picks the real EOS (id 2) greedily, so the test makes a token that
    # greedy does produce the engine's EOS for its duration, and HF's eos_token_id the same one.
    tok = pipe.tokenizer
    ids = encode(pipe, PROMPTS[0])
    free = hf_greedy(hf, ids, 16)
    k = next(i for i in range(2, 16) if free[i] not in free[:i])
    eos = free[k]
    saved = pipe.engine.eos_token_ids
    pipe.engine.eos_token_ids = {eos}
    try:
        (r,) = pipe([ids], max_new_tokens=16, do_sample=False)
        assert r.token_ids == hf_greedy(hf, ids, 16, eos_token_id=eos) == free[: k + 1]
        assert r.finish_reason == "stop"
        assert r.generated_text == tok.decode(free[:k]), "the EOS token's text is not output"

        (r,) = pipe([ids], max_new_tokens=16, do_sample=False, ignore_eos=True)
        assert (r.token_ids, r.finish_reason) == (free, "length")

        # MII's fault: ignore_eos also switched `stop` off. Here it only ignores EOS.
        stop, n = stop_string_at_boundary(tok, free, start=k + 2)
        (r,) = pipe([ids], max_new_tokens=16, do_sample=False, ignore_eos=True, stop=stop)
        assert (r.token_ids, r.finish_reason) == (free[:n], "stop")
        assert r.generated_text == tok.decode(free).split(stop)[0]
        # ...and a stop string does not switch EOS off (MII's other fault).
        (r,) = pipe([ids], max_new_tokens=16, do_sample=False, stop=stop)
        assert (r.token_ids, r.finish_reason) == (free[: k + 1], "stop")
    finally:
        pipe.engine.eos_token_ids = saved


def test_stop_token_ids_stop_and_are_kept_in_ids(pipe, hf):
    ids = encode(pipe, PROMPTS[1])
    free = hf_greedy(hf, ids, 12)
    k = next(i for i in range(1, 12) if free[i] not in free[:i])
    (r,) = pipe([ids], max_new_tokens=12, do_sample=False, stop_token_ids=[free[k]])
    assert (r.token_ids, r.finish_reason) == (free[: k + 1], "stop")
    assert r.generated_text == pipe.tokenizer.decode(free[:k])


def test_min_new_tokens_counts_generated_tokens_only(pipe, hf):
    ids = encode(pipe, PROMPTS[2])
    first = hf_greedy(hf, ids, 1)[0]
    # HF's min_new_tokens masks its eos_token_id(s) the same way: the oracle for the whole run.
    masked = hf_greedy(hf, ids, 12, min_new_tokens=3, eos_token_id=first)
    assert masked[0] != first, "masking the greedy first token must change it"
    # A second stop token that the masked run produces after min_new_tokens ends it there.
    j = next(j for j in range(3, 12) if masked[j] not in masked[:j])
    stops = [first, masked[j]]
    (r,) = pipe([ids], max_new_tokens=12, min_new_tokens=3, do_sample=False, stop_token_ids=stops)
    assert r.token_ids == hf_greedy(hf, ids, 12, min_new_tokens=3, eos_token_id=stops) == masked[: j + 1]
    # (MII compared min_new_tokens with prompt + generated: the first token would have stopped it.)
    assert (r.finish_reason, r.generated_length) == ("stop", j + 1)
    # Logprobs still describe the model, not the masked distribution: the masked first token keeps
    # its (highest) logprob instead of -inf.
    (r,) = pipe([ids], max_new_tokens=3, min_new_tokens=3, do_sample=False, stop_token_ids=stops, logprobs=1)
    first_step = r.logprobs[0]
    assert first in first_step and first_step[first] > float("-inf")
    assert first_step[first] >= max(first_step.values())


def test_stop_strings_cut_output_earliest_wins_and_stream_never_leaks(pipe, hf):
    tok = pipe.tokenizer
    ids = encode(pipe, PROMPTS[0])
    free = hf_greedy(hf, ids, 20)
    text = tok.decode(free)
    early, n_early = stop_string_at_boundary(tok, free)
    late, _ = stop_string_at_boundary(tok, free, start=n_early + 2)
    for stop in (early, [late, early], [late, "\x00never\x00", early]):
        (r,) = pipe([ids], max_new_tokens=20, do_sample=False, stop=stop)
        assert r.generated_text == text[: text.find(early)]
        assert (r.token_ids, r.finish_reason) == (free[:n_early], "stop")
    (r,) = pipe([ids], max_new_tokens=20, do_sample=False, stop=late)
    assert r.generated_text == text[: text.find(late)] and early in r.generated_text

    deltas = list(pipe.stream([ids], max_new_tokens=20, do_sample=False, stop=[late, early]))
    assert "".join(d.generated_text for d in deltas) == text[: text.find(early)]
    assert [d.finish_reason for d in deltas] == ["none"] * (len(deltas) - 1) + ["stop"]
    assert_idle(pipe)


def test_return_full_text_prefixes_the_prompt(pipe):
    prompt = PROMPTS[1]
    (plain,) = pipe(prompt, max_new_tokens=5, do_sample=False)
    (full,) = pipe(prompt, max_new_tokens=5, do_sample=False, return_full_text=True)
    assert full.generated_text == prompt + plain.generated_text
    assert full.token_ids == plain.token_ids


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(pipe):
    gen = dict(do_sample=True, top_p=1.0, max_new_tokens=12)
    prompt = PROMPTS[2]
    (alone,) = pipe(prompt, seed=5, **gen)
    (again,) = pipe(prompt, seed=5, **gen)
    assert again.token_ids == alone.token_ids
    (other_seed,) = pipe(prompt, seed=6, **gen)
    assert other_seed.token_ids != alone.token_ids

    # Five unseeded sampled requests of other lengths share every step with the seeded one.
    engine = pipe.engine
    for i in range(5):
        engine.add_request(encode(pipe, TEXT[100 * i : 100 * i + 20 + 15 * i]), SamplingParams(**gen))
    (mixed,) = pipe(prompt, seed=5, **gen)
    while engine.has_unfinished():
        engine.step()
    assert mixed.token_ids == alone.token_ids and mixed.generated_text == alone.generated_text
    assert_idle(pipe)


def test_n_choices_index_sharing_and_greedy_duplicates(pipe, hf):
    long_prompt = encode(pipe, TEXT[5000:5100])[:21]  # longer than two 8-token blocks
    rs = pipe([long_prompt], n=3, do_sample=True, seed=1, top_p=1.0, max_new_tokens=8)
    assert [(r.prompt_index, r.index) for r in rs] == [(0, 0), (0, 1), (0, 2)]
    assert len({tuple(r.token_ids) for r in rs}) == 3
    assert rs[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens == 16 for r in rs[1:]), "children share the prompt's full blocks"
    assert all(r.prompt_length == 21 and r.generated_length == 8 for r in rs)

    rs = pipe([long_prompt[:9], PROMPTS[0]], n=2, do_sample=False, max_new_tokens=6)
    assert [(r.prompt_index, r.index) for r in rs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for pair, ids in ((rs[:2], long_prompt[:9]), (rs[2:], encode(pipe, PROMPTS[0]))):
        assert pair[0].token_ids == pair[1].token_ids == hf_greedy(hf, ids, 6)
        assert pair[0].generated_text == pair[1].generated_text
    assert_idle(pipe)


def test_logprobs_match_hf_log_softmax(pipe, hf):
    ids = encode(pipe, PROMPTS[2])
    (r,) = pipe([ids], max_new_tokens=6, do_sample=False, logprobs=2)
    assert len(r.logprobs) == 6
    with torch.no_grad():
        logits = hf(torch.tensor([ids + r.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    for step, (token, row) in enumerate(zip(r.token_ids, r.logprobs)):
        top = ref[step].topk(2)
        assert token in row and set(top.indices.tolist()) <= set(row)
        assert len(row) == 2, "greedy: the chosen token is the top-1"
        for token_id, value in row.items():
            assert value == pytest.approx(ref[step, token_id].item(), abs=1e-4)


def test_stream_interleaves_prompts_and_matches_call(pipe):
    gen = dict(max_new_tokens=10, do_sample=False)
    prompts = PROMPTS + [TEXT[:300]]
    full = {(r.prompt_index, r.index): r for r in pipe(prompts, **gen)}
    deltas = list(pipe.stream(prompts, **gen))
    order = [d.prompt_index for d in deltas]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), "prompts are streamed together"
    for key, r in full.items():
        mine = [d for d in deltas if (d.prompt_index, d.index) == key]
        assert "".join(d.generated_text for d in mine) == r.generated_text
        assert [t for d in mine for t in d.token_ids] == r.token_ids
        assert [d.finish_reason for d in mine] == ["none"] * (len(mine) - 1) + [r.finish_reason]
        assert mine[-1].generated_length == r.generated_length
    assert_idle(pipe)


def test_interleaved_streams_and_calls_lose_no_text(pipe):
    gen = dict(max_new_tokens=10, do_sample=False)
    ref = [r.generated_text for r in pipe(PROMPTS[:2], **gen)]
    a, b = pipe.stream(PROMPTS[0], **gen), pipe.stream(PROMPTS[1], **gen)
    texts = ["", ""]
    for step, pair in enumerate(itertools.zip_longest(a, b)):
        for i, delta in enumerate(pair):
            texts[i] += delta.generated_text if delta is not None else ""
        if step == 1:  # a call while both streams are open steps the engine for them too
            assert pipe(PROMPTS[2], **gen)[0].generated_length == 10
    assert texts == ref
    assert_idle(pipe)


def test_closing_a_stream_early_aborts_its_requests(pipe):
    stream = pipe.stream(PROMPTS + [TEXT[:200]], max_new_tokens=40, n=2, do_sample=True)
    got = [next(stream) for _ in range(5)]
    assert all(d.finish_reason == "none" for d in got)
    assert pipe.engine.has_unfinished()
    stream.close()
    assert_idle(pipe)
    (r,) = pipe(PROMPTS[0], max_new_tokens=4, do_sample=False)
    assert r.generated_length == 4


BAD_CALLS = [
    (PROMPTS, dict(max_new_token=5), TypeError, "max_new_token"),
    (PROMPTS, dict(top_p=2), ValueError, "top_p"),
    (PROMPTS, dict(temperature=-1), ValueError, "temperature"),
    (PROMPTS, dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (PROMPTS, dict(n=0), ValueError, "n must be"),
    ("", {}, ValueError, "empty"),
    (["ok", ""], {}, ValueError, "empty"),
    ([], {}, ValueError, "empty"),
    ([[5, 6, 10**6]], {}, ValueError, "1000000.*vocabulary"),
    ([[5, -1]], {}, ValueError, "-1"),
    ([1, 2, 3], {}, TypeError, "flat list"),
    (42, {}, TypeError, "got int"),
    ({"prompt": "x"}, {}, TypeError, "got dict"),
    (["ok", None], {}, TypeError, "got NoneType"),
    (PROMPTS, dict(stop_token_ids=[10**6]), ValueError, "stop_token_ids"),
    (PROMPTS, dict(stream="yes"), TypeError, "stream must be a bool"),
]


@pytest.mark.parametrize("prompts, gen, exc, match", BAD_CALLS)
def test_bad_requests_raise_clearly_and_leave_pipeline_usable(pipe, hf, prompts, gen, exc, match):
    with pytest.raises(exc, match=match):
        pipe(prompts, **gen)
    assert_idle(pipe)
    ids = encode(pipe, PROMPTS[1])
    (r,) = pipe([ids], max_new_tokens=4, do_sample=False)
    assert r.token_ids == hf_greedy(hf, ids, 4)


def test_batch_with_one_bad_prompt_queues_nothing(pipe):
    ok = encode(pipe, PROMPTS[0])
    too_long = encode(pipe, TEXT[:400])
    with pytest.raises(ValueError, match="max_length"):
        pipe([ok, ok, too_long], max_length=len(ok) + 4)
    assert_idle(pipe)
    assert not pipe.engine.scheduler.waiting and not pipe.engine.scheduler.running


def test_bad_engine_options(path):
    with pytest.raises(TypeError, match="num_kv_block"):
        fastgen.pipeline(path, num_kv_block=64, progress=False)
    with pytest.raises(ValueError, match="max_seqs"):
        fastgen.pipeline(path, **{**SMALL, "max_seqs": 64})


def test_destroy_and_context_manager(path):
    with fastgen.pipeline(path, **SMALL) as p:
        (r,) = p("Hi", max_new_tokens=2)
        assert r.generated_length == 2
    with pytest.raises(RuntimeError, match="destroyed"):
        p("Hi", max_new_tokens=2)
    p.destroy()  # a second destroy is harmless
    q = fastgen.pipeline(path, **SMALL)
    q.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        list(q.stream("Hi"))


def test_long_prompt_and_many_mixed_prompts_match_hf(pipe, hf):
    long_ids = encode(pipe, TEXT[1000:2000])[:150]  # ~5 token budgets: split across steps
    batch = [long_ids] + [encode(pipe, TEXT[3000 + 37 * i : 3000 + 37 * i + 5 + 11 * i]) for i in range(7)]
    rs = pipe(batch, max_new_tokens=8, do_sample=False)
    assert [r.prompt_length for r in rs] == [len(ids) for ids in batch]
    for r, ids in zip(rs, batch):
        assert r.token_ids == hf_greedy(hf, ids, 8)
    assert_idle(pipe)


def test_kv_cache_pressure_preempts_and_still_matches_hf(path, hf):
    # 12 blocks of 8 tokens hold 96 tokens; the batch needs ~250 at its end, so sequences wait
    # for blocks and the newest are preempted and recomputed.
    with fastgen.pipeline(path, **{**SMALL, "num_kv_blocks": 12}) as small:
        batch = [encode(small, TEXT[200 * i : 200 * i + 120])[: 25 + 3 * i] for i in range(5)]
        for r in small(batch, max_new_tokens=20, do_sample=False):
            assert r.token_ids == hf_greedy(hf, batch[r.prompt_index], 20)
        rs = small(batch[:2], n=3, max_new_tokens=20, do_sample=False)
        assert [r.token_ids for r in rs] == [hf_greedy(hf, batch[i], 20) for i in (0, 0, 0, 1, 1, 1)]
        assert_idle(small)


def test_mii_style_code_runs(path):
    import fastgen as mii

    # MII's way: options in model_config (DeepSpeed's names nested), all_rank_output, stream.
    pipe = mii.pipeline(path, {"max_length": 200, "inference_engine_config": {"state_manager": {
        "max_ragged_batch_size": 32, "max_ragged_sequence_count": 8, "memory_config": {"mode": "allocate", "size": 64}}}},
        all_rank_output=True, block_size=8, progress=False)
    try:
        plan = pipe.engine.plan
        assert (plan.token_budget, plan.max_seqs, pipe.engine.config.num_kv_blocks, pipe.engine.config.max_length) == \
            (32, 8, 64, 200)
        assert pipe.engine.config.offline  # a pipeline plans for its batch's throughput
        response = pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=5, do_sample=False)
        assert len(response) == 2
        for r in response:
            assert isinstance(r.generated_text, str) and r.generated_length == 5
            assert r.finish_reason == "length" and str(r) == repr(r) == r.generated_text
            assert r.to_msg_dict() == {"generated_text": r.generated_text, "prompt_length": r.prompt_length,
                                       "generated_length": 5, "finish_reason": "length"}
            assert r.fields()["token_ids"] == r.token_ids and set(r.fields()) >= set(r.to_msg_dict())
        assert repr(response) == f"[{response[0].generated_text}, {response[1].generated_text}]"  # print(responses)
        # MII's client sends stream=True by itself; a call still answers in full, as does stream().
        again = pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=5, do_sample=False, stream=True)
        assert [(r.token_ids, r.finish_reason) for r in again] == [(r.token_ids, r.finish_reason) for r in response]
        assert "".join(d.generated_text for d in pipe.stream("DeepSpeed is", max_new_tokens=5, do_sample=False,
                                                             stream=True)) == response[0].generated_text
    finally:
        pipe.destroy()


def _options(*args, serving=False, **kwargs):
    model, options = mii_options(*args, kwargs, serving=serving, native=SERVE_OPTIONS if serving else ())
    return model, options


@pytest.mark.parametrize("args, kwargs, want", [
    (("m", None, None), dict(tensor_parallel=2, max_length=64), ("m", dict(tensor_parallel=2, max_length=64))),
    (("", {"model_name_or_path": "m", "max_ragged_batch_size": 64}, None), {}, ("m", dict(token_budget=64))),
    ((None, {"inference_engine_config": {"tp": {"tp_size": 2}, "manager": {"max_ragged_sequence_count": 4,
                                                                          "max_context": 128}}}, None), {},
     (None, dict(tensor_parallel=2, max_seqs=4, max_length=128))),
    # MII's defaults of every refused or no-effect field are accepted quietly.
    (("m", {"tokenizer": "m", "task": "text-generation", "quantization_mode": None, "replica_configs": [],
            "device_map": "auto", "torch_dist_port": 29500, "zmq_port_number": 25555, "sync_debug": False,
            "profile_model_time": False, "inference_engine_config": {"quantization": {"quantization_mode": None},
                                                                     "state_manager": {"offload": False,
                                                                                       "max_tracked_sequences": 2048,
                                                                                       "memory_config": {}}}}, None),
     {}, ("m", {})),
    # fastgen's own options may sit in model_config too; the same value twice is no conflict.
    (("m", {"dtype": "float32", "token_budget": 64}, None), dict(max_ragged_batch_size=64),
     ("m", dict(dtype="float32", token_budget=64))),
    (("m", None, None), dict(device_map=3), ("m", dict(tensor_parallel=1, device="cuda:3"))),
    (("m", None, None), dict(device_map=[2, 3]), ("m", dict(tensor_parallel=2, device="cuda:2"))),
    (("m", None, None), dict(device_map={"localhost": [[4, 5]]}, tensor_parallel=2),
     ("m", dict(tensor_parallel=2, device="cuda:4"))),
])
def test_mii_options_for_a_pipeline(args, kwargs, want):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MIICompatibilityWarning)
        assert _options(*args, **kwargs) == want


@pytest.mark.parametrize("args, kwargs, exc, match", [
    (("m", {"model_name_or_path": "n"}, None), {}, ValueError,
     r"model: model_name_or_path = 'm' contradicts model_config\['model_name_or_path'\] = 'n'"),
    (("m", {"tensor_parallel": 2}, None), dict(tensor_parallel=1), ValueError,
     r"tensor_parallel = 1 contradicts model_config\['tensor_parallel'\] = 2"),
    (("m", {"max_length": 64, "inference_engine_config": {"state_manager": {"max_context": 32}}}, None), {},
     ValueError, r"max_length: .*max_length.* = 64 contradicts .*\['max_context'\] = 32"),
    (("m", None, None), dict(token_budget=32, max_ragged_batch_size=64), ValueError, "token_budget = 32 contradicts"),
    (("m", {"bogus": 1}, None), {}, TypeError, r"model_config\['bogus'\]: unknown field 'bogus'"),
    (("m", {"inference_engine_config": {"state_manager": {"bogus": 1}}}, None), {}, TypeError,
     r"\['state_manager'\]: unknown field 'bogus'"),
    (("m", "not a dict", None), {}, TypeError, "model_config must be a dict"),
    (("m", None, None), dict(mii_config={}), TypeError, "mii_config is an MII serve"),
    (("m", None, None), dict(deployment_name="x"), TypeError, "deployment_name is an MII serve"),
    (("m", {"port_number": 1}, None), {}, TypeError, r"model_config\['port_number'\]: port_number is an MII serve"),
    (("m", None, None), dict(hostfile="/etc/hosts"), TypeError, "hostfile is an MII serve"),
    (("m", None, None), dict(quantization_mode="wf6af16"), ValueError, "quantization_mode='wf6af16': fastgen has no"),
    (("m", None, None), dict(tokenizer="other"), ValueError, "tokenizer='other': fastgen loads the tokenizer"),
    (("m", None, None), dict(task="text2image"), ValueError, "text-generation only"),
    (("m", None, None), dict(replica_configs=[{"hostname": "h"}]), ValueError, "replica_configs: fastgen places"),
    (("m", None, None), dict(device_map=[[0], [1]]), ValueError, "a pipeline is one engine"),
    (("m", None, None), dict(device_map=[1, 3]), ValueError, r"GPUs \[1, 3\] are not consecutive"),
    (("m", None, None), dict(device_map={"gpu-box-7": [[0]]}), ValueError, "'gpu-box-7': fastgen deploys on this"),
    (("m", None, None), dict(device_map=[2, 3], tensor_parallel=4), ValueError, "tensor_parallel = 4 contradicts"),
    (("m", None, None), dict(device_map="balanced"), ValueError, "device_map must be 'auto'"),
    (("m", None, None), dict(max_ragged_batch_size=0), ValueError, "max_ragged_batch_size must be a positive int"),
    (("m", None, None), dict(inference_engine_config={"state_manager": {"offload": True}}), ValueError, "offloading"),
    (("m", None, None), dict(inference_engine_config={"state_manager": {"memory_config": {"size": 10**8}}}),
     ValueError, "mode 'reserve' with size=100000000 .* kv_cache_memory"),
])
def test_mii_options_refused_with_the_field_named(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        _options(*args, **kwargs)


def test_mii_options_without_effect_warn_and_serve_options():
    with pytest.warns(MIICompatibilityWarning, match=r"model_config\['torch_dist_port'\]=1234 has no effect"):
        assert _options("m", {"torch_dist_port": 1234}, None) == ("m", {})
    with pytest.warns(MIICompatibilityWarning, match="sync_debug=True has no effect.*CUDA_LAUNCH_BLOCKING"):
        _options("m", None, None, sync_debug=True)
    with pytest.warns(MIICompatibilityWarning, match=r"mii_config\['restful_processes'\]=4 has no effect"):
        _options("m", None, {"restful_processes": 4}, serving=True)
    mii_config = {"deployment_name": "d", "port_number": 50051, "enable_restful_api": True, "deployment_type": "local",
                  "model_config": {"model_name_or_path": "m", "device_map": {"localhost": [[0, 1], [2, 3]]}}}
    assert _options(None, None, mii_config, serving=True, max_seqs=4) == (
        "m", dict(max_seqs=4, deployment_name="d", port_number=50051, enable_restful_api=True, tensor_parallel=2,
                  replica_num=2))
    with pytest.raises(ValueError, match="model_config and mii_config\\['model_config'\\] differ"):
        _options("m", {"max_length": 8}, {"model_config": {"max_length": 9}}, serving=True)
    with pytest.raises(ValueError, match="deployment_type'\\]='aml'.*Azure ML"):
        _options("m", None, {"deployment_type": "aml"}, serving=True)
    with pytest.raises(ValueError, match="cannot place them as \\[\\[1\\], \\[0\\]\\]"):
        _options("m", None, None, serving=True, device_map=[[1], [0]])
    with pytest.raises(TypeError, match="all_rank_output is a pipeline"):
        _options("m", None, None, serving=True, all_rank_output=False)


def test_all_rank_output_under_torchrun(path, monkeypatch):
    with pytest.raises(TypeError, match="all_rank_output must be a bool"):
        fastgen.pipeline(path, all_rank_output="yes", **SMALL)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="all_rank_output=True: under torchrun only rank 0 generates"):
        fastgen.pipeline(path, all_rank_output=True, **SMALL)

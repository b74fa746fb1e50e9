"""The official `openai` client, unmodified, against the real server (uvicorn on 127.0.0.1) over
the OpenAI and vLLM parameter surface: echo with logprobs (prompt logprobs equal Hugging Face's
log_softmax of the fp32 checkpoint), vLLM's extra parameters (through `extra_body`, checked against
the pipeline with the same settings), streaming usage, chat-template options, ignored and strict
unknown fields, the tokenizer routes and vLLM's metric names."""

import httpx
import openai
import pytest
import torch
import transformers
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from rest_server import serve

import fastgen
from fastgen.serving.http.app import create_app

MODEL = "tiny-llama"
ENGINE = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
P1 = "The quick brown fox"
P2 = "def main():"
TOL = 1e-4


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    with serve(tiny_checkpoints["llama"], MODEL, ENGINE) as s:
        s.engine.eos_token_ids = set()  # completions run to max_tokens: exact token counts
        yield s
        s.wait_idle()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def pipe(tiny_checkpoints):
    p = fastgen.pipeline(tiny_checkpoints["llama"], **ENGINE)
    p.engine.eos_token_ids = set()
    yield p
    p.destroy()


@pytest.fixture(scope="module")
def hf_logprobs(tiny_checkpoints):
    """`reference(ids)` -> HF's fp32 log_softmax [len(ids), vocab] at every position of `ids`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()

    def reference(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return reference


def _gen(pipe, prompt, **gen):
    return pipe([prompt], **gen)[0]


def test_echo_logprobs_cover_the_prompt_and_equal_hf(served, client, hf_logprobs):
    ids = served.tokenizer.encode(P1)
    reference = hf_logprobs(ids)
    for prompt in (P1, [ids]):  # text, and lm-eval's tokenized form
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                         temperature=0, seed=1234)
        choice = resp.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and choice.text.startswith(P1)
        assert lp.tokens[:-1] == [served.tokenizer.decode([i]) for i in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, len(ids)):
            assert lp.token_logprobs[pos] == pytest.approx(reference[pos - 1, ids[pos]].item(), abs=TOL)
            top = lp.top_logprobs[pos]
            assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(reference[pos - 1].max().item(), abs=TOL)
        assert lp.token_logprobs[-1] == pytest.approx(reference[-1].max().item(), abs=TOL)  # greedy: the argmax
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), 1)

    # Older lm-eval: max_tokens 0 scores the prompt and generates nothing.
    bare = client.completions.create(model=MODEL, prompt=P1, max_tokens=0, echo=True, logprobs=0)
    assert bare.choices[0].text == P1 and len(bare.choices[0].logprobs.tokens) == len(ids)
    assert bare.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=TOL)
    assert bare.usage.completion_tokens == 0


def test_streamed_echo_logprobs_equal_the_whole_response(served, client):
    whole = client.completions.create(model=MODEL, prompt=[P1, P2], n=2, max_tokens=4, echo=True, logprobs=2,
                                      temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=[P1, P2], n=2, max_tokens=4, echo=True, logprobs=2,
                                            temperature=0, stream=True))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert sum((c.logprobs.tokens for c in mine), []) == choice.logprobs.tokens
        streamed = sum((c.logprobs.token_logprobs for c in mine), [])
        assert streamed[0] is None and streamed[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=TOL)
        assert mine[0].logprobs.text_offset[0] == 0 and mine[-1].finish_reason == "length"


def test_vllm_prompt_logprobs_on_completions_and_chat(served, client, hf_logprobs):
    ids = served.tokenizer.encode(P2)
    reference = hf_logprobs(ids)
    resp = client.completions.create(model=MODEL, prompt=P2, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 3})
    entries = resp.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for pos, entry in enumerate(entries[1:], start=1):
        own = entry[str(ids[pos])]
        assert own["logprob"] == pytest.approx(reference[pos - 1, ids[pos]].item(), abs=TOL)
        assert own["decoded_token"] == served.tokenizer.decode([ids[pos]])
        ranked = sorted((e for e in entry.values() if e["rank"] is not None), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2, 3]
        assert [e["logprob"] for e in ranked] == pytest.approx(reference[pos - 1].topk(3).values.tolist(), abs=TOL)

    messages = [{"role": "user", "content": P1}]
    tok = served.tokenizer
    chat_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    chat_entries = chat.model_extra["prompt_logprobs"]
    chat_reference = hf_logprobs(chat_ids)
    assert len(chat_entries) == len(chat_ids) and chat_entries[0] is None
    assert [e[str(t)]["logprob"] for e, t in zip(chat_entries[1:], chat_ids[1:])] == pytest.approx(
        [chat_reference[i, t].item() for i, t in enumerate(chat_ids[1:])], abs=TOL)
    with pytest.raises(openai.BadRequestError) as info:  # as vLLM: not with stream
        client.completions.create(model=MODEL, prompt=P2, stream=True, extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"


GREEDY = dict(temperature=0)
SURFACE = [  # (extra_body, the pipeline's keywords for the same request)
    ({"min_p": 0.2, "seed": 3}, dict(min_p=0.2, seed=3, temperature=1.0, top_p=1.0)),
    ({"top_k": 5, "seed": 4}, dict(top_k=5, seed=4, temperature=1.0, top_p=1.0)),
    ({"repetition_penalty": 1.5, **GREEDY}, dict(repetition_penalty=1.5, do_sample=False)),
    ({"logit_bias": {"300": 100}, **GREEDY}, dict(logit_bias={300: 100.0}, do_sample=False)),
    ({"allowed_token_ids": [70, 71], **GREEDY}, dict(allowed_token_ids=[70, 71], do_sample=False)),
    ({"priority": -3, **GREEDY}, dict(priority=-3, do_sample=False)),
    ({"ignore_eos": True, "spaces_between_special_tokens": False, **GREEDY}, dict(ignore_eos=True, do_sample=False)),
]


@pytest.mark.parametrize("extra, gen", SURFACE, ids=[next(iter(e)) for e, _ in SURFACE])
def test_vllm_sampling_parameters_give_the_pipelines_output(client, pipe, extra, gen):
    extra = dict(extra)
    temperature = extra.pop("temperature", None)
    resp = client.completions.create(model=MODEL, prompt=P1, max_tokens=10, logprobs=0, temperature=temperature,
                                     extra_body={**extra, "return_tokens_as_token_ids": True})
    expected = _gen(pipe, P1, max_new_tokens=10, **gen)
    assert resp.choices[0].text == expected.generated_text
    assert resp.choices[0].logprobs.tokens == [f"token_id:{t}" for t in expected.token_ids]
    if "allowed_token_ids" in extra:
        assert set(expected.token_ids) <= {70, 71}
    if "logit_bias" in extra:
        assert expected.token_ids == [300] * 10


def test_stop_truncation_min_tokens_bad_words_and_special_tokens(served, client, pipe):
    full = _gen(pipe, P1, max_new_tokens=12, do_sample=False)
    stop = full.generated_text[4:7]
    kept = client.completions.create(model=MODEL, prompt=P1, max_tokens=12, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full.generated_text[:full.generated_text.find(stop)] + stop
    ids = served.tokenizer.encode(P1 + " " + P2)
    cut = client.completions.create(model=MODEL, prompt=P1 + " " + P2, max_tokens=5, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 4})
    assert cut.usage.prompt_tokens == 4
    assert cut.choices[0].text == _gen(pipe, ids[-4:], max_new_tokens=5, do_sample=False).generated_text
    first = full.token_ids[0]
    stopped = client.completions.create(model=MODEL, prompt=P1, max_tokens=12, temperature=0,
                                        extra_body={"stop_token_ids": [first]})
    assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("stop", 1)
    held = client.completions.create(model=MODEL, prompt=P1, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [first], "min_tokens": 3})
    expected = _gen(pipe, P1, max_new_tokens=12, do_sample=False, stop_token_ids=[first], min_new_tokens=3)
    assert held.choices[0].text == expected.generated_text and held.usage.completion_tokens >= 3
    tok = served.tokenizer

    def one_token_word(token_id):  # vLLM bans a word's tokens, and its " word" form when as many tokens
        word = tok.decode([token_id]).strip()
        forms = (tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False))
        return word.isalpha() and len(forms[0]) == 1 and [token_id] in forms

    word = tok.decode([next(t for t in full.token_ids if one_token_word(t))]).strip()
    banned = client.completions.create(model=MODEL, prompt=P1, max_tokens=12, temperature=0,
                                       extra_body={"bad_words": [word]})
    assert banned.choices[0].text == _gen(pipe, P1, max_new_tokens=12, do_sample=False,
                                          bad_words=[word]).generated_text != full.generated_text
    eos = {"logit_bias": {"2": 100}}  # every token is </s>
    shown = client.completions.create(model=MODEL, prompt=P1, max_tokens=3, temperature=0,
                                      extra_body={**eos, "skip_special_tokens": False})
    hidden = client.completions.create(model=MODEL, prompt=P1, max_tokens=3, temperature=0, extra_body=eos)
    assert (shown.choices[0].text, hidden.choices[0].text) == ("</s></s></s>", "")


def test_request_id_names_the_response(client):
    resp = client.completions.create(model=MODEL, prompt=P1, max_tokens=1, extra_body={"request_id": "job-7"})
    assert resp.id == "cmpl-job-7"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": P1}], max_tokens=1,
                                          extra_body={"request_id": "job-8"})
    assert chat.id == "chatcmpl-job-8"


def test_continuous_usage_in_every_chunk(served, client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    prompt_tokens = len(served.tokenizer.encode(P1))
    chunks = list(client.completions.create(model=MODEL, prompt=P1, max_tokens=5, temperature=0, stream=True,
                                            stream_options=options))
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1].choices == []
    assert chunks[-1].usage.total_tokens == prompt_tokens + 5
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": P1}], max_tokens=4,
                                               stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 4
    plain = list(client.completions.create(model=MODEL, prompt=P1, max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}))
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]


def test_chat_template_options_and_echo(served, client, pipe):
    tok = served.tokenizer
    messages = [{"role": "user", "content": P1}, {"role": "assistant", "content": "It jumps"}]
    ids = tok.encode(tok.apply_chat_template(messages, continue_final_message=True, tokenize=False),
                     add_special_tokens=False)
    expected = _gen(pipe, ids, max_new_tokens=6, do_sample=False).generated_text
    body = {"add_generation_prompt": False, "continue_final_message": True, "echo": True,
            "chat_template_kwargs": {"unused_variable": 1}}
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=body)
    assert resp.choices[0].message.content == "It jumps" + expected and resp.usage.prompt_tokens == len(ids)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, extra_body=body))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "It jumps" + expected
    plain = tok.apply_chat_template(messages[:1], add_generation_prompt=False, tokenize=False)
    bare = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=3, temperature=0,
                                          extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens == len(tok.encode(plain, add_special_tokens=False))
    assert bare.choices[0].message.role == "user"  # vLLM: the reply continues the final message's role


INVALID = [  # (route, extra_body, param named in the 400)
    ("completions", {"min_p": 2}, "min_p"), ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"3": 500}}, "logit_bias"), ("completions", {"allowed_token_ids": []},
                                                                 "allowed_token_ids"),
    ("completions", {"bad_words": [""]}, "bad_words"), ("completions", {"truncate_prompt_tokens": 0},
                                                        "truncate_prompt_tokens"),
    ("completions", {"use_beam_search": True}, "use_beam_search"), ("completions", {"priority": "high"}, "priority"),
    ("completions", {"request_id": 5}, "request_id"), ("completions", {"skip_special_tokens": "no"},
                                                       "skip_special_tokens"),
    ("completions", {"guided_json": 5}, "guided_json"),
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": "yes", "include_usage": True}},
     "stream_options"),
    ("chat", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"), ("chat", {"echo": 1}, "echo"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
]


@pytest.mark.parametrize("route, extra, param", INVALID, ids=[p for _, _, p in INVALID])
def test_known_but_invalid_values_are_a_400_naming_the_field(client, route, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        if route == "completions":
            client.completions.create(model=MODEL, prompt=P1, max_tokens=2, extra_body=extra)
        else:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": P1}], max_tokens=2,
                                           extra_body=extra)
    assert info.value.body["param"] == param and param in info.value.body["message"], info.value.body


def test_unknown_fields_are_ignored_with_a_header_or_refused_when_strict(served, client, caplog):
    extra = {"cache_salt": "abc", "kv_transfer_params": {"x": 1}}
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=P1, max_tokens=2, extra_body=extra)
    assert raw.headers["X-Ignored-Fields"] == "cache_salt,kv_transfer_params"
    assert raw.parse().usage.completion_tokens == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "fastgen" and "ignored" in r.getMessage()]
    assert len(warnings) == 1 and "cache_salt, kv_transfer_params" in warnings[0]
    known = client.completions.with_raw_response.create(model=MODEL, prompt=P1, max_tokens=2)
    assert "X-Ignored-Fields" not in known.headers
    strict_app = create_app(served.app.state.gateway.backend, "strict", served.tokenizer, MODEL, strict_params=True)
    with TestClient(strict_app) as http, openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                                                       http_client=http, max_retries=0) as strict:
        with pytest.raises(openai.BadRequestError) as info:
            strict.completions.create(model=MODEL, prompt=P1, max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == "cache_salt"
        assert strict.completions.create(model=MODEL, prompt=P1, max_tokens=2).usage.completion_tokens == 2


def test_tokenize_detokenize_version_ping(served):
    tok = served.tokenizer
    with httpx.Client(base_url=served.url, timeout=30) as http:
        body = http.post("/tokenize", json={"model": MODEL, "prompt": P1, "return_token_strs": True}).json()
        assert body == {"count": len(tok.encode(P1)), "max_model_len": served.engine.max_model_len,
                        "tokens": tok.encode(P1), "token_strs": tok.convert_ids_to_tokens(tok.encode(P1))}
        messages = [{"role": "user", "content": P2}]
        chat = http.post("/tokenize", json={"messages": messages}).json()
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False) and chat["token_strs"] is None
        assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": P1}
        bad = http.post("/detokenize", json={"tokens": [1, 10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert http.post("/tokenize", json={"prompt": 5}).json()["error"]["param"] == "prompt"
        assert http.post("/tokenize", json={"model": "other", "prompt": P1}).status_code == 404
        assert http.get("/version").json() == {"version": fastgen.__version__}
        assert http.get("/ping").status_code == http.post("/ping").status_code == 200


def _samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_vllm_metric_names_move_with_requests(served, client):
    url = served.url + "/metrics"
    label = (("model_name", MODEL),)
    before = _samples(httpx.get(url).text)
    client.completions.create(model=MODEL, prompt=P1, max_tokens=4, temperature=0)
    after = _samples(httpx.get(url).text)

    def moved(name, labels=label):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("vllm:prompt_tokens_total") == len(served.tokenizer.encode(P1))
    assert moved("vllm:generation_tokens_total") == 4
    assert moved("vllm:request_success_total", (("finished_reason", "length"), *label)) == 1
    for histogram, count in (("vllm:time_to_first_token_seconds", 1), ("vllm:inter_token_latency_seconds", 3),
                             ("vllm:time_per_output_token_seconds", 1), ("vllm:e2e_request_latency_seconds", 1)):
        assert moved(histogram + "_count") == count, histogram
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc"):
        assert after[(gauge, label)] == 0.0  # idle: nothing running, waiting, or holding KV blocks

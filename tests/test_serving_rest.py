"""The REST gateway over a real uvicorn server on 127.0.0.1: the official `openai` client against
the OpenAI-compatible API, MII's `/mii/{deployment}` route, auth, errors, admission, metrics,
and cancellation when a client goes away."""

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import fastgen
from fastgen import EngineConfig
from fastgen.engine import Engine
from fastgen.engine import EngineLoop
from fastgen.serving.metrics import ServingMetrics
from fastgen.serving.http.app import create_app

NUM_BLOCKS = 64
ENGINE = dict(num_kv_blocks=NUM_BLOCKS, block_size=8, token_budget=32, max_seqs=8, progress=False)
KEY = "test-key"
MODEL = "tiny-llama"
DEPLOYMENT = "tiny-deployment"
LIMIT = 4
P1 = "The quick brown fox"
P2 = "def main():"
MII_FIELDS = {"generated_text", "prompt_length", "generated_length", "finish_reason"}


class Served:
    """One running server and what the tests inspect behind it."""

    def __init__(self, url, engine, app, terminated):
        self.url, self.engine, self.app, self.terminated = url, engine, app, terminated
        self.tokenizer = engine.tokenizer


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    engine = Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], **ENGINE))
    engine.eos_token_ids = set()  # every completion runs to max_tokens: exact, predictable counts
    loop = EngineLoop(engine)
    terminated = threading.Event()
    app = create_app(loop, DEPLOYMENT, engine.tokenizer, MODEL, api_key=KEY, max_model_len=engine.max_model_len,
                     metrics=ServingMetrics(engine_stats=engine.stats), on_terminate=terminated.set,
                     max_pending_requests=LIMIT)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, app, terminated)
    server.should_exit = True
    thread.join(15)
    assert not thread.is_alive()
    loop.shutdown()
    sock.close()


@pytest.fixture(scope="module")
def pipe(tiny_checkpoints):
    p = fastgen.pipeline(tiny_checkpoints["llama"], **ENGINE)
    p.engine.eos_token_ids = set()
    yield p
    p.destroy()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def _greedy(pipe, prompt, n):
    return pipe([prompt], do_sample=False, max_new_tokens=n)[0].generated_text


def _metric(http, name, **labels):
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def _wait_until(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _idle(served):
    return (not served.engine.requests and served.app.state.gateway.pending == 0
            and served.engine.block_manager.num_free_blocks == NUM_BLOCKS)


def test_models_and_open_health_routes(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(served.url + "/healthz").text == "ok"
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}


def test_completions_equal_pipeline_greedy_with_exact_usage(served, client, pipe):
    resp = client.completions.create(model=MODEL, prompt=[P1, P2], max_tokens=8, temperature=0)
    assert resp.id.startswith("cmpl-") and resp.model == MODEL and resp.created > 0
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [_greedy(pipe, P1, 8), _greedy(pipe, P2, 8)]
    assert all(c.finish_reason == "length" for c in resp.choices)
    prompt_tokens = len(served.tokenizer.encode(P1)) + len(served.tokenizer.encode(P2))
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        prompt_tokens, 16, prompt_tokens + 16)
    ids = served.tokenizer.encode(P2)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == resp.choices[1].text
    echoed = client.completions.create(model=MODEL, prompt=P1, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == P1 + _greedy(pipe, P1, 3)


def test_chat_uses_the_chat_template(served, client, pipe):
    tok = served.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    expected = pipe([ids], do_sample=False, max_new_tokens=8)[0].generated_text
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    choice = resp.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", expected, "length")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), 8)
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, messages[1]]
    again = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=8, temperature=0)
    assert again.choices[0].message.content == expected


def test_streaming_completions_and_chat(served, client, pipe):
    stream = client.completions.create(model=MODEL, prompt=[P1, P2], n=2, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, finishes, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes[c.index] = finishes.get(c.index, []) + [c.finish_reason]
    greedy = [_greedy(pipe, P1, 6), _greedy(pipe, P2, 6)]
    assert texts == {0: greedy[0], 1: greedy[0], 2: greedy[1], 3: greedy[1]}  # index = prompt * n + choice
    assert finishes == {i: ["length"] for i in range(4)}
    prompt_tokens = len(served.tokenizer.encode(P1)) + len(served.tokenizer.encode(P2))
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 4 * 6)

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": P1}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": P1}], max_tokens=6,
                                           temperature=0)
    assert content == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_stop_lists_n_and_seeds(served, client, pipe):
    full = _greedy(pipe, P1, 16)
    assert len(full) >= 9
    stop = full[6:9]
    resp = client.completions.create(model=MODEL, prompt=P1, max_tokens=16, temperature=0,
                                     stop=["@@never-generated@@", stop])
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (full[: full.find(stop)], "stop")
    single = client.completions.create(model=MODEL, prompt=P1, max_tokens=16, temperature=0, stop=stop)
    assert single.choices[0].text == resp.choices[0].text

    many = client.completions.create(model=MODEL, prompt=P1, n=3, max_tokens=6, temperature=1.0, seed=5)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert (many.usage.prompt_tokens, many.usage.completion_tokens) == (len(served.tokenizer.encode(P1)), 18)
    again = client.completions.create(model=MODEL, prompt=P1, n=3, max_tokens=6, temperature=1.0, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    # OpenAI's defaults (temperature 1, top_p 1), not MII's top_p 0.9; a seed gives the pipeline's sample.
    sampled = client.completions.create(model=MODEL, prompt=P2, max_tokens=24, seed=9).choices[0].text
    assert sampled == pipe([P2], temperature=1.0, top_p=1.0, seed=9, max_new_tokens=24)[0].generated_text
    chat = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": P2}], max_tokens=8,
                                           temperature=0.8, top_p=0.95, seed=11).choices[0].message.content
            for _ in range(2)]
    assert chat[0] == chat[1]


def test_logprobs(served, client):
    resp = client.completions.create(model=MODEL, prompt=P1, max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": P1}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)


def test_mii_route_body_and_response_shape(served, http, pipe):
    resp = http.post(f"/mii/{DEPLOYMENT}", json={"prompts": [P1, P2], "max_new_tokens": 6, "do_sample": False})
    assert resp.status_code == 200
    body = resp.json()
    assert [set(r) for r in body] == [MII_FIELDS, MII_FIELDS]
    assert [r["generated_text"] for r in body] == [_greedy(pipe, P1, 6), _greedy(pipe, P2, 6)]
    assert [r["prompt_length"] for r in body] == [len(served.tokenizer.encode(p)) for p in (P1, P2)]
    assert [(r["generated_length"], r["finish_reason"]) for r in body] == [(6, "length")] * 2
    full = http.post(f"/mii/{DEPLOYMENT}", json={"prompts": P1, "max_new_tokens": 4, "do_sample": False,
                                                 "return_full_text": True}).json()
    expected = pipe([P1], do_sample=False, max_new_tokens=4, return_full_text=True)[0].generated_text
    assert [r["generated_text"] for r in full] == [expected] and expected.startswith(P1)
    missing = http.post("/mii/other-deployment", json={"prompts": P1})
    assert missing.status_code == 404 and "other-deployment" in missing.json()["error"]["message"]


def test_api_key_required_except_probes_version_and_metrics(served, client):
    for path in ("/v1/models", "/terminate"):
        assert httpx.get(served.url + path).status_code == 401
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions")):
        assert httpx.request(method, served.url + path, json={}).status_code == 401
    # Open as in vLLM: probes, the version and Prometheus' scrape (--protect-metrics closes it).
    for method, path in (("GET", "/metrics"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"),
                         ("HEAD", "/health")):
        assert httpx.request(method, served.url + path).status_code == 200, (method, path)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + KEY}):
        resp = httpx.post(served.url + f"/mii/{DEPLOYMENT}", json={"prompts": P1}, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt=P1, max_tokens=2)
    assert httpx.get(served.url + "/healthz").status_code == 200
    assert not served.terminated.is_set()


BAD_COMPLETIONS = [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"), ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"), ({"logprobs": 50}, "logprobs"),
    ({"seed": -1}, "seed"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"), ({"stream": "yes"}, "stream"),
    ({"prompt": None}, "prompt"), ({"prompt": [1.5]}, "prompt"), ({"prompt": [[10**6]]}, "prompt"),
    ({"prompt": ""}, "prompt"), ({"model": None}, "model"), ({"echo": "yes"}, "echo"),
    ({"max_tokens": 2.5}, "max_tokens"), ({"stream_options": {"include_usage": True}}, "stream_options"),
]
BAD_CHAT = [
    ({"messages": None}, "messages"), ({"messages": []}, "messages"), ({"messages": [{"role": 1}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"temperature": "hot"}, "temperature"),
]
BAD_MII = [
    ({"prompts": None}, "prompts"), ({"prompts": 5}, "prompts"), ({"prompts": [1, 2]}, "prompts"),
    ({"max_new_token": 5}, "max_new_token"), ({"top_p": 2.0}, "top_p"), ({"stop": [3]}, "stop"),
]


def _assert_400(resp, field):
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"


def test_bad_fields_are_400_naming_the_field_and_serving_goes_on(served, http):
    too_long = "hello world " * 400
    assert len(served.tokenizer.encode(too_long)) > served.engine.max_model_len
    for bad, field in BAD_COMPLETIONS + [({"prompt": too_long}, "prompt")]:
        _assert_400(http.post("/v1/completions", json={"model": MODEL, "prompt": P1, "max_tokens": 2, **bad}), field)
    for bad, field in BAD_CHAT:
        body = {"model": MODEL, "messages": [{"role": "user", "content": P1}], "max_tokens": 2, **bad}
        _assert_400(http.post("/v1/chat/completions", json=body), field)
    for bad, field in BAD_MII:
        _assert_400(http.post(f"/mii/{DEPLOYMENT}", json={"prompts": P1, "max_new_tokens": 2, **bad}), field)
    second_empty = http.post("/v1/completions", json={"model": MODEL, "prompt": [P1, ""], "max_tokens": 2})
    assert second_empty.json()["error"]["message"].startswith("prompt[1]: ")  # and prompt[0] was aborted
    not_json = http.post("/v1/completions", content=b"{nope", headers={"Content-Type": "application/json"})
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": P1, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert _idle(served)


def test_unknown_model_and_route_are_404(served, client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt=P1, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    for resp in (http.get("/v1/models/nope"), http.get("/v1/nothing"), http.post("/mii/nope", json={"prompts": P1})):
        assert resp.status_code == 404 and set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_over_the_pending_limit_is_429(served, http, client):
    body = {"model": MODEL, "prompt": P1, "n": LIMIT, "max_tokens": 400, "temperature": 1.0, "seed": 3,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as busy:
        assert busy.status_code == 200
        lines = busy.iter_lines()  # kept referenced: dropping a half-read iterator closes the connection
        next(line for line in lines if line.startswith("data: "))
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": P2, "max_tokens": 2})
        assert resp.status_code == 429 and resp.headers["Retry-After"] == "1"
        assert resp.json()["error"]["code"] == "too_many_pending_requests"
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": P2}], max_tokens=2)
    _wait_until(lambda: _idle(served))
    _assert_400(http.post("/v1/completions", json={"model": MODEL, "prompt": P1, "n": LIMIT + 1}), "n")
    assert client.completions.create(model=MODEL, prompt=P2, max_tokens=2).usage.completion_tokens == 2


def test_client_disconnect_aborts_and_frees_kv_blocks(served, http, monkeypatch):
    # 480 tokens take at least 480 steps; an aborted request stops long before. 2 ms more a step keeps them longer
    # than the client's 0.5 s below, however fast the tiny model's steps are on this machine.
    step = served.engine.step
    monkeypatch.setattr(served.engine, "step", lambda: time.sleep(0.002) or step())
    aborted = _metric(http, "fastgen_sequences_finished_total", finish_reason="abort")
    steps = served.engine.stats()["num_steps"]
    body = {"model": MODEL, "prompt": P1, "max_tokens": 480, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        next(lines), next(lines)
        assert served.engine.requests  # still generating when the client goes away
    _wait_until(lambda: _idle(served))
    assert served.engine.stats()["num_steps"] - steps < 480
    assert _metric(http, "fastgen_sequences_finished_total", finish_reason="abort") == aborted + 1

    steps = served.engine.stats()["num_steps"]
    with pytest.raises(httpx.ReadTimeout):  # not streaming: the server notices the disconnect too
        http.post(f"/mii/{DEPLOYMENT}", json={"prompts": P2, "max_new_tokens": 480}, timeout=0.5)
    _wait_until(lambda: _idle(served))
    assert served.engine.stats()["num_steps"] - steps < 480
    assert _metric(http, "fastgen_sequences_finished_total", finish_reason="abort") == aborted + 2
    assert http.get("/healthz").status_code == 200


def test_metrics_move_with_requests(served, http, client):
    def read(name, **labels):
        return _metric(http, name, **labels)

    ok = dict(endpoint="/v1/completions", status="200")
    before = [read("fastgen_http_requests_total", **ok), read("fastgen_prompt_tokens_total"),
              read("fastgen_generation_tokens_total"), read("fastgen_time_to_first_token_seconds_count"),
              read("fastgen_inter_token_latency_seconds_count"), read("fastgen_engine_step_seconds_count")]
    bad_before = read("fastgen_http_requests_total", endpoint="/v1/completions", status="400")
    client.completions.create(model=MODEL, prompt=P1, max_tokens=5, temperature=0)
    http.post("/v1/completions", json={"model": MODEL, "prompt": P1, "temperature": -1})
    after = [read("fastgen_http_requests_total", **ok), read("fastgen_prompt_tokens_total"),
             read("fastgen_generation_tokens_total"), read("fastgen_time_to_first_token_seconds_count"),
             read("fastgen_inter_token_latency_seconds_count"), read("fastgen_engine_step_seconds_count")]
    assert after[0] == before[0] + 1
    assert after[1] == before[1] + len(served.tokenizer.encode(P1))
    assert after[2] == before[2] + 5
    assert (after[3], after[4]) == (before[3] + 1, before[4] + 4)
    assert after[5] > before[5]
    assert read("fastgen_http_requests_total", endpoint="/v1/completions", status="400") == bad_before + 1
    assert (read("fastgen_kv_blocks_total"), read("fastgen_kv_blocks_free")) == (NUM_BLOCKS, NUM_BLOCKS)
    assert read("fastgen_gateway_pending_sequences") == 0
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


def test_terminate_calls_back_after_answering(served, http):
    assert http.get("/terminate").status_code == 200
    assert served.terminated.wait(5)


def test_app_without_terminate_hook_and_bad_arguments(served):
    loop, tok = served.app.state.gateway.backend, served.tokenizer
    with TestClient(create_app(loop, DEPLOYMENT, tok, MODEL)) as plain:
        resp = plain.get("/terminate")
        assert resp.status_code == 501 and "on_terminate" in resp.json()["error"]["message"]
        assert plain.get("/v1/models").status_code == 200  # no api_key: open
    for kwargs, error in (({"deployment_name": ""}, ValueError), ({"model_name": None}, ValueError),
                          ({"api_key": ""}, ValueError), ({"max_pending_requests": 0}, ValueError),
                          ({"metrics": object()}, TypeError), ({"backend": object()}, TypeError)):
        args = dict(backend=loop, deployment_name=DEPLOYMENT, tokenizer=tok, model_name=MODEL)
        with pytest.raises(error):
            create_app(**{**args, **kwargs})


@pytest.mark.parametrize("key", [None, KEY])
def test_terminate_refuses_what_a_browser_sends_cross_site(served, key):
    # A GET that stops the server is what any page can fire at 127.0.0.1 (an <img> is enough):
    # browsers mark such a request (Sec-Fetch-Site, Origin); curl and MII's client send neither.
    loop, tok = served.app.state.gateway.backend, served.tokenizer
    stops = []
    app = create_app(loop, DEPLOYMENT, tok, MODEL, api_key=key, on_terminate=lambda: stops.append(1))
    auth = {"Authorization": f"Bearer {KEY}"} if key else {}
    with TestClient(app) as http:
        for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                        {"Origin": "http://evil.example"}, {"Origin": "null"},
                        {"Origin": "http://testserver:8080"}, {"Origin": "https://testserver"},
                        {"Origin": "http://testserver", "Sec-Fetch-Site": "cross-site"}):
            resp = http.get("/terminate", headers={**auth, **headers})
            assert resp.status_code == 403, headers
            assert resp.json()["error"]["code"] == "cross_site_request"
        assert stops == []
        if key:
            for headers in ({}, {"Authorization": "Bearer wrong"}):  # the key stays required, same-origin or not
                assert http.get("/terminate", headers={**headers, "Sec-Fetch-Site": "same-origin"}).status_code == 401
            assert stops == []
        for headers in ({}, {"Sec-Fetch-Site": "none"},
                        {"Sec-Fetch-Site": "same-origin", "Origin": "http://testserver"}):
            resp = http.get("/terminate", headers={**auth, **headers})
            assert resp.status_code == 200 and resp.text == f"terminating deployment {DEPLOYMENT}", headers
    assert len(stops) == 3

"""The REST gateway's guards, in-process: keys from `ServingLimits`, body-size refusals, hostile
bodies as 400s naming the field with one log line and no traceback, the per-request bounds, the
context check on `max_tokens`, the OpenAPI schema, engine failures sorted into 500 (this request)
and 503 (stopped engine), and the tokenizer never called on the event loop."""

import asyncio
import json
import logging

import pytest
from fastapi.testclient import TestClient

from fastgen import EngineConfig
from fastgen.engine import Engine
from fastgen.engine import END, EngineLoop, RequestFailed
from fastgen.outputs import Response
from fastgen.serving.http.guard import HttpGuard
from fastgen.serving.limits import ServingLimits
from fastgen.serving.http.app import create_app

KEYS = ("key-one", "key-two")
MODEL = "tiny"
DEPLOYMENT = "guarded"
P1 = "The quick brown fox"
LIMITS = ServingLimits(api_keys=KEYS, max_body_bytes=64 * 1024, max_prompts_per_request=2, max_n=3)


class LoopWatcher:
    """A tokenizer proxy recording, per call, whether it ran on a thread with a running event loop."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.calls: list[tuple[str, bool]] = []

    def __getattr__(self, name):
        attr = getattr(self._tokenizer, name)
        if not callable(attr):
            return attr

        def watched(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            self.calls.append((name, on_loop))
            return attr(*args, **kwargs)

        return watched


@pytest.fixture(scope="module")
def loop(tiny_checkpoints):
    engine = Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], num_kv_blocks=64, block_size=8, token_budget=32,
                                 max_seqs=8, progress=False))
    engine.eos_token_ids = set()
    loop = EngineLoop(engine)
    yield loop
    loop.shutdown()


@pytest.fixture(scope="module")
def watcher(loop):
    return LoopWatcher(loop.engine.tokenizer)


@pytest.fixture(scope="module")
def client(loop, watcher):
    app = create_app(loop, DEPLOYMENT, watcher, MODEL, api_key="legacy-key", max_model_len=loop.engine.max_model_len,
                     limits=LIMITS)
    with TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {KEYS[1]}"}) as c:
        yield c


def _error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error["message"]


def test_any_of_the_keys_is_accepted_and_health_stays_open(client):
    for key in (*KEYS, "legacy-key"):
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer key-three"}, {"Authorization": "key-one"}):
        resp = client.get("/v1/models", headers=headers)
        assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
    anonymous = {"Authorization": ""}
    for path in ("/openapi.json", "/docs", "/v1/nothing"):
        assert client.get(path, headers=anonymous).status_code == 401, path
    for path in ("/tokenize", "/detokenize", "/v1/completions", "/metrics"):
        assert client.post(path, json={}, headers=anonymous).status_code == 401, path  # open for reading only
    assert client.get("/health", headers=anonymous).json() == {"status": "ok"}
    assert client.head("/health", headers=anonymous).status_code == 200
    assert client.get("/healthz", headers=anonymous).text == "ok"
    assert client.get("/metrics", headers=anonymous).status_code == 200
    assert client.get("/version", headers=anonymous).json()["version"]
    assert [client.request(m, "/ping", headers=anonymous).status_code for m in ("GET", "POST", "HEAD")] == [200] * 3


def test_protect_metrics_puts_metrics_behind_the_key(loop):
    app = create_app(loop, DEPLOYMENT, loop.engine.tokenizer, MODEL, limits=LIMITS, protect_metrics=True)
    with TestClient(app) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200
        assert c.get("/ping").status_code == 200
    schema_paths = app.openapi()["paths"]
    assert "security" in schema_paths["/metrics"]["get"] and "security" not in schema_paths["/ping"]["get"]


def test_openapi_schema_documents_the_hand_parsed_bodies(client):
    schema = client.get("/openapi.json").json()
    completion = schema["paths"]["/v1/completions"]["post"]
    body = completion["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["model"]["enum"] == [MODEL] and set(body["required"]) == {"model", "prompt"}
    assert body["properties"]["n"]["maximum"] == LIMITS.max_n
    assert completion["responses"]["400"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/Error"
    chat = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["messages"]["minItems"] == 1
    mii = schema["paths"]["/mii/{name}"]["post"]
    assert "prompts" in mii["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert mii["parameters"][0]["schema"]["enum"] == [DEPLOYMENT]
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert client.get("/docs").status_code == 200


HOSTILE = [  # (path, raw body, param named, words the message must hold)
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e400}', "max_tokens", "out of range"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 400 + b"}", "max_tokens",
     "out of range"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature", "NaN"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "top_p": -Infinity}', "top_p", "Infinity"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', "prompt", "surrogate"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfff"}]}',
     "messages", "messages[0].content"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "' + b"\xff\xfe" + b'"}', None, "UTF-8"),
    ("/v1/completions", b"[" * 20_000 + b"]" * 20_000, None, "nested too deeply"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "prompt", "nested"),
    ("/v1/completions", b'["model", "tiny"]', None, "JSON object"),
    ("/v1/completions", b'"just a string"', None, "JSON object"),
    ("/v1/completions", b"", None, "empty"),
    ("/v1/completions", b"{nope", None, "not valid JSON"),
    ("/v1/completions", b'{"model": "tiny", "prompt": {"text": "hi"}}', "prompt", "prompt must be"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": [[1]]}', "stop", "stop"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "seed": 1.5}', "seed", "seed"),
    ("/v1/completions", b'{"model": ["tiny"], "prompt": "hi"}', "model", "model"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
     "messages", "text part"),
    (f"/mii/{DEPLOYMENT}", b'{"prompts": "hi", "max_new_tokens": 1e999}', "max_new_tokens", "out of range"),
    (f"/mii/{DEPLOYMENT}", b'{"prompts": ["hi", 7]}', "prompts", "prompts must be"),
    (f"/mii/{DEPLOYMENT}", b'{"prompts": "hi", "temperature": "warm"}', "temperature", "temperature"),
]


def test_hostile_bodies_are_400_naming_the_field_with_one_log_line(client, caplog):
    caplog.set_level(logging.INFO)
    for path, raw, param, words in HOSTILE:
        caplog.clear()
        message = _error(client.post(path, content=raw, headers={"Content-Type": "application/json"}), 400, param)
        assert words in message, (raw[:80], message)
        ours = [r for r in caplog.records if r.name == "fastgen"]
        assert len(ours) == 1 and path in ours[0].getMessage(), [r.getMessage() for r in ours]
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        resp = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "hi"}',
                           headers={"Content-Type": content_type})
        assert "Content-Type must be application/json" in _error(resp, 400)
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": P1, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_bodies_over_the_limit_are_413_before_they_are_read(client):
    over = LIMITS.max_body_bytes + 1
    body = b'{"model": "tiny", "prompt": "' + b"x" * over + b'"}'
    message = _error(client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}), 413)
    assert str(LIMITS.max_body_bytes) in message and str(len(body)) in message

    def chunks():  # no Content-Length: counted as it arrives (test_rest_big_bodies: unread beyond the limit)
        for _ in range(64):
            yield b" " * (16 * 1024)

    resp = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert str(LIMITS.max_body_bytes) in _error(resp, 413)
    assert resp.headers["Connection"] == "close"
    just_under = json.dumps({"model": MODEL, "prompt": P1, "max_tokens": 2, "user": "u" * (32 * 1024)})
    assert client.post("/v1/completions", content=just_under,
                       headers={"Content-Type": "application/json"}).status_code == 200


def test_prompts_per_request_and_n_are_bounded_naming_the_field(client):
    many = client.post("/v1/completions", json={"model": MODEL, "prompt": [P1] * 3, "max_tokens": 2})
    assert "at most 2 prompts" in _error(many, 400, "prompt")
    mii = client.post(f"/mii/{DEPLOYMENT}", json={"prompts": [P1] * 3, "max_new_tokens": 2})
    assert "at most 2 prompts" in _error(mii, 400, "prompts")
    wide = client.post("/v1/completions", json={"model": MODEL, "prompt": P1, "n": 4, "max_tokens": 2})
    assert "n must be <= 3" in _error(wide, 400, "n")
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": [P1, P1], "n": 3,
                                                "max_tokens": 2}).status_code == 200


def test_max_tokens_beyond_the_context_is_a_400_like_vllm(client, loop):
    limit, tok = loop.engine.max_model_len, loop.engine.tokenizer
    num_prompt = len(tok.encode(P1))
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": P1, "max_tokens": limit})
    message = _error(resp, 400, "max_tokens")
    assert (f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + limit} tokens ({num_prompt} in the prompt, {limit} in the completion)") in message
    ids = tok.encode(P1)
    two = _error(client.post("/v1/completions", json={"model": MODEL, "prompt": [ids, ids + ids],
                                                      "max_tokens": limit - len(ids)}), 400, "max_tokens")
    assert two.startswith("prompt[1]: ") and f"({2 * len(ids)} in the prompt" in two
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": P1}],
                                                     "max_completion_tokens": limit})
    assert "in the messages" in _error(chat, 400, "max_completion_tokens")
    fits = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": limit - len(ids)})
    assert fits.status_code == 200 and fits.json()["usage"]["total_tokens"] == limit
    # MII's max_new_tokens keeps MII's meaning: generation stops at the context, no 400.
    text = P1
    while len(tok.encode(text + " " + P1)) < limit - 4:
        text += " " + P1
    mii = client.post(f"/mii/{DEPLOYMENT}", json={"prompts": text, "max_new_tokens": limit})
    assert mii.status_code == 200, mii.text
    assert (mii.json()[0]["finish_reason"], mii.json()[0]["generated_length"]) == ("length", limit - len(tok.encode(text)))


def test_the_tokenizer_never_runs_on_the_event_loop(client, watcher):
    watcher.calls.clear()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": P1}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2}
    requests = [
        ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/completions", {"model": MODEL, "prompt": P1, "max_tokens": 3, "logprobs": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": P1, "max_tokens": 3, "logprobs": 2, "stream": True}),
        ("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "echo": True}),
        (f"/mii/{DEPLOYMENT}", {"prompts": [P1], "max_new_tokens": 3, "return_full_text": True}),
    ]
    for path, body in requests:
        resp = client.post(path, json=body)
        assert resp.status_code == 200 and "error" not in resp.text, resp.text
    names = {name for name, _ in watcher.calls}
    assert {"apply_chat_template", "encode", "decode"} <= names, names
    assert not [call for call in watcher.calls if call[1]], "tokenizer called on the event loop"


class _FailingRequest:
    request_id = "x"

    def __init__(self):
        self.aborted = False

    def abort(self):
        self.aborted = True


class _FakeBackend:
    """A backend whose requests fail after one delta (`error`), or that refuses them (`refuse`)."""

    def __init__(self, tokenizer, error=None, refuse=None):
        self.tokenizer, self.error, self.refuse = tokenizer, error, refuse

    async def submit_async(self, prompt, params, deliver, lora=None):
        if self.refuse is not None:
            raise self.refuse
        for item in (Response("a", 3, 1, "none", [7]), self.error, END):
            deliver(item)
        return _FailingRequest()


def test_an_engine_failure_is_a_500_for_that_request_and_a_stopped_engine_503(loop):
    tok = loop.engine.tokenizer
    body = {"model": MODEL, "prompt": P1, "max_tokens": 3}
    failing = create_app(_FakeBackend(tok, error=RequestFailed("request 0 failed in the engine while sampling")),
                         DEPLOYMENT, tok, MODEL)
    with TestClient(failing, raise_server_exceptions=False) as c:
        resp = c.post("/v1/completions", json=body)
        assert "failed in the engine while sampling" in _error(resp, 500)
        assert resp.json()["error"]["code"] == "request_failed"
        streamed = c.post("/v1/completions", json={**body, "stream": True}).text
        assert '"code": "request_failed"' in streamed and streamed.endswith("data: [DONE]\n\n")
        assert c.post(f"/mii/{DEPLOYMENT}", json={"prompts": P1}).status_code == 500
        assert failing.state.gateway.pending == 0
    stop = RuntimeError("the engine loop is shut down")
    stopped = create_app(_FakeBackend(tok, refuse=stop), DEPLOYMENT, tok, MODEL)
    with TestClient(stopped, raise_server_exceptions=False) as c:
        resp = c.post("/v1/completions", json=body)
        assert "shut down" in _error(resp, 503) and resp.json()["error"]["code"] == "engine_unavailable"
        assert stopped.state.gateway.pending == 0
    ended = create_app(_FakeBackend(tok, error=stop), DEPLOYMENT, tok, MODEL)  # stopped mid-generation
    with TestClient(ended, raise_server_exceptions=False) as c:
        assert "shut down" in _error(c.post("/v1/completions", json=body), 503)


def test_a_malformed_content_length_is_a_400_before_the_app_runs():
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope)

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    guard = HttpGuard(app, ServingLimits())
    for value, status in ((b"12abc", 400), (b"\xb2", 400), (b"9" * 5000, 413), (b"99999999999", 413)):
        sent.clear()
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", value)]}
        asyncio.run(guard(scope, receive, send))
        assert sent[0]["status"] == status and not reached, (value[:20], sent[0])
        assert "Content-Length" in json.loads(sent[1]["body"])["error"]["message"] or status == 413


def test_limits_and_legacy_arguments_combine_or_are_refused(loop):
    tok = loop.engine.tokenizer
    app = create_app(loop, DEPLOYMENT, tok, MODEL, max_pending_requests=5, limits=ServingLimits(max_n=2))
    assert (app.state.gateway.limits.max_pending_requests, app.state.gateway.limits.max_n) == (5, 2)
    with pytest.raises(ValueError, match="max_pending_requests"):
        create_app(loop, DEPLOYMENT, tok, MODEL, max_pending_requests=5,
                   limits=ServingLimits(max_pending_requests=6))
    with pytest.raises(TypeError, match="limits"):
        create_app(loop, DEPLOYMENT, tok, MODEL, limits={"api_keys": ["k"]})

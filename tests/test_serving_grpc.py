"""The gRPC server in-process: typed and MII services, health, reflection, concurrency, cancellation,
bad requests, the async client and the replica router, all against real clients on 127.0.0.1."""

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

import fastgen
from fastgen import EngineConfig, SamplingParams
from fastgen.engine import Engine
from fastgen.engine import EngineLoop, submit_group
from fastgen.serving.backend import LocalBackend
from fastgen.serving.client import AsyncClient, Client
from fastgen.serving.grpc.convert import params_from_proto, params_to_proto, value_from_mii
from fastgen.serving.grpc.server import ERROR_TYPE_KEY, MII_SERVICE, REQUEST_IDS_KEY, TYPED_SERVICE, GrpcServer
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc
from fastgen.serving.grpc.proto import modelresponse_pb2 as mii_pb
from fastgen.serving.grpc.proto import modelresponse_pb2_grpc as mii_grpc
from fastgen.serving.deploy.replicas import Replica, ReplicaRouter

NUM_BLOCKS = 64
CONFIG = dict(num_kv_blocks=NUM_BLOCKS, block_size=8, token_budget=32, max_seqs=8, progress=False)
PROMPTS = ["The quick brown fox", [5, 17, 99, 3, 250], "def main():", [7] * 11]


@pytest.fixture(scope="module")
def pipe(tiny_checkpoints):
    pipe = fastgen.pipeline(tiny_checkpoints["llama"], **CONFIG)
    yield pipe
    pipe.destroy()


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    backend = LocalBackend(EngineLoop(Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], **CONFIG))), "tiny")
    server = GrpcServer("127.0.0.1", 0, deployment_name="tiny", backend=backend)
    server.start()
    channel = grpc.insecure_channel(server.address)
    client = Client(server.address)
    yield SimpleNamespace(server=server, backend=backend, engine=backend.engine, channel=channel, client=client,
                          stub=pb_grpc.FastGenStub(channel), mii=mii_grpc.ModelResponseStub(channel))
    client.close()
    channel.close()
    server.stop(grace=0)
    backend.close()


def _eventually(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _wait_idle(engine, timeout=10.0):
    """The engine holds no request and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while engine.requests or engine.block_manager.num_free_blocks != NUM_BLOCKS:
        assert time.monotonic() < deadline, (list(engine.requests), engine.block_manager.num_free_blocks)
        time.sleep(0.02)


def _typed_request(prompts, **gen):
    msg_prompts = [pb.Prompt(text=p) if isinstance(p, str) else pb.Prompt(token_ids=pb.TokenIds(ids=p)) for p in prompts]
    return pb.GenerateRequest(prompts=msg_prompts, params=params_to_proto(SamplingParams(**gen), fields=gen))


def test_proto_sampling_params_mirror_fastgen():
    assert set(pb.SamplingParams.DESCRIPTOR.fields_by_name) == set(SamplingParams.field_names())
    full = SamplingParams(max_length=100, max_new_tokens=20, min_new_tokens=2, ignore_eos=True, do_sample=True,
                          temperature=0.7, top_k=5, top_p=0.8, stop=["a", "bc"], return_full_text=True, seed=2**63 + 5,
                          stop_token_ids=[3, 4], repetition_penalty=1.1, presence_penalty=-0.5, frequency_penalty=0.25,
                          logprobs=3, n=2)
    assert params_from_proto(params_to_proto(full)) == full
    assert params_from_proto(pb.SamplingParams()) == SamplingParams()
    # MII sends floats as float32; the value the client wrote comes back.
    assert value_from_mii(mii_pb.Value(fvalue=0.7)) == 0.7


def test_generate_many_prompts_and_choices_match_pipeline(served, pipe):
    gen = dict(max_new_tokens=10, do_sample=True, seed=1234, n=2, logprobs=1)
    got = served.client.generate(PROMPTS, **gen)
    want = pipe(PROMPTS, **gen)
    assert [(r.prompt_index, r.index) for r in got] == [(p, c) for p in range(len(PROMPTS)) for c in range(2)]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.generated_text for r in got] == [r.generated_text for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert [(r.prompt_length, r.generated_length) for r in got] == [(r.prompt_length, r.generated_length) for r in want]
    assert got[0].token_ids != got[1].token_ids  # the two choices are different samples
    for g, w in zip(got, want):
        assert [list(d) for d in g.logprobs] == [list(d) for d in w.logprobs]
        assert all(abs(g.logprobs[i][t] - w.logprobs[i][t]) < 1e-5 for i, d in enumerate(w.logprobs) for t in d)


def test_generate_stream_interleaves_prompts_and_choices(served, pipe):
    gen = dict(max_new_tokens=8, do_sample=True, seed=7, n=2, ignore_eos=True)
    call = served.stub.GenerateStream(_typed_request(PROMPTS[:3], **gen))
    chunks = list(call)
    assert len(dict(call.initial_metadata())[REQUEST_IDS_KEY].split(",")) == 3
    keys = [(c.prompt_index, c.index) for c in chunks]
    assert set(keys) == {(p, c) for p in range(3) for c in range(2)}
    first_done = min(max(i for i, k in enumerate(keys) if k == key) for key in set(keys))
    assert len(set(keys[: first_done + 1])) > 1, "every chunk of one completion came before any other's"
    want = pipe(PROMPTS[:3], **gen)
    for r in want:
        mine = [c for c in chunks if (c.prompt_index, c.index) == (r.prompt_index, r.index)]
        assert [c.finish_reason for c in mine] == ["none"] * (len(mine) - 1) + ["length"]
        assert [t for c in mine for t in c.token_ids] == r.token_ids
        assert "".join(c.text for c in mine) == r.generated_text
        assert [c.generated_length for c in mine] == list(range(1, 9))


def test_mii_generator_reply_and_stream(served, pipe):
    kwargs = {"max_new_tokens": mii_pb.Value(ivalue=6), "do_sample": mii_pb.Value(bvalue=False),
              "ignore_eos": mii_pb.Value(bvalue=True), "top_p": mii_pb.Value(fvalue=0.9)}
    prompts = ["Hello there", "DeepSpeed is"]
    want = pipe(prompts, max_new_tokens=6, do_sample=False, ignore_eos=True)
    reply = served.mii.GeneratorReply(mii_pb.MultiStringRequest(request=prompts, query_kwargs=kwargs))
    assert [r.response for r in reply.response] == [w.generated_text for w in want]
    assert [(r.finish_reason, r.prompt_tokens, r.generated_tokens) for r in reply.response] == \
        [("length", w.prompt_length, 6) for w in want]
    assert all(r.time_taken >= r.model_time_taken > 0 for r in reply.response)

    stream = list(served.mii.GeneratorReplyStream(mii_pb.MultiStringRequest(request=prompts, query_kwargs=kwargs)))
    assert stream and all(len(m.response) == 2 for m in stream)  # every reply has every prompt, in order
    assert ["".join(m.response[i].response for m in stream) for i in range(2)] == [w.generated_text for w in want]
    assert [r.finish_reason for r in stream[-1].response] == ["length", "length"]
    assert all(r.finish_reason == "none" for m in stream[:-1] for r in m.response if r.generated_tokens < 6)


def test_mii_stream_kwarg_is_accepted_and_changes_nothing(served, pipe):
    """MII's client adds stream=True to every streaming call (and MII's server chose per-token replies
    by it): both methods take it, the unary one still answers in full, the streaming one streams."""
    base = {"max_new_tokens": mii_pb.Value(ivalue=5), "do_sample": mii_pb.Value(bvalue=False),
            "ignore_eos": mii_pb.Value(bvalue=True)}
    want = [w.generated_text for w in pipe(["Hello there"], max_new_tokens=5, do_sample=False, ignore_eos=True)]
    for stream in (True, False):
        request = mii_pb.MultiStringRequest(request=["Hello there"],
                                            query_kwargs={**base, "stream": mii_pb.Value(bvalue=stream)})
        reply = served.mii.GeneratorReply(request)
        assert [(r.response, r.generated_tokens, r.finish_reason) for r in reply.response] == [(want[0], 5, "length")]
        replies = list(served.mii.GeneratorReplyStream(request))
        assert len(replies) > 1 and "".join(m.response[0].response for m in replies) == want[0]
    bad = mii_pb.MultiStringRequest(request=["Hello"], query_kwargs={**base, "stream": mii_pb.Value(svalue="yes")})
    for method in (served.mii.GeneratorReply, lambda r: list(served.mii.GeneratorReplyStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            method(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "query_kwargs['stream'] must be a bool" in err.value.details()
    # fastgen's own clients take MII's flag too (MII code passes it to mii.client(...).generate).
    assert [r.generated_text for r in served.client.generate(["Hello there"], max_new_tokens=5, do_sample=False,
                                                             ignore_eos=True, stream=True)] == want
    _wait_idle(served.engine)


def test_health_reflection_and_loading_state(served):
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in ("", TYPED_SERVICE, MII_SERVICE):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    names = set(ProtoReflectionDescriptorDatabase(served.channel).get_services())
    assert {TYPED_SERVICE, MII_SERVICE, "grpc.health.v1.Health"} <= names

    loading = GrpcServer("127.0.0.1", 0)  # no backend yet: a model still loading
    loading.start()
    try:
        with grpc.insecure_channel(loading.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.FastGenStub(channel).Generate(_typed_request(["hi"]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
            pb_grpc.FastGenStub(channel).Terminate(pb.TerminateRequest())
        assert loading.terminated.is_set()
        with Client(loading.address) as probe:
            _eventually(lambda: probe.health(timeout=0.5) == "UNREACHABLE")
    finally:
        loading.stop(grace=0)


def test_concurrent_streaming_clients_get_pipeline_tokens(served, pipe):
    prompts = [[11 + i, 40 + 3 * i, 7, 99 + i][: 1 + i % 4] + [13] * i for i in range(8)]
    want = [r.token_ids for r in pipe(prompts, do_sample=False, max_new_tokens=12)]
    got = {}

    def one(i):
        with Client(served.server.address) as client:
            deltas = client.stream([prompts[i]], do_sample=False, max_new_tokens=12)
            got[i] = [t for delta in deltas for t in delta.token_ids]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got.get(i) for i in range(8)] == want
    _wait_idle(served.engine)


@pytest.mark.parametrize("how", ["cancel", "disconnect", "deadline"])
def test_client_going_away_aborts_and_frees_blocks(served, how, monkeypatch):
    live_when_aborted = []
    abort = served.backend.loop.abort

    def spy(request_id):
        live_when_aborted.append(request_id in served.engine.requests)
        abort(request_id)

    monkeypatch.setattr(served.backend.loop, "abort", spy)
    # 480 one-token steps of the tiny model can end inside the 0.3 s deadline on a fast CPU: 2 ms more a step keeps
    # the request generating when the client goes away, whatever the machine.
    step = served.engine.step
    monkeypatch.setattr(served.engine, "step", lambda: time.sleep(0.002) or step())
    request = _typed_request([[5, 6, 7] * 10], do_sample=False, ignore_eos=True, max_new_tokens=480)
    if how == "deadline":
        with pytest.raises(grpc.RpcError) as err:
            served.stub.Generate(request, timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        channel = grpc.insecure_channel(served.server.address)
        call = pb_grpc.FastGenStub(channel).GenerateStream(request)
        stream = iter(call)
        first, second = next(stream), next(stream)
        assert first.finish_reason == second.finish_reason == "none"
        assert served.engine.requests and served.engine.block_manager.num_free_blocks < NUM_BLOCKS
        call.cancel() if how == "cancel" else channel.close()
        channel.close()
    _eventually(lambda: True in live_when_aborted)  # aborted while generating, not after finishing
    _wait_idle(served.engine)
    assert served.client.generate([[1, 2, 3]], max_new_tokens=2)[0].generated_length == 2


def _invalid(call, *args):
    with pytest.raises(grpc.RpcError) as err:
        call(*args)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.details(), dict(err.value.trailing_metadata())[ERROR_TYPE_KEY]


def test_invalid_requests_name_the_field_and_server_keeps_serving(served, pipe):
    generate, mii = served.stub.Generate, served.mii.GeneratorReply
    bad_temperature = pb.GenerateRequest(prompts=[pb.Prompt(text="hi")], params=pb.SamplingParams(temperature=-1))
    assert _invalid(generate, bad_temperature) == ("temperature must be in [0, inf), got -1.0", "ValueError")
    assert _invalid(lambda: next(served.stub.GenerateStream(bad_temperature)))[1] == "ValueError"
    assert _invalid(generate, pb.GenerateRequest()) == ("prompts is empty", "ValueError")
    assert _invalid(generate, pb.GenerateRequest(prompts=[pb.Prompt()]))[0] == "prompts[0] has neither text nor token_ids"
    details, kind = _invalid(generate, _typed_request(["ok", [3, 10**6]]))
    assert details.startswith("prompts[1]: prompt token id 1000000 is outside the vocabulary") and kind == "ValueError"
    assert "max_length" in _invalid(generate, _typed_request([[4] * 20], max_length=10))[0]
    typo = mii_pb.MultiStringRequest(request=["hi"], query_kwargs={"max_new_token": mii_pb.Value(ivalue=3)})
    details, kind = _invalid(mii, typo)
    assert "unknown generation parameter 'max_new_token'" in details and kind == "TypeError"
    text_top_k = mii_pb.MultiStringRequest(request=["hi"], query_kwargs={"top_k": mii_pb.Value(svalue="5")})
    details, kind = _invalid(mii, text_top_k)
    assert details.startswith("top_k must be an int") and kind == "TypeError"
    assert _invalid(mii, mii_pb.MultiStringRequest())[0].startswith("request is empty")
    too_long = mii_pb.MultiStringRequest(request=["a", "a much longer prompt than that"],
                                         query_kwargs={"max_length": mii_pb.Value(ivalue=4)})
    assert _invalid(mii, too_long)[0].startswith("request[1]: prompt has")
    bad_top_p = mii_pb.MultiStringRequest(request=["hi"], query_kwargs={"top_p": mii_pb.Value(fvalue=1.5)})
    assert _invalid(lambda: next(served.mii.GeneratorReplyStream(bad_top_p)))[0] == "top_p must be in (0, 1], got 1.5"
    # The Python client raises the same types: locally for parameters, from the server for prompts.
    with pytest.raises(TypeError, match="top_k must be an int"):
        served.client.generate("hi", top_k=True)
    with pytest.raises(ValueError, match="prompts\\[1\\]: prompt token id 1000000"):
        served.client.generate([[1], [10**6]])
    with pytest.raises(ValueError, match="max_length"):
        list(served.client.stream([[4] * 20], max_length=10))
    _wait_idle(served.engine)
    assert served.client.generate("still serving", do_sample=False, max_new_tokens=4)[0].token_ids == \
        pipe("still serving", do_sample=False, max_new_tokens=4)[0].token_ids


def test_streaming_fn_full_text_tokenize_and_model_info(served, pipe):
    calls = []
    prompts = ["Hello there", [9, 8, 7]]
    final = served.client.generate(prompts, streaming_fn=calls.append, do_sample=False, max_new_tokens=5,
                                   return_full_text=True)
    unary = served.client.generate(prompts, do_sample=False, max_new_tokens=5, return_full_text=True)
    fields = lambda rs: [(r.generated_text, r.token_ids, r.finish_reason, r.prompt_index, r.prompt_length) for r in rs]
    assert fields(final) == fields(unary)
    assert [r.generated_text for r in final] == \
        [r.generated_text for r in pipe(prompts, do_sample=False, max_new_tokens=5, return_full_text=True)]
    assert all(len(c) == 1 for c in calls) and {c[0].prompt_index for c in calls} == {0, 1}

    tokenizer = served.engine.tokenizer
    assert served.client.tokenize("Hello there") == tokenizer.encode("Hello there")
    assert served.client.tokenize(["a b", "c"], add_special_tokens=False) == \
        [tokenizer.encode("a b", add_special_tokens=False), tokenizer.encode("c", add_special_tokens=False)]
    info = served.client.model_info()
    assert info["deployment_name"] == "tiny" and info["model_type"] == "llama"
    assert (info["num_kv_blocks"], info["block_size"], info["token_budget"], info["max_seqs"]) == (NUM_BLOCKS, 8, 32, 8)
    assert info["engine_config"]["max_seqs"] == "8" and info["version"] == fastgen.__version__
    assert info["plan"]["token_budget"] == "32" and info["plan_reasons"]["token_budget"] == "set by the user"


def test_async_client(served, pipe):
    prompts = ["async one", [4, 5, 6, 7]]
    want = pipe(prompts, do_sample=False, max_new_tokens=6)

    async def main():
        async with AsyncClient(served.server.address) as client:
            unary = await client.generate(prompts, do_sample=False, max_new_tokens=6)
            seen = []

            async def on_chunk(chunk):
                seen.extend(chunk)

            streamed = await client(prompts, streaming_fn=on_chunk, do_sample=False, max_new_tokens=6)
            early = client.stream("a long one", do_sample=False, ignore_eos=True, max_new_tokens=300)
            first = await early.__anext__()
            await early.aclose()  # leaving early cancels the request
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await client.generate([[10**6]])
            return unary, streamed, seen, first, await client.tokenize("async one")

    unary, streamed, seen, first, ids = asyncio.run(main())
    assert [r.token_ids for r in unary] == [r.token_ids for r in streamed] == [r.token_ids for r in want]
    assert len(seen) == 12 and first.finish_reason == "none"
    assert ids == served.engine.tokenizer.encode("async one")
    _wait_idle(served.engine)


def test_replica_router_in_process(served, pipe):
    second = GrpcServer("127.0.0.1", 0, backend=served.backend)  # two "replicas" sharing one engine
    second.start()
    front = GrpcServer("127.0.0.1", 0, deployment_name="front")
    router = ReplicaRouter([Replica(0, served.server.address), Replica(1, second.address)], served.backend.tokenizer,
                           report=front.set_health, check_interval=0.1)
    front.set_backend(router)
    front.start()
    client = Client(front.address)
    try:
        long = dict(do_sample=False, ignore_eos=True, max_new_tokens=300)
        first = submit_group(router, [[5, 6, 7]], SamplingParams(**long))
        second_stream = submit_group(router, [[5, 6, 8]], SamplingParams(max_new_tokens=2))
        assert [first.request_ids[0][:2], second_stream.request_ids[0][:2]] == ["r0", "r1"]
        list(second_stream)
        least_loaded = submit_group(router, [[5, 6, 9]], SamplingParams(max_new_tokens=2))
        assert least_loaded.request_ids[0].startswith("r1")  # replica 0 is busy with `first`
        list(least_loaded)
        next(first.batches())
        router.abort(first.request_ids[0])  # cancels the replica's call; the engine frees the blocks
        _wait_idle(served.engine)

        prompts = ["through the router", [3, 4, 5]]
        want = pipe(prompts, do_sample=False, max_new_tokens=6, return_full_text=True)
        got = client.generate(prompts, do_sample=False, max_new_tokens=6, return_full_text=True)
        assert [(r.token_ids, r.generated_text) for r in got] == [(r.token_ids, r.generated_text) for r in want]
        with pytest.raises(ValueError, match="outside the vocabulary"):
            client.generate([[10**6]])
        info = client.model_info()
        assert [r["status"] for r in info["replicas"]] == ["SERVING", "SERVING"] and info["deployment_name"] == "front"

        second.stop(grace=0)  # replica 1 goes away: reported and routed around
        _eventually(lambda: client.health("fastgen.replica.1") == "NOT_SERVING")
        assert client.health() == "SERVING"
        for _ in range(3):
            assert client.generate([[3, 4, 5]], do_sample=False, max_new_tokens=6)[0].token_ids == want[1].token_ids
        assert [r["healthy"] for r in client.model_info()["replicas"]] == [True, False]
    finally:
        client.close()
        front.stop(grace=0)
        router.close()
        second.stop(grace=0)
    _wait_idle(served.engine)

"""One request never fails another, over gRPC in-process: random requests (hypothesis) get OK,
INVALID_ARGUMENT or RESOURCE_EXHAUSTED, never INTERNAL/UNKNOWN; the bounds of `ServingLimits`
answer with the right status naming the field; an engine fault after admission is INTERNAL (or
UNAVAILABLE for an engine that stopped), never INVALID_ARGUMENT; the server serves on after all of it."""

import time

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fastgen import EngineConfig, SamplingParams
from fastgen.executor.distributed import TensorParallelError
from fastgen.engine import Engine
from fastgen.engine import EngineLoop
from fastgen.serving.backend import LocalBackend
from fastgen.serving.grpc.guard import RETRY_AFTER_KEY
from fastgen.serving.grpc.server import ERROR_TYPE_KEY, GrpcServer
from fastgen.serving.limits import ServingLimits
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc
from fastgen.serving.grpc.proto import modelresponse_pb2 as mii_pb
from fastgen.serving.grpc.proto import modelresponse_pb2_grpc as mii_grpc

NUM_BLOCKS = 64
# max_length keeps every generation short, whatever max_new_tokens a random request asks for.
CONFIG = dict(num_kv_blocks=NUM_BLOCKS, block_size=8, token_budget=32, max_seqs=8, max_length=40, progress=False)
LIMITS = ServingLimits(max_prompts_per_request=4, max_n=3, max_pending_requests=8, max_body_bytes=16 * 1024)
ACCEPTABLE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
INT64 = st.integers(-2**63, 2**63 - 1)


def _engine_loop(path: str, **config) -> LocalBackend:
    return LocalBackend(EngineLoop(Engine.from_config(EngineConfig(model=path, **{**CONFIG, **config}))), "tiny")


def _serve(backend: LocalBackend):
    server = GrpcServer("127.0.0.1", 0, deployment_name="tiny", backend=backend, limits=LIMITS)
    server.start()
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
    server.typed, server.mii, server.engine = pb_grpc.FastGenStub(channel), mii_grpc.ModelResponseStub(channel), \
        backend.engine
    yield server
    channel.close()
    server.stop(grace=0)
    backend.close()


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    """A server over an engine whose short context bounds every random request's work."""
    yield from _serve(_engine_loop(tiny_checkpoints["llama"]))


@pytest.fixture(scope="module")
def roomy(tiny_checkpoints):
    """A server over an engine with the model's whole context, for requests that must stay in flight."""
    yield from _serve(_engine_loop(tiny_checkpoints["llama"], max_length=None))


def _wait_idle(server, timeout=15.0):
    deadline = time.monotonic() + timeout
    while server.engine.requests or server.engine.block_manager.num_free_blocks != NUM_BLOCKS or server.pending:
        assert time.monotonic() < deadline, (list(server.engine.requests), server.pending)
        time.sleep(0.02)


def _still_serves(server):
    _wait_idle(server)
    hello = pb.GenerateRequest(prompts=[pb.Prompt(text="Hello")], params=pb.SamplingParams(max_new_tokens=3))
    assert server.typed.Generate(hello, timeout=30).completions[0].generated_length == 3


def _status(call) -> tuple[grpc.StatusCode, str, dict]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details(), dict(exc.trailing_metadata() or ())
    return grpc.StatusCode.OK, "", {}


# Random messages ------------------------------------------------------------------------------
# Each request is either plausible (small values in range, non-empty prompts: most get through
# admission and run, which is where an engine fault would show) or hostile (anything the wire
# allows: the validation's side).

ANY_INT64 = st.one_of(st.integers(-3, 12), INT64)
PLAUSIBLE_INT = {"max_new_tokens": st.integers(1, 8), "min_new_tokens": st.integers(0, 2), "n": st.integers(1, 3),
                 "top_k": st.integers(0, 8), "logprobs": st.integers(0, 3)}
SKIPPED_WHEN_PLAUSIBLE = {"max_length"}  # any value below the prompt's length is rightly refused


def _field_value(field: FieldDescriptor, plausible: bool) -> st.SearchStrategy:
    """A value for a SamplingParams field: in its plausible range, or anything its wire type allows."""
    kind = field.cpp_type
    if kind == FieldDescriptor.CPPTYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        return st.floats(0.05, 1.0) if plausible else st.one_of(st.floats(-3, 3), st.floats(allow_nan=True,
                                                                                              allow_infinity=True))
    if kind == FieldDescriptor.CPPTYPE_STRING:
        return st.text(min_size=1, max_size=6) if plausible else st.text(max_size=6)
    if kind == FieldDescriptor.CPPTYPE_UINT64:
        return st.integers(0, 2**64 - 1)
    if kind == FieldDescriptor.CPPTYPE_UINT32:
        return st.integers(0, 2**32 - 1)
    if kind == FieldDescriptor.CPPTYPE_INT32:
        return st.integers(0, 3) if plausible else st.integers(-2**31, 2**31 - 1)
    if plausible:
        return st.integers(0, 511) if field.is_repeated else PLAUSIBLE_INT.get(field.name, st.integers(0, 3))
    return ANY_INT64


@st.composite
def _params(draw, plausible: bool) -> pb.SamplingParams:
    msg = pb.SamplingParams()
    for field in pb.SamplingParams.DESCRIPTOR.fields:
        if field.message_type is not None or (plausible and field.name in SKIPPED_WHEN_PLAUSIBLE):
            continue
        if draw(st.integers(0, 3)):  # each field set one time in four
            continue
        if field.is_repeated:
            getattr(msg, field.name).extend(draw(st.lists(_field_value(field, plausible), max_size=3)))
        else:
            setattr(msg, field.name, draw(_field_value(field, plausible)))
    return msg


# Odd unicode included (controls, NUL, combining marks, astral planes); lone surrogates cannot be UTF-8.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
PLAUSIBLE_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)
ANY_PROMPT = st.one_of(TEXT.map(lambda t: pb.Prompt(text=t)), st.just(pb.Prompt()),
                       st.lists(st.one_of(st.integers(-3, 600), INT64), max_size=30).map(
                           lambda i: pb.Prompt(token_ids=pb.TokenIds(ids=i))))
PLAUSIBLE_PROMPT = st.one_of(PLAUSIBLE_TEXT.map(lambda t: pb.Prompt(text=t)),
                             st.lists(st.integers(0, 511), min_size=1, max_size=20).map(
                                 lambda i: pb.Prompt(token_ids=pb.TokenIds(ids=i))))


@st.composite
def _generate_request(draw) -> pb.GenerateRequest:
    if draw(st.booleans()):
        return pb.GenerateRequest(prompts=draw(st.lists(PLAUSIBLE_PROMPT, min_size=1, max_size=3)),
                                  params=draw(_params(True)))
    return pb.GenerateRequest(prompts=draw(st.lists(ANY_PROMPT, max_size=6)), params=draw(_params(False)))


def _as_mii(value) -> mii_pb.Value:
    if isinstance(value, bool):
        return mii_pb.Value(bvalue=value)
    if isinstance(value, int):
        return mii_pb.Value(ivalue=value) if -2**63 <= value < 2**63 else mii_pb.Value(svalue=str(value))
    if isinstance(value, float):
        return mii_pb.Value(fvalue=value)
    return mii_pb.Value(svalue=str(value))


MII_VALUE = st.recursive(
    st.one_of(TEXT.map(lambda s: mii_pb.Value(svalue=s)), INT64.map(lambda i: mii_pb.Value(ivalue=i)),
              st.floats(width=32, allow_nan=True, allow_infinity=True).map(lambda f: mii_pb.Value(fvalue=f)),
              st.booleans().map(lambda b: mii_pb.Value(bvalue=b)), st.just(mii_pb.Value())),
    lambda inner: st.dictionaries(TEXT, inner, max_size=2).map(
        lambda d: mii_pb.Value(mvalue=mii_pb.Dictionary(values=d))), max_leaves=3)


@st.composite
def _mii_request(draw) -> mii_pb.MultiStringRequest:
    """MII's request: query_kwargs are the typed fields' values as MII sends them; a hostile one
    also gets junk keys and values, and may have any prompts."""
    plausible = draw(st.booleans())
    params = draw(_params(plausible))
    kwargs = {f.name: _as_mii(getattr(params, f.name)) for f in params.DESCRIPTOR.fields
              if not f.is_repeated and params.HasField(f.name)}
    if params.stop:
        kwargs["stop"] = mii_pb.Value(svalue=params.stop[0])
    if plausible:
        return mii_pb.MultiStringRequest(request=draw(st.lists(PLAUSIBLE_TEXT, min_size=1, max_size=3)),
                                         query_kwargs=kwargs)
    kwargs.update(draw(st.dictionaries(st.one_of(st.sampled_from(SamplingParams.field_names()), TEXT), MII_VALUE,
                                       max_size=3)))
    return mii_pb.MultiStringRequest(request=draw(st.lists(TEXT, max_size=6)), query_kwargs=kwargs)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_requests_get_ok_or_a_client_error(served, data):
    kind = data.draw(st.sampled_from(["Generate", "GenerateStream", "GeneratorReply", "GeneratorReplyStream"]))
    if kind.startswith("Generate"):
        request = data.draw(_generate_request())
        method = served.typed.Generate if kind == "Generate" else served.typed.GenerateStream
    else:
        request = data.draw(_mii_request())
        method = served.mii.GeneratorReply if kind == "GeneratorReply" else served.mii.GeneratorReplyStream
    code, details, _ = _status(lambda: list(method(request, timeout=60)) if kind.endswith("Stream")
                               else method(request, timeout=60))
    event(f"{kind}: {code.name}")
    assert code == grpc.StatusCode.OK or code in ACCEPTABLE, (kind, request, code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert details, "a rejection must say what was wrong"


def test_server_serves_after_the_fuzz(served):
    _still_serves(served)


# Bounds ---------------------------------------------------------------------------------------

def _typed(prompts, **gen):
    return pb.GenerateRequest(prompts=[pb.Prompt(text=p) for p in prompts], params=pb.SamplingParams(**gen))


def test_request_bounds_are_invalid_argument_naming_the_field(served):
    for call, expected in (
        (lambda: served.typed.Generate(_typed(["a"] * 5)), "prompts: a request may carry at most 4 prompts, got 5"),
        (lambda: served.typed.Generate(_typed(["a"], n=4)), "n must be <= 3 on this server, got 4"),
        (lambda: list(served.typed.GenerateStream(_typed(["a"] * 3, n=3))),
         "n: this request needs 9 sequences (prompts x n) but the server admits at most 8 at a time"),
        (lambda: served.mii.GeneratorReply(mii_pb.MultiStringRequest(request=["a"] * 5)),
         "request: a request may carry at most 4 prompts, got 5"),
    ):
        code, details, trailers = _status(call)
        assert (code, details, trailers.get(ERROR_TYPE_KEY)) == (grpc.StatusCode.INVALID_ARGUMENT, expected,
                                                                   "ValueError")
    code, details, _ = _status(lambda: served.typed.Generate(_typed(["x" * 20000])))  # over max_body_bytes
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
    _still_serves(served)


def test_pending_bound_is_resource_exhausted_with_a_retry_hint_and_released(roomy):
    served = roomy
    long = dict(ignore_eos=True, max_new_tokens=400, do_sample=False)
    calls = [served.typed.GenerateStream(_typed(["busy"], n=3, **long)) for _ in range(2)]  # 6 of 8 sequences
    streams = [iter(call) for call in calls]
    for stream in streams:
        next(stream)  # admitted and generating
    assert served.pending == 6
    code, details, trailers = _status(lambda: served.typed.Generate(_typed(["one", "more", "too"])))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 8 pending sequences (6 in flight)" in details
    assert trailers[RETRY_AFTER_KEY] == "1000"
    mii = mii_pb.MultiStringRequest(request=["a"], query_kwargs={"n": mii_pb.Value(ivalue=3)})
    assert _status(lambda: served.mii.GeneratorReply(mii))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Two more still fit; a finished call gives its place back before its answer arrives.
    assert served.typed.Generate(_typed(["a", "b"], max_new_tokens=2)).completions[1].generated_length == 2
    assert served.pending == 6
    calls[0].cancel()  # cancellation releases too
    deadline = time.monotonic() + 10
    while served.pending != 3:
        assert time.monotonic() < deadline, served.pending
        time.sleep(0.02)
    assert served.typed.Generate(_typed(["a"], n=3, max_new_tokens=2)).completions[2].generated_length == 2
    calls[1].cancel()
    _still_serves(served)


# Engine faults --------------------------------------------------------------------------------

def _mii(prompts, **gen):
    return mii_pb.MultiStringRequest(request=prompts, query_kwargs={k: mii_pb.Value(ivalue=v) for k, v in gen.items()})


def test_an_engine_fault_after_admission_is_internal_never_invalid_argument(served, monkeypatch):
    step = served.engine.step

    def failing_step():
        raise ValueError("injected step failure")  # a ValueError, yet not the client's fault

    calls = {
        "Generate": lambda: served.typed.Generate(_typed(["a", "b"], max_new_tokens=5)),
        "GenerateStream": lambda: list(served.typed.GenerateStream(_typed(["a"], max_new_tokens=5))),
        "GeneratorReply": lambda: served.mii.GeneratorReply(_mii(["a", "b"], max_new_tokens=5)),
        "GeneratorReplyStream": lambda: list(served.mii.GeneratorReplyStream(_mii(["a"], max_new_tokens=5))),
    }
    for name, call in calls.items():
        monkeypatch.setattr(served.engine, "step", failing_step)
        code, details, trailers = _status(call)
        monkeypatch.setattr(served.engine, "step", step)
        assert code == grpc.StatusCode.INTERNAL, (name, code, details)
        assert "injected step failure" in details and ERROR_TYPE_KEY not in trailers
        _still_serves(served)


def test_a_stopped_engine_is_unavailable(tiny_checkpoints):
    backend = _engine_loop(tiny_checkpoints["llama"])
    server = GrpcServer("127.0.0.1", 0, backend=backend, limits=LIMITS)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            typed = pb_grpc.FastGenStub(channel)

            def dead_rank():
                raise TensorParallelError("rank 1 died")

            backend.engine.step = dead_rank
            code, details, _ = _status(lambda: list(typed.GenerateStream(_typed(["a"], max_new_tokens=5))))
            assert code == grpc.StatusCode.UNAVAILABLE and "rank 1 died" in details
            code, details, _ = _status(lambda: typed.Generate(_typed(["a"], max_new_tokens=5)))  # a later call
            assert code == grpc.StatusCode.UNAVAILABLE and "the engine failed" in details
    finally:
        server.stop(grace=0)
        backend.close()

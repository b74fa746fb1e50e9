"""One request never fails another: a long stream runs beside every kind of bad request, and beside
requests that fail inside the engine (model, sampler, detokenizer), and ends with all its tokens."""

import threading

import pytest

from fastgen import EngineConfig, SamplingParams
from fastgen.engine import Engine, RequestFailed
from fastgen.engine import EngineLoop, submit_group

NUM_BLOCKS = 96
LONG_PROMPT = [5, 6, 7, 8, 9]
LONG_TOKENS = 120
POISON_TOKEN = 77
"""A prompt starting with this token makes the (patched) model fail for its chunks only."""
POISON_PENALTY = 1.2345
"""A request with this repetition penalty makes the (patched) sampler fail for its row only."""


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    engine = Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], num_kv_blocks=NUM_BLOCKS, block_size=8,
                                 token_budget=48, max_seqs=12, max_length=256, progress=False))
    engine.eos_token_ids = set()
    yield engine
    engine.shutdown()


def _poison(engine, monkeypatch):
    """Faults that only some rows meet, as a late-discovered bad combination or a kernel bug would."""
    execute = engine.executor._execute

    def faulty_execute(chunks):
        if any(chunk.seq.prompt_token_ids[0] == POISON_TOKEN for chunk in chunks):
            raise IndexError("simulated model fault on a poisoned chunk")
        return execute(chunks)

    sample = engine.executor._sample

    def faulty_sample(logits, chunks):
        if any(c.seq.params.repetition_penalty == POISON_PENALTY for c in chunks):
            raise RuntimeError("simulated sampler fault on one row")
        return sample(logits, chunks)

    monkeypatch.setattr(engine.executor, "_execute", faulty_execute)
    monkeypatch.setattr(engine.executor, "_sample", faulty_sample)


def _greedy(**kw):
    return SamplingParams(do_sample=False, **kw)


def test_greedy_with_seed_is_accepted_and_deterministic(engine):
    loop = EngineLoop(engine)
    try:
        plain = [t for d in submit_group(loop, [[3, 4, 5]], _greedy(max_new_tokens=8)) for t in d.token_ids]
        seeded = [t for d in submit_group(loop, [[3, 4, 5]], _greedy(max_new_tokens=8, seed=123)) for t in d.token_ids]
        zero_temp = [t for d in submit_group(loop, [[3, 4, 5]], SamplingParams(temperature=0.0, seed=9, max_new_tokens=8))
                     for t in d.token_ids]
        choices = {}
        for d in submit_group(loop, [[3, 4, 5]], _greedy(max_new_tokens=8, seed=5, n=3)):
            choices.setdefault(d.index, []).extend(d.token_ids)
    finally:
        loop.shutdown()
    assert seeded == plain == zero_temp
    assert len(plain) == 8 and len(set(plain)) > 1  # not a flat-logits model
    assert sorted(choices) == [0, 1, 2] and all(c == plain for c in choices.values())


def test_long_stream_survives_every_bad_request(engine, monkeypatch):
    reference = [t for d in _run_alone(engine, LONG_PROMPT, LONG_TOKENS) for t in d.token_ids]
    _poison(engine, monkeypatch)
    loop = EngineLoop(engine)
    long_tokens: list[int] = []
    long_done = threading.Event()
    errors: dict[str, BaseException] = {}

    def long_client():
        for delta in submit_group(loop, [LONG_PROMPT], _greedy(max_new_tokens=LONG_TOKENS)):
            long_tokens.extend(delta.token_ids)
        long_done.set()

    def expect_rejected(name, prompt, params=None, exc=(ValueError, TypeError)):
        with pytest.raises(exc) as info:
            loop.submit(prompt, params, lambda item: None)  # refused before anything is delivered
        errors[name] = info.value

    def expect_failed(name, prompt, params):
        stream = submit_group(loop, [prompt], params)
        with pytest.raises(RequestFailed) as info:
            list(stream)
        errors[name] = info.value

    def expect_ok(name, prompt, params):
        deltas = list(submit_group(loop, [prompt], params))
        assert deltas[-1].finish_reason in ("stop", "length"), name
        return deltas

    thread = threading.Thread(target=long_client)
    thread.start()
    try:
        # Admission errors: raised in the caller, never seen by the engine.
        expect_rejected("vocab", [10**6])
        expect_rejected("empty", [])
        expect_rejected("type", 3.5)
        expect_rejected("too long", list(range(1, 300)), _greedy(max_new_tokens=2))
        expect_rejected("huge text", "x" * 5_000_000)
        expect_rejected("stop id", [1, 2], SamplingParams(stop_token_ids=[10**7]))
        # Valid but unusual: all must work beside the stream.
        expect_ok("greedy+seed", [3, 4, 5], _greedy(max_new_tokens=4, seed=1))
        expect_ok("n+seed", [3, 4, 5], SamplingParams(max_new_tokens=4, seed=1, n=3, temperature=0.8))
        expect_ok("greedy n+seed", [3, 4, 5], _greedy(max_new_tokens=4, seed=7, n=2))
        stopped = expect_ok("stop mid-token", [3, 4, 5], _greedy(max_new_tokens=30, stop=["e"]))
        assert "e" not in "".join(d.generated_text for d in stopped)
        # Aborted while its steps run.
        aborted = submit_group(loop, [[3, 4, 5] * 4], _greedy(max_new_tokens=200))
        first = next(iter(aborted))
        aborted.abort()
        assert [d.finish_reason for d in aborted][-1] == "abort" and first.finish_reason == "none"
        # Failures inside the engine: only the guilty request ends, with a server error.
        expect_failed("model fault", [POISON_TOKEN, 4, 5], _greedy(max_new_tokens=4))
        expect_failed("sampler fault", [3, 4, 5], _greedy(max_new_tokens=4, repetition_penalty=POISON_PENALTY))
        expect_failed("sampler fault n", [3, 4, 5], SamplingParams(max_new_tokens=4, n=2,
                                                                    repetition_penalty=POISON_PENALTY))
        assert not long_done.is_set(), "the long stream ended before the bad requests ran beside it"
    finally:
        thread.join(120)
        loop.shutdown()
    assert long_tokens == reference  # every token, the same as without any bad neighbour
    for name in ("model fault", "sampler fault", "sampler fault n"):
        assert isinstance(errors[name], RequestFailed) and "failed in the engine" in str(errors[name])
        assert not isinstance(errors[name], (ValueError, TypeError))  # a server error, not the caller's
    assert "outside the vocabulary" in str(errors["vocab"])
    assert "characters" in str(errors["huge text"])
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS  # nothing leaked
    assert not engine.requests


def _run_alone(engine, prompt, n):
    """The long stream alone, as the reference for its tokens."""
    loop = EngineLoop(engine)
    try:
        return list(submit_group(loop, [prompt], _greedy(max_new_tokens=n)))
    finally:
        loop.shutdown()


def test_detokenizer_fault_fails_only_its_request(engine):
    healthy = engine.add_request([3, 4, 5], _greedy(max_new_tokens=6))
    broken = engine.add_request([3, 4, 6], _greedy(max_new_tokens=6))

    class Exploding:
        def append(self, token):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated decoder fault")

    engine.requests[broken][0].stream = Exploding()
    deltas = []
    while engine.has_unfinished():
        step = engine.step()
        failures = {d.request_id: d.error for d in step if d.error is not None}
        deltas += [d for d in step if d.error is None]
        if failures:
            assert list(failures) == [broken]
            assert isinstance(failures[broken], RequestFailed) and "detokenizing" in str(failures[broken])
    mine = [d for d in deltas if d.request_id == healthy]
    assert mine[-1].finish_reason == "length" and mine[-1].generated_length == 6
    assert all(d.request_id != broken for d in deltas)


def test_pipeline_call_raises_only_for_its_own_failed_request(tiny_checkpoints, monkeypatch):
    import fastgen

    pipe = fastgen.pipeline(tiny_checkpoints["llama"], num_kv_blocks=32, block_size=8, progress=False)
    try:
        _poison(pipe.engine, monkeypatch)
        stream = pipe.stream([[5, 6, 7]], do_sample=False, max_new_tokens=20, ignore_eos=True)
        first = next(stream)
        with pytest.raises(RequestFailed, match="sampling"):
            pipe([[3, 4, 5]], do_sample=False, max_new_tokens=3, repetition_penalty=POISON_PENALTY)
        rest = list(stream)
        assert (first.generated_length, rest[-1].generated_length) == (1, 20)
        assert pipe([[3, 4, 5]], do_sample=False, max_new_tokens=3, seed=4)[0].generated_length == 3
    finally:
        pipe.destroy()

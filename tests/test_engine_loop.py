"""The background engine loop: many threads and asyncio tasks share one engine."""

import asyncio
import threading

import pytest
import transformers
import torch

from fastgen import EngineConfig, SamplingParams
from fastgen.engine import Engine
from fastgen.engine import EngineLoop, RequestGroup, submit_group

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def loop(tiny_checkpoints):
    engine = Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], num_kv_blocks=NUM_BLOCKS, block_size=8,
                                 token_budget=32, max_seqs=8, progress=False))
    engine.eos_token_ids = set()
    loop = EngineLoop(engine)
    yield loop
    loop.shutdown()


def _hf_greedy(path, prompt, n):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return ids[0, len(prompt):].tolist()


def test_concurrent_threads_get_their_own_correct_outputs(loop, tiny_checkpoints):
    prompts = [[5 + i, 40 + 3 * i, 7, 99 + i][: 1 + i % 4] + [11] * i for i in range(8)]
    results = {}

    def client(i):
        stream = submit_group(loop, [prompts[i]], SamplingParams(do_sample=False, max_new_tokens=12))
        results[i] = [t for delta in stream for t in delta.token_ids]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, prompt in enumerate(prompts):
        assert results[i] == _hf_greedy(tiny_checkpoints["llama"], prompt, 12)


def test_bad_request_raises_in_caller_and_loop_keeps_serving(loop):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        loop.submit([10**6], None, lambda item: None)
    stream = submit_group(loop, [[5, 6, 7]], SamplingParams(do_sample=False, max_new_tokens=3))
    deltas = list(stream)
    assert deltas[-1].finish_reason == "length" and deltas[-1].generated_length == 3


def test_abort_frees_blocks_and_ends_stream(loop):
    stream = submit_group(loop, [[5, 6, 7] * 10], SamplingParams(do_sample=False, max_new_tokens=400))
    first = next(iter(stream))
    assert first.finish_reason == "none"
    stream.abort()
    rest = list(stream)
    assert rest and rest[-1].finish_reason == "abort"
    next(iter(submit_group(loop, [[1, 2]], SamplingParams(max_new_tokens=1))))  # a round trip through the loop
    assert loop.engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_asyncio_clients(loop, tiny_checkpoints):
    async def one(prompt):
        group = RequestGroup(asynchronous=True)
        params = SamplingParams(do_sample=False, max_new_tokens=6)
        await group.submit_each_async([prompt], lambda p, sink: loop.submit_async(p, params, sink), "prompt")
        return [t async for delta in group for t in delta.token_ids]

    async def main():
        return await asyncio.gather(*(one([20 + i, 30, 40]) for i in range(4)))

    outs = asyncio.run(main())
    for i, out in enumerate(outs):
        assert out == _hf_greedy(tiny_checkpoints["llama"], [20 + i, 30, 40], 6)


def test_loop_stepped_by_the_calling_thread_serves_client_threads(tiny_checkpoints):
    # What scripts/serve.py does: the main thread steps (EngineLoop.run), clients submit from threads.
    engine = Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], num_kv_blocks=NUM_BLOCKS, block_size=8,
                                 token_budget=32, max_seqs=8, progress=False))
    engine.eos_token_ids = set()
    loop = EngineLoop(engine, thread=False)
    prompts = [[5 + i, 40 + 3 * i, 7][: 1 + i % 3] + [11] * i for i in range(4)]
    results, done = {}, threading.Event()

    def clients():
        try:
            for i, prompt in enumerate(prompts):
                stream = submit_group(loop, [prompt], SamplingParams(do_sample=False, max_new_tokens=6))
                results[i] = [t for delta in stream for t in delta.token_ids]
            # Left open when run() returns: it must end with an error, not hang.
            results["open"] = submit_group(loop, [prompts[0]], SamplingParams(do_sample=False, max_new_tokens=10_000))
        finally:
            done.set()

    threading.Thread(target=clients, daemon=True).start()
    loop.run(done.is_set, interval=0.05)
    assert loop.stopped
    for i, prompt in enumerate(prompts):
        assert results[i] == _hf_greedy(tiny_checkpoints["llama"], prompt, 6)
    with pytest.raises(RuntimeError, match="stopped"):
        list(results["open"])
    with pytest.raises(RuntimeError, match="shut down"):
        loop.submit(prompts[0], SamplingParams(max_new_tokens=2), lambda item: None)
    loop.shutdown()


def test_run_refuses_a_loop_that_has_its_own_thread(loop):
    with pytest.raises(RuntimeError, match="own thread"):
        loop.run(lambda: True)


def test_start_builds_and_steps_the_engine_on_one_thread(tiny_checkpoints):
    # What a Ray replica does: the thread that built the engine (and ran its warm-up) is the one that
    # steps it and runs its calls, so no second thread leads OpenMP regions.
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        engine = Engine.from_config(EngineConfig(model=tiny_checkpoints["llama"], num_kv_blocks=NUM_BLOCKS,
                                                 block_size=8, token_budget=32, max_seqs=8, progress=False))
        engine.eos_token_ids = set()
        return engine

    loop = EngineLoop.start(build)
    try:
        assert built_on[0] is not threading.current_thread()
        assert loop.call(lambda engine: threading.current_thread()).result(10) is built_on[0]
        prompt = [5, 40, 7, 11]
        stream = submit_group(loop, [prompt], SamplingParams(do_sample=False, max_new_tokens=6))
        assert [t for delta in stream for t in delta.token_ids] == _hf_greedy(tiny_checkpoints["llama"], prompt, 6)
        with pytest.raises(RuntimeError, match="own thread"):
            loop.run(lambda: True)
    finally:
        loop.shutdown()
    assert not built_on[0].is_alive() and loop.stopped


def test_start_reraises_a_failed_build_and_leaves_no_thread():
    def build():
        raise ValueError("no such checkpoint")

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="no such checkpoint"):
        EngineLoop.start(build)
    assert "fastgen-engine-loop" not in {t.name for t in threading.enumerate()} - before

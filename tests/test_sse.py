"""Streamed events coalesced into fewer writes (`fastgen.serving.http.sse.coalesce`, the Ray app's
`stream_interval_ms`): the first event alone, later ones joined per interval, nothing lost or reordered,
the source closed with the stream, and the official `openai` client reading the joined writes."""

import asyncio

import httpx
import openai
import pytest

from fastgen.serving.http.app import create_app
from fastgen.serving.http.sse import coalesce
from rest_server import serve


async def _source(plan: list[tuple[float, str]], log: list[str]):
    """Yield each text after its delay; `log` records "closed" when the generator is closed or ends."""
    try:
        for delay, text in plan:
            await asyncio.sleep(delay)
            yield text
    finally:
        log.append("closed")


async def _collect(plan, interval):
    log: list[str] = []
    return [chunk async for chunk in coalesce(_source(plan, log), interval)], log


def test_first_event_alone_then_one_write_per_interval():
    plan = [(0, "a"), (0.01, "b"), (0.01, "c"), (0.6, "d"), (0, "e")]
    writes, log = asyncio.run(_collect(plan, 0.3))
    assert writes == ["a", "bc", "de"] and log == ["closed"]
    assert asyncio.run(_collect(plan, 0))[0] == ["a", "b", "c", "d", "e"]  # 0: every event as it comes
    assert asyncio.run(_collect([], 0.3))[0] == []


def test_closing_the_stream_closes_the_source_and_errors_reach_the_reader():
    async def close_early():
        log: list[str] = []
        stream = coalesce(_source([(0, "a"), (5, "never")], log), 0.1)
        assert await stream.__anext__() == "a"
        await stream.aclose()  # a client gone: the source is closed, not left waiting 5 s
        return log

    assert asyncio.run(close_early()) == ["closed"]

    async def failing():
        yield "a"
        raise RuntimeError("source broke")

    async def read():
        return [chunk async for chunk in coalesce(failing(), 0.1)]

    with pytest.raises(RuntimeError, match="source broke"):
        asyncio.run(read())


def test_server_streams_joined_events_that_the_openai_client_reads(tiny_checkpoints):
    engine = dict(num_kv_blocks=64, block_size=8, token_budget=32, max_seqs=8, progress=False)
    with serve(tiny_checkpoints["llama"], "tiny", engine, stream_interval_ms=300) as served:
        served.engine.eos_token_ids = set()
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none")
        whole = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0)
        chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=24,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as response:
            writes = list(response.iter_raw())
        events = b"".join(writes).count(b"data: ")
        assert events > 10 and b"".join(writes).endswith(b"data: [DONE]\n\n")
        assert writes[0].count(b"data: ") == 1 and len(writes) < events / 2  # the first alone, the rest joined


def test_stream_interval_is_checked(tiny_checkpoints):
    for bad in (-1, 20_000, "50", True):
        with pytest.raises(ValueError, match="stream_interval_ms"):
            create_app(object.__new__(type("B", (), {"submit_async": lambda *a: None})), "d", None, "m",
                       stream_interval_ms=bad)

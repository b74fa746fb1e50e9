"""Server-sent events sent in fewer, larger writes: `coalesce`.

Every write of a streamed response costs the same whatever its size, and behind a proxy it costs
more: under Ray Serve each write is a message from the replica's actor to the proxy's, which on a
small machine shares the cores with the engine. `coalesce` sends a stream's first event at once (the
time to first token is untouched) and after it everything that arrives within `interval` seconds as
one write, as Ray Serve LLM's `stream_batching_interval_ms` does for vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

_END = object()


async def coalesce(chunks: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """`chunks` with those that arrive within `interval` seconds of a write joined into it, the first alone;
    `interval <= 0` passes them through. Closing the result (a client gone) closes `chunks`."""
    if interval <= 0:
        async for chunk in chunks:
            yield chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for chunk in chunks:
                queue.put_nowait(chunk)
        finally:
            queue.put_nowait(_END)

    task = asyncio.create_task(pump())
    loop = asyncio.get_running_loop()
    try:
        chunk = await queue.get()
        if chunk is _END:
            return
        yield chunk
        while True:
            chunk = await queue.get()
            if chunk is _END:
                break
            parts, deadline = [chunk], loop.time() + interval
            while (left := deadline - loop.time()) > 0:
                try:
                    chunk = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    break
                if chunk is _END:
                    yield "".join(parts)
                    return
                parts.append(chunk)
            yield "".join(parts)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # re-raises what `chunks` raised, if anything did

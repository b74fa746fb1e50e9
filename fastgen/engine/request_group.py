"""The prompts of one call, submitted together and read as one stream: `RequestGroup`.

Every caller that runs prompts as one call (the pipeline's calls and streams, the gRPC services,
the REST gateway; locally or through the replica router) builds one group. Each prompt's request
delivers into the group's one inbox through its sink (`group.sink(i)`), so the deltas of all
prompts interleave as they are produced with no thread or task per prompt. The group stamps each
delta with its `prompt_index`, puts the `return_full_text` prefix on the first delta of every
completion (so a completion's deltas add up to its final text), merges them into final responses
(`merge_deltas`), and aborts every request when the reader leaves early or one of them fails.

A request's producer (`EngineLoop`, the replica router, the pipeline, each through its
`Deliveries`) calls its sink, on any thread, with each `Response`, then the exception if the
request failed, then `END`. The group has
two faces over the same inbox logic: `for delta in group` blocks (or, given `drive`, steps an
engine on the reading thread while nothing is ready), `async for delta in group` awaits.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from fastgen.outputs import Response
from fastgen.sampling_params import FieldError, SamplingParams, field_error

__all__ = ["END", "Member", "RequestGroup", "Sink", "Submitter", "full_text_prefix", "merge_deltas", "submit_group"]

END = object()
"""What a request's producer delivers last: the request will deliver nothing more."""

Sink = Callable[[Any], None]
"""Where one request's producer delivers: each `Response`, then its exception if it failed, then `END`."""

Prompt = str | list[int]


class Member(Protocol):
    """One submitted request of a group."""

    request_id: str

    def abort(self) -> None:
        """Cancel the request (from any thread; a finished one ignores it)."""


class Submitter(Protocol):
    """What takes one prompt's request and delivers its deltas to a sink: an `EngineLoop`, a
    serving backend (the replica router)."""

    tokenizer: Any

    def submit(self, prompt: Any, params: SamplingParams | None, deliver: Sink, lora: str | None = None) -> Member:
        """Queue the request, run under the LoRA adapter `lora` (None: the base model), raising
        ValueError/TypeError if it is refused, and return it."""


def merge_deltas(deltas: Iterable[Response]) -> list[Response]:
    """Concatenate streamed deltas into one final Response per (prompt_index, index), in that order."""
    merged: dict[tuple[int, int], Response] = {}
    for delta in deltas:
        key = (delta.prompt_index, delta.index)
        done = merged.get(key)
        if done is None:
            merged[key] = Response(
                generated_text=delta.generated_text, prompt_length=delta.prompt_length,
                generated_length=delta.generated_length, finish_reason=delta.finish_reason,
                token_ids=list(delta.token_ids), logprobs=None if delta.logprobs is None else list(delta.logprobs),
                prompt_logprobs=delta.prompt_logprobs, index=delta.index, prompt_index=delta.prompt_index,
                num_cached_tokens=delta.num_cached_tokens, request_id=delta.request_id,
            )
            continue
        done.generated_text += delta.generated_text
        done.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            done.logprobs = (done.logprobs or []) + list(delta.logprobs)
        if delta.prompt_logprobs is not None:
            done.prompt_logprobs = delta.prompt_logprobs
        done.generated_length = delta.generated_length
        done.finish_reason = delta.finish_reason
        done.num_cached_tokens = delta.num_cached_tokens
    return [merged[key] for key in sorted(merged)]


def full_text_prefix(tokenizer: Any, prompt: Prompt, params: SamplingParams) -> str:
    """The text `return_full_text` puts before a completion: the prompt's tokens the engine keeps
    (after `truncate_prompt_tokens`) decoded without special tokens. Blocking tokenizer work: an
    event loop runs it on a worker."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    if params.truncate_prompt_tokens is not None:
        ids = ids[-params.truncate_prompt_tokens:]
    return tokenizer.decode(ids, skip_special_tokens=True)


def _prompt_error(exc: ValueError | TypeError, field: str, index: int, count: int) -> ValueError | TypeError:
    """The error of a refused prompt as the caller sees it: a FieldError naming `field` (and, for one
    of several prompts, `field[index]` in its message). An error of a generation parameter (it names
    its own field, e.g. `stop_token_ids` outside the vocabulary) is about no one prompt: kept as is."""
    if isinstance(exc, FieldError) and exc.field is not None:
        return exc
    return field_error(exc, field, f"{field}[{index}]: {exc}" if count > 1 else None)


class RequestGroup:
    """The requests of one call (one per prompt, each with `num_choices` completions), read as one
    stream of deltas: `for` / `async for` yields them as produced, `results()` the merged finals.

    Build it where it will be read (`asynchronous=True` inside the event loop that reads it), submit
    with `submit_each` / `submit_each_async` (or `sink` + `add`), then read it once. Leaving the
    iteration early, or a failure of any request, aborts them all; a failure is raised once every
    request has ended. `abort()` may be called from any thread. `drive`, for a reader that steps the
    engine itself (the pipeline), is called whenever the inbox is empty. `prefixes` (one per prompt)
    go before the first delta of each of its completions (`return_full_text`).
    """

    def __init__(self, num_choices: int = 1, *, asynchronous: bool = False, drive: Callable[[], None] | None = None,
                 prefixes: Sequence[str] | None = None) -> None:
        self.members: list[Member] = []
        self._num_choices = num_choices
        self._drive = drive
        self._aio = asyncio.get_running_loop() if asynchronous else None
        self._inbox: asyncio.Queue | queue.SimpleQueue = asyncio.Queue() if asynchronous else queue.SimpleQueue()
        self._ended: set[int] = set()
        self._error: BaseException | None = None
        self._prefixes: dict[tuple[int, int], str] = {}
        if prefixes is not None:
            self.set_prefixes(prefixes)

    @property
    def request_ids(self) -> list[str]:
        """The engine's id of each prompt's request, in prompt order."""
        return [m.request_id for m in self.members]

    def set_prefixes(self, prefixes: Sequence[str]) -> None:
        """Put `prefixes[i]` before the first delta of every completion of prompt i (before reading)."""
        self._prefixes = {(i, choice): text for i, text in enumerate(prefixes) if text
                          for choice in range(self._num_choices)}

    # Submission ---------------------------------------------------------------------------------

    def sink(self, index: int) -> Sink:
        """Where prompt `index`'s request delivers (thread-safe; see the module's docstring)."""
        inbox, aio = self._inbox, self._aio
        if aio is None:
            return lambda item: inbox.put((index, item))

        def deliver(item: Any) -> None:
            try:
                aio.call_soon_threadsafe(inbox.put_nowait, (index, item))
            except RuntimeError:  # the reader's event loop is closed: nobody will read this group
                self.abort()

        return deliver

    def add(self, member: Member) -> None:
        """Record the request submitted with `sink(len(self.members))`."""
        self.members.append(member)

    def submit_each(self, prompts: Sequence[Any], submit: Callable[[Any, Sink], Member], field: str) -> None:
        """`submit(prompt, sink)` for every prompt, in order. If one is refused (ValueError/TypeError)
        the others are aborted and its error is raised as a FieldError naming `field` (and, for one
        of several prompts, `field[i]` in its message; an error naming a generation parameter's
        field is raised as it is); any other exception aborts them too and propagates."""
        try:
            for i, prompt in enumerate(prompts):
                try:
                    self.add(submit(prompt, self.sink(i)))
                except (ValueError, TypeError) as exc:
                    raise _prompt_error(exc, field, i, len(prompts))
        except BaseException:
            self.abort()
            raise

    async def submit_each_async(self, prompts: Sequence[Any], submit: Callable[[Any, Sink], Awaitable[Member]],
                                field: str) -> None:
        """`submit_each` for a coroutine `submit`."""
        try:
            for i, prompt in enumerate(prompts):
                try:
                    self.add(await submit(prompt, self.sink(i)))
                except (ValueError, TypeError) as exc:
                    raise _prompt_error(exc, field, i, len(prompts))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Abort every request that has not ended (from any thread)."""
        for index, member in enumerate(list(self.members)):
            if index not in self._ended:
                member.abort()

    # Reading ------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Response]:
        for batch in self.batches():
            yield from batch

    def batches(self) -> Iterator[list[Response]]:
        """The deltas in batches: each is every delta that had arrived when the previous one was taken."""
        try:
            while len(self._ended) < len(self.members):
                batch = self._take(self._get(), self._inbox.get_nowait)
                if batch:
                    yield batch
            if self._error is not None:
                raise self._error
        finally:
            self.abort()

    def results(self) -> list[Response]:
        """Read to the end: one merged Response per completion, by prompt, then choice."""
        return merge_deltas(self)

    async def __aiter__(self) -> AsyncIterator[Response]:
        try:
            while len(self._ended) < len(self.members):
                for delta in self._take(await self._inbox.get(), self._inbox.get_nowait):
                    yield delta
            if self._error is not None:
                raise self._error
        finally:
            self.abort()

    def _get(self) -> tuple[int, Any]:
        if self._drive is None:
            return self._inbox.get()
        while True:
            try:
                return self._inbox.get_nowait()
            except queue.Empty:
                self._drive()

    def _take(self, item: tuple[int, Any], more: Callable[[], tuple[int, Any]]) -> list[Response]:
        """`item` and whatever else is in the inbox now, as a batch of stamped deltas (none once a
        request has failed: the group is then only waiting for its requests to end)."""
        batch = []
        while True:
            index, payload = item
            if payload is END:
                self._ended.add(index)
            elif isinstance(payload, BaseException):
                if self._error is None:
                    self._error = payload
                    self.abort()
            elif self._error is None:
                payload.prompt_index = index
                prefix = self._prefixes.pop((index, payload.index), None)
                if prefix is not None:
                    payload.generated_text = prefix + payload.generated_text
                batch.append(payload)
            try:
                item = more()
            except (queue.Empty, asyncio.QueueEmpty):
                return batch


def submit_group(submitter: Submitter, prompts: Sequence[Prompt], params: SamplingParams,
                 field: str = "prompts", lora: str | None = None) -> RequestGroup:
    """Submit every prompt (each validated by the engine; a refused one aborts the others and raises
    its error naming `field[i]`) as one group to read, with the `return_full_text` prefixes, under the
    LoRA adapter `lora` (None: the base model). Blocking."""
    group = RequestGroup(params.n)
    group.submit_each(prompts, lambda prompt, sink: submitter.submit(prompt, params, sink, lora=lora), field)
    if params.return_full_text:
        try:
            group.set_prefixes([full_text_prefix(submitter.tokenizer, p, params) for p in prompts])
        except BaseException:
            group.abort()
            raise
    return group

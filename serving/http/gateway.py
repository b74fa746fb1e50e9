"""Between the REST routes and the engine backend: admission, preparation, submission, accounting.

The `Gateway` admits a request against `ServingLimits` (prompts per request, `n`, sequences in
flight), prepares its prompts off the event loop (chat templates, tokenizing when the context
check needs the prompt's length), submits one engine request per prompt as one `RequestGroup` and
hands back a `Generation`: the group's deltas, counted in the metrics. Errors are sorted by whose fault they are: the
caller's (400), the server's capacity (429), the engine's stop (503), or an engine failure of this
one request (500).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from fastgen.engine import (Member, RequestFailed, RequestGroup, Sink, UnknownLoRAError, full_text_prefix,
                            max_prompt_chars, merge_deltas)
from fastgen.outputs import Response
from fastgen.sampling_params import SamplingParams
from fastgen.serving.admission import Draining, Overloaded, PendingBudget, shared_budget
from fastgen.serving.http.chat.messages import ChatPrompt, render_chat
from fastgen.serving.http.guard import ApiError, Offload
from fastgen.serving.limits import ServingLimits
from fastgen.serving.metrics import ServingMetrics

logger = logging.getLogger("fastgen")

Prompt = str | list[int] | ChatPrompt
"""What a route hands the gateway per engine request: text, token ids, or a chat to render."""


class Generation:
    """The engine requests of one HTTP request (a `RequestGroup`: one per prompt), read as one
    stream of deltas and counted in the metrics.

    Iterate it once with `async for`; each delta's `prompt_index` names its prompt. `close()`
    aborts whatever is unfinished and gives the admission slots back; it is idempotent and runs by
    itself when the iteration ends or is cancelled.
    """

    def __init__(self, gateway: Gateway, group: RequestGroup, num_sequences: int, started: float,
                 prompt_token_ids: list[list[int] | None], release: Callable[[], None]) -> None:
        self.num_sequences = num_sequences
        self.prompt_token_ids = prompt_token_ids
        """Per prompt, the token ids the engine was given (after `truncate_prompt_tokens`), where the
        gateway tokenized it (`Gateway.start(keep_ids=True)`); None where the engine tokenizes."""
        self._gateway = gateway
        self._group = group
        self._release = release
        self._started = started
        self._first_token: dict[tuple[int, int], float] = {}
        self._last_token: dict[tuple[int, int], float] = {}
        self._prompts_seen: set[int] = set()
        self._num_finished = 0
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[Response]:
        try:
            async for delta in self._group:
                self._observe(delta)
                yield delta
        finally:
            self.close()

    def _observe(self, delta: Response) -> None:
        now = time.perf_counter()
        metrics = self._gateway.metrics
        if delta.prompt_index not in self._prompts_seen:
            self._prompts_seen.add(delta.prompt_index)
            metrics.count_prompt_tokens(delta.prompt_length)
        key = (delta.prompt_index, delta.index)
        if delta.token_ids:
            metrics.count_generation_tokens(len(delta.token_ids))
            last = self._last_token.get(key)
            if last is None:
                self._first_token[key] = now
                metrics.observe_first_token(now - self._started)
            else:
                metrics.observe_inter_token(now - last)
            self._last_token[key] = now
        if delta.finish_reason != "none":
            self._num_finished += 1
            metrics.count_finished(delta.finish_reason)
            first = self._first_token.get(key)
            if first is not None and delta.generated_length > 1:
                metrics.observe_time_per_output_token((now - first) / (delta.generated_length - 1))
            if self._num_finished == self.num_sequences:
                metrics.observe_request_latency(now - self._started)

    def close(self) -> None:
        """Abort the unfinished choices (if any) and release the admission slots; idempotent."""
        if self._closed:
            return
        self._closed = True
        unfinished = self.num_sequences - self._num_finished
        if unfinished > 0:
            self._group.abort()
            self._gateway.metrics.count_finished("abort", unfinished)
        self._gateway.release(self._release, self.num_sequences)


async def _merged(generation: Generation) -> list[Response]:
    return merge_deltas([delta async for delta in generation])


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def generation_error(exc: BaseException) -> ApiError:
    """The HTTP error for an exception raised while a request generated (not a caller's mistake).

    `RequestFailed` means the engine failed this request only: a 500 for it, the engine serves on.
    Any other RuntimeError from the engine loop means it stopped: 503.
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestFailed):
        logger.error("request failed in the engine: %s", exc)
        return ApiError(500, f"the engine failed this request: {exc}", code="request_failed")
    if isinstance(exc, RuntimeError):
        return ApiError(503, f"generation stopped: {exc}", code="engine_unavailable")
    logger.error("generation failed", exc_info=exc)
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}")


def _refusal(exc: BaseException, prompt_param: str) -> BaseException:
    """The HTTP error for a request refused at submission: 400 for the caller's mistake (naming the
    error's field, else the prompt), 500 for an engine failure of it, 503 for a stopped engine;
    anything else (an ApiError already, a cancellation) as it is; 404 for a LoRA adapter not loaded."""
    if isinstance(exc, UnknownLoRAError):  # unloaded between parsing and queueing: as an unknown model
        return ApiError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, (ValueError, TypeError)):
        return ApiError(400, str(exc), param=getattr(exc, "field", None) or prompt_param)
    if isinstance(exc, RequestFailed):
        return generation_error(exc)
    if isinstance(exc, RuntimeError):
        return ApiError(503, f"the engine is not accepting requests: {exc}", code="engine_unavailable")
    return exc


class Gateway:
    """Admission, preparation, submission and accounting between the HTTP routes and the backend."""

    def __init__(self, backend: Any, tokenizer: Any, metrics: ServingMetrics, limits: ServingLimits,
                 max_model_len: int | None, offload: Offload, budget: PendingBudget | None = None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.limits = limits
        self.max_model_len = max_model_len
        self.offload = offload
        # The engine's own bound, so both refuse the same texts before tokenizing them.
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len) if max_model_len is not None else None
        self.budget = shared_budget(budget, limits.max_pending_requests)
        """Sequences in flight, bounded by `limits.max_pending_requests`; shared with the gRPC server of
        the deployment, so the bound holds for both protocols together."""
        # Sequences (prompts x n) this gateway admitted and not finished; only the event loop touches it.
        self.pending = 0

    async def start(self, prompts: list[Prompt], params: SamplingParams, prompt_param: str,
                    max_tokens_param: str | None = None, *, keep_ids: bool = False,
                    add_special_tokens: bool = True, lora: str | None = None) -> Generation:
        """Admit, prepare and submit one engine request per prompt.

        400 for a request that breaks a bound or that the engine rejects (naming `prompt_param`,
        or `max_tokens_param` when the prompt and that explicit budget do not fit the context
        together), 429 when the server is full, 503 when the engine is stopped. `keep_ids`
        tokenizes every prompt here and keeps the ids the engine gets in
        `Generation.prompt_token_ids` (for echoing the prompt's tokens); `add_special_tokens=False`
        tokenizes text prompts without the tokenizer's BOS. `lora` names the LoRA adapter every prompt
        runs under (None: the base model; one unloaded meanwhile is a 404).
        """
        num_sequences = len(prompts) * params.n
        release = self._admit(len(prompts), params.n, prompt_param)
        started = time.perf_counter()
        group = RequestGroup(params.n, asynchronous=True)
        kept: list[list[int] | None] = []
        truncate = params.truncate_prompt_tokens

        async def submit(prompt: Prompt, sink: Sink) -> Member:
            where = f"{prompt_param}[{len(kept)}]" if len(prompts) > 1 else prompt_param
            prepared = await self._prepare(prompt, params, where, prompt_param, max_tokens_param,
                                           keep_ids or not add_special_tokens, add_special_tokens)
            kept.append(None if isinstance(prepared, str) else prepared[-truncate:] if truncate else prepared)
            return await self.backend.submit_async(prepared, params, sink, lora=lora)

        try:
            await group.submit_each_async(prompts, submit, prompt_param)
            if params.return_full_text:
                group.set_prefixes(await self.offload.run(_full_text_prefixes, self.tokenizer, prompts, params))
        except BaseException as exc:
            group.abort()  # (a refused submission has aborted it already: aborting is idempotent)
            self.release(release, num_sequences)
            refusal = _refusal(exc, prompt_param)
            if refusal is exc:
                raise
            raise refusal from None
        return Generation(self, group, num_sequences, started, kept, release)

    def _admit(self, num_prompts: int, n: int, prompt_param: str) -> Callable[[], None]:
        """Take the request's sequences from the shared budget (before any await, so requests
        preparing concurrently cannot overshoot it); returns their release."""
        num_sequences = num_prompts * n
        try:
            self.limits.check_request_size(num_prompts, n, prompt_param)
            release = self.budget.acquire(num_sequences, "n" if n > 1 else prompt_param)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=getattr(exc, "field", None)) from None
        except Overloaded as exc:
            raise ApiError(429, str(exc), code="too_many_pending_requests",
                           headers={"Retry-After": str(max(1, -(-exc.retry_after_ms // 1000)))}) from None
        except Draining as exc:
            # Connection: close, so a keep-alive client reconnects through its load balancer, elsewhere.
            raise ApiError(503, str(exc), code="draining", headers={"Connection": "close"}) from None
        self.pending += num_sequences
        self.metrics.set_pending(self.pending)
        return release

    async def _prepare(self, prompt: Prompt, params: SamplingParams, where: str, param: str,
                       max_tokens_param: str | None, need_ids: bool, add_special_tokens: bool) -> str | list[int]:
        """The prompt as the engine takes it; tokenizer work runs on `offload`, never on the loop."""
        checked = max_tokens_param is not None and self.max_model_len is not None
        truncate = params.truncate_prompt_tokens
        # A prompt the engine truncates may be longer than the context: only the body limit bounds it then.
        limit = self.max_prompt_chars if truncate is None else None
        if isinstance(prompt, ChatPrompt):
            ids = await self.offload.run(render_chat, self.tokenizer, prompt, limit)
        elif isinstance(prompt, str):
            if limit is not None and len(prompt) > limit:
                raise ApiError(400, f"{where}: prompt has {len(prompt)} characters, more than this model's maximum "
                                    f"context length of {self.max_model_len} tokens can hold (at most {limit} "
                                    "characters)", param=param)
            if not (checked or need_ids or truncate is not None):
                return prompt  # the engine tokenizes it, off this loop too
            # The engine's own tokenization of a text prompt, done here because the check needs its length.
            ids = await self.offload.run(_encode, self.tokenizer, prompt, add_special_tokens)
        else:
            ids = prompt
        if checked:
            kept = min(len(ids), truncate) if truncate is not None else len(ids)
            self._check_context(kept, params.max_new_tokens, where, param, max_tokens_param)
        return ids

    def _check_context(self, num_prompt: int, max_tokens: int, where: str, param: str, max_tokens_param: str) -> None:
        # vLLM's wording, which OpenAI clients and their users already know.
        limit = self.max_model_len
        what = "messages" if param == "messages" else "prompt"
        prefix = f"{where}: " if where != param else ""
        if num_prompt >= limit:
            raise ApiError(400, f"{prefix}This model's maximum context length is {limit} tokens. However, your {what} "
                                f"has {num_prompt} tokens, leaving no room for the completion. Please reduce the "
                                f"length of the {what}.", param=param)
        if num_prompt + max_tokens > limit:
            raise ApiError(400, f"{prefix}This model's maximum context length is {limit} tokens. However, you "
                                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the {what}, "
                                f"{max_tokens} in the completion). Please reduce the length of the {what} or "
                                f"completion ({max_tokens_param}).", param=max_tokens_param)

    def release(self, release: Callable[[], None], num_sequences: int) -> None:
        """Give back a request's admission slots: `release` (from the budget) and its `num_sequences`
        (called once, by `Generation.close` or a refused `start`)."""
        release()
        self.pending -= num_sequences
        self.metrics.set_pending(self.pending)

    async def collect(self, request: Request, generation: Generation) -> list[Response]:
        """Run `generation` to its end: one merged Response per choice. Aborts it if the client disconnects."""
        work = asyncio.ensure_future(_merged(generation))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            generation.close()
        if not work.done():
            raise ApiError(499, "client closed the request before it finished; it was aborted")
        try:
            return work.result()
        except Exception as exc:
            raise generation_error(exc) from None


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    # The engine's own call (`tokenizer.encode(prompt)`) when special tokens are wanted, so its ids match.
    return tokenizer.encode(text) if add_special_tokens else tokenizer.encode(text, add_special_tokens=False)


def _full_text_prefixes(tokenizer: Any, prompts: list[Prompt], params: SamplingParams) -> list[str]:
    # Blocking tokenizer work: run on `offload`. Only MII's route asks for it, with text or ids.
    return [full_text_prefix(tokenizer, p, params) for p in prompts]

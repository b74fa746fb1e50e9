"""What a server serves from: one local engine loop, or the replica router, behind one interface.

A backend has EngineLoop's request interface (`submit`, `submit_async`, `abort`, deltas without
the prompt text) plus what the services need besides generation: the tokenizer, a model summary
and `close`. `PromptsStream` runs the several prompts of one call as one interleaved stream.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import fastgen
from fastgen.engine import EngineLoop
from fastgen.outputs import Response
from fastgen.sampling_params import SamplingParams
from fastgen.serving.convert import Prompt
from fastgen.serving.proto import fastgen_v1_pb2 as pb


class BackendUnavailable(RuntimeError):
    """The backend cannot take or finish a request now (loading, shut down, replica gone)."""


class DeltaStream(Protocol):
    """One submitted request's deltas (EngineLoop's RequestStream and the router's stream)."""

    request_id: str

    def __iter__(self) -> Iterator[Response]: ...

    def abort(self) -> None: ...


class Backend(Protocol):
    """The interface the gRPC services (and the REST gateway) drive."""

    tokenizer: Any

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> DeltaStream: ...

    async def submit_async(self, prompt: Prompt, params: SamplingParams | None = None) -> Any: ...

    def abort(self, request_id: str) -> None: ...

    def model_info(self) -> pb.ModelInfoResponse: ...

    def close(self) -> None: ...


class LocalBackend:
    """One engine in this process, stepped by an `EngineLoop`."""

    def __init__(self, loop: EngineLoop, deployment_name: str = "") -> None:
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        self.deployment_name = deployment_name
        self.submit = loop.submit
        self.submit_async = loop.submit_async
        self.abort = loop.abort

    def model_info(self) -> pb.ModelInfoResponse:
        """The served model, the engine's plan and its configuration."""
        engine = self.engine
        plan = engine.plan
        config = engine.config
        return pb.ModelInfoResponse(
            deployment_name=self.deployment_name, model_dir=str(engine.model_dir),
            model_type=engine.model_config.model_type, max_length=engine.max_model_len,
            vocab_size=engine.vocab_size, dtype=_text(engine.dtype), device=str(engine.device),
            block_size=engine.block_size, num_kv_blocks=engine.block_manager.num_blocks,
            token_budget=plan.token_budget, max_seqs=plan.max_seqs,
            enable_prefix_caching=config.enable_prefix_caching,
            engine_config={f.name: _text(getattr(config, f.name)) for f in dataclasses.fields(config)},
            plan={name: _text(value) for name, value in plan.engine_kwargs().items()},
            plan_reasons=dict(plan.reasons),
            version=fastgen.__version__, in_flight=len(engine.requests),
        )

    def close(self) -> None:
        """Abort everything and stop the engine loop."""
        self.loop.shutdown()


def _text(value: Any) -> str:
    """A config or plan value as ModelInfo shows it (dtypes without the `torch.` prefix)."""
    return str(value).removeprefix("torch.")


def prompt_text(tokenizer: Any, prompt: Prompt) -> str:
    """The prompt as `return_full_text` shows it: its token ids decoded without special tokens."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return tokenizer.decode(ids, skip_special_tokens=True)


_END = object()


class PromptsStream:
    """The deltas of several prompts submitted together, interleaved as they are produced.

    Every prompt is submitted (and validated) before any delta is read; if one is rejected the
    others are aborted and the error names the prompt as `<field>[i]`. Each delta gets its
    `prompt_index`, and with `return_full_text` the first delta of every completion starts with
    the prompt text, so the deltas of a completion always add up to its final text. `abort()` may
    be called from any thread.
    """

    def __init__(self, backend: Backend, prompts: list[Prompt], params: SamplingParams,
                 field: str = "prompts") -> None:
        self._streams: list[DeltaStream] = []
        try:
            for i, prompt in enumerate(prompts):
                try:
                    self._streams.append(backend.submit(prompt, params))
                except (ValueError, TypeError) as exc:
                    if len(prompts) == 1:
                        raise
                    raise type(exc)(f"{field}[{i}]: {exc}") from exc
        except BaseException:
            self.abort()
            raise
        self.request_ids = [s.request_id for s in self._streams]
        self._prefixes = {}
        if params.return_full_text:
            for i, prompt in enumerate(prompts):
                text = prompt_text(backend.tokenizer, prompt)
                self._prefixes.update({(i, choice): text for choice in range(params.n)})

    def __iter__(self) -> Iterator[Response]:
        for batch in self.batches():
            yield from batch

    def batches(self) -> Iterator[list[Response]]:
        """The deltas in batches: each batch is every delta available when the previous one was
        taken. Leaving the iteration early aborts the requests."""
        try:
            for batch in self._interleaved():
                for delta in batch:
                    prefix = self._prefixes.pop((delta.prompt_index, delta.index), None)
                    if prefix is not None:
                        delta.generated_text = prefix + delta.generated_text
                yield batch
        finally:
            self.abort()

    def _interleaved(self) -> Iterator[list[Response]]:
        if len(self._streams) == 1:
            for delta in self._streams[0]:
                yield [delta]
            return
        # One pump thread per prompt: each request has its own blocking delta queue.
        merged: queue.SimpleQueue = queue.SimpleQueue()
        for index, stream in enumerate(self._streams):
            threading.Thread(target=self._pump, args=(index, stream, merged), daemon=True,
                             name=f"fastgen-prompt-{index}").start()
        remaining = len(self._streams)
        error: BaseException | None = None
        while remaining:
            batch = []
            item = merged.get()
            while True:
                if item is _END:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if error is None:
                        error = item
                        self.abort()
                else:
                    batch.append(item)
                try:
                    item = merged.get_nowait()
                except queue.Empty:
                    break
            if batch and error is None:
                yield batch
        if error is not None:
            raise error

    @staticmethod
    def _pump(index: int, stream: DeltaStream, merged: queue.SimpleQueue) -> None:
        try:
            for delta in stream:
                delta.prompt_index = index
                merged.put(delta)
        except BaseException as exc:  # handed to the reading thread, which re-raises it
            merged.put(exc)
        merged.put(_END)

    def abort(self) -> None:
        """Abort every prompt's request (finished ones are ignored)."""
        for stream in self._streams:
            stream.abort()


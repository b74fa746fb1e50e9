"""The notebook API, MII-compatible: `fastgen.pipeline(model)(prompts, **gen) -> list[Response]`."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Sequence as Seq

import torch

from fastgen.config import EngineConfig
from fastgen.distributed import torchrun_env
from fastgen.engine import Engine, RequestFailed
from fastgen.outputs import Response
from fastgen.sampling_params import SamplingParams

Prompts = str | Seq[str] | Seq[Seq[int]]


def normalise_prompts(prompts: Prompts) -> list[str | list[int]]:
    """A str, a list of str, or a list of token-id lists -> a non-empty list of prompts.

    Shared by the pipeline and the serving clients, so every entry point rejects the same inputs
    with the same messages.
    """
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of str or a list of token-id lists, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty")
    out: list[str | list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            out.append(list(prompt))
        elif isinstance(prompt, int) and not isinstance(prompt, bool):
            raise TypeError("a flat list of ints is ambiguous: pass token ids as a list of lists, e.g. [[1, 2, 3]]")
        else:
            raise TypeError(f"prompts[{i}] must be a str or a list of int token ids, got {type(prompt).__name__}")
    return out


class Pipeline:
    """A loaded engine you call with prompts; `destroy()` frees it.

    Under `torchrun`, only rank 0 holds an engine; on the other ranks `pipeline()` returns a
    Pipeline with `is_rank_0` False once rank 0 has finished (MII's `if pipe.is_rank_0:` pattern).
    """

    def __init__(self, engine: Engine | None, rank: int = 0) -> None:
        self._engine: Engine | None = engine
        self.rank = rank
        # Whoever steps the engine (a call, or any of several open streams) routes each open
        # stream's deltas here, so interleaved streams and calls never lose each other's text.
        self._inboxes: dict[str, deque[Response | RequestFailed]] = {}
        # Requests of pending calls that failed in the engine, kept for the call that owns them.
        self._failures: dict[str, RequestFailed] = {}

    @property
    def engine(self) -> Engine:
        """The engine; raises once the pipeline is destroyed."""
        if self.rank != 0:
            raise RuntimeError(f"this process is tensor-parallel rank {self.rank} of a torchrun launch: only rank 0 "
                               "generates (guard generation with `if pipe.is_rank_0:`)")
        if self._engine is None:
            raise RuntimeError("this pipeline was destroyed; create a new one with fastgen.pipeline()")
        return self._engine

    @property
    def is_rank_0(self) -> bool:
        """True where generation happens: always, except on torchrun ranks > 0."""
        return self.rank == 0

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer."""
        return self.engine.tokenizer

    def _submit(self, prompts: Prompts, gen: dict[str, Any]):
        engine = self.engine
        params = SamplingParams.from_kwargs(**gen)
        items = normalise_prompts(prompts)
        encoded = [engine.encode_prompt(p) for p in items]  # validate all before queueing any
        request_ids = []
        try:
            for ids in encoded:
                request_ids.append(engine.add_request(ids, params))
        except Exception:
            for rid in request_ids:
                engine.abort(rid)
            raise
        return request_ids, [engine.sequences(rid) for rid in request_ids]

    def __call__(self, prompts: Prompts, **gen: Any) -> list[Response]:
        """Generate for every prompt; one Response per prompt (n per prompt with `n>1`), in input order.

        Raises `RequestFailed` if the engine failed one of this call's requests (after the others
        have finished: other calls and streams are never affected).
        """
        request_ids, groups = self._submit(prompts, gen)
        engine = self.engine
        try:
            while any(rid in engine.requests for rid in request_ids):
                self._step()
        except BaseException:
            for rid in request_ids:
                engine.abort(rid)
                self._failures.pop(rid, None)
            raise
        failures = [self._failures.pop(rid) for rid in request_ids if rid in self._failures]
        if failures:
            raise failures[0]
        out = []
        for prompt_index, seqs in enumerate(groups):
            for seq in seqs:
                response = engine.final_response(seq)
                response.prompt_index = prompt_index
                out.append(response)
        return out

    def stream(self, prompts: Prompts, **gen: Any) -> Iterator[Response]:
        """Yield text deltas as they are produced, for one or many prompts (see `Response.prompt_index`).

        Closing the generator early aborts the unfinished requests.
        """
        request_ids, _ = self._submit(prompts, gen)
        index_of = {rid: i for i, rid in enumerate(request_ids)}
        engine = self.engine
        inbox: deque[Response] = deque()
        self._inboxes.update(dict.fromkeys(request_ids, inbox))
        try:
            while inbox or any(rid in engine.requests for rid in request_ids):
                if not inbox:
                    self._step()
                    continue
                delta = inbox.popleft()
                if isinstance(delta, RequestFailed):
                    raise delta
                delta.prompt_index = index_of[delta.request_id]
                yield delta
        finally:
            for rid in request_ids:
                self._inboxes.pop(rid, None)
                engine.abort(rid)

    def _step(self) -> None:
        """One engine step; deltas (and failures) of open streams go to their inboxes, failures of
        pending calls to `_failures`."""
        engine = self.engine
        for delta in engine.step():
            inbox = self._inboxes.get(delta.request_id)
            if inbox is not None:
                inbox.append(delta)
        for rid, failure in engine.pop_failures().items():
            inbox = self._inboxes.get(rid)
            if inbox is not None:
                inbox.append(failure)
            else:
                self._failures[rid] = failure

    def destroy(self) -> None:
        """Free the model and KV cache; later calls raise."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def pipeline(model_name_or_path: str | None = None, **config: Any) -> Pipeline:
    """Load a model (None = the bundled demo model) and return a callable `Pipeline`.

    Keywords are `EngineConfig` fields (`dtype`, `device`, `max_length`, `token_budget`, `max_seqs`,
    `block_size`, `num_kv_blocks`, `kv_cache_memory`, `enable_prefix_caching`, `tensor_parallel`,
    `seed`, ...). On a torchrun rank > 0 this serves rank 0's engine and returns when rank 0 destroys
    its pipeline or exits.
    """
    engine_config = EngineConfig.from_kwargs(model_name_or_path, **config)
    launch = torchrun_env()
    if launch is not None and launch.rank > 0:
        serve_torchrun_rank(engine_config.device)
        return Pipeline(None, rank=launch.rank)
    return Pipeline(Engine(engine_config))


def serve_torchrun_rank(device: str | None = None) -> bool:
    """On a torchrun rank > 0: serve rank 0's engine (its share of every step) until rank 0 stops, then
    return True. Anywhere else return False at once. `pipeline()` and `scripts/serve.py` call this."""
    launch = torchrun_env()
    if launch is None or launch.rank == 0:
        return False
    # Imported here: `python -m fastgen.tp_worker` must not find the module already imported by fastgen.
    from fastgen.tp_worker import serve_torchrun_rank as serve_torchrun_worker

    device_type = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    serve_torchrun_worker(launch, device_type)
    return True

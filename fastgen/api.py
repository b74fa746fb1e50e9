"""The notebook API, MII-compatible: `fastgen.pipeline(model)(prompts, **gen) -> list[Response]`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Sequence as Seq

import torch

from fastgen.config import EngineConfig
from fastgen.executor.distributed import torchrun_env
from fastgen.engine import Deliveries, Engine, RequestGroup, Sink, full_text_prefix
from fastgen.mii_options import mii_options
from fastgen.outputs import Response
from fastgen.sampling_params import FieldTypeError, FieldValueError, SamplingParams

Prompts = str | Seq[str] | Seq[Seq[int]]


def _token_ids(items: Any) -> bool:
    """Whether `items` is a list (or tuple) of ints (bools too: the engine refuses those)."""
    if not isinstance(items, (list, tuple)):
        return False
    # sum() is an int only over ints: one C-speed pass instead of a Python-level test per id of a
    # half-million-id prompt.
    try:
        return type(sum(items)) is int
    except TypeError:
        return False


def normalise_prompts(prompts: Any, field: str = "prompts", *, flat_ids: bool = False,
                      describe: Callable[[Any], str] | None = None) -> list[str | list[int]]:
    """A str, a list of str, or a list of token-id lists (with `flat_ids`, also one flat list of
    token ids, OpenAI's form) -> a non-empty list of prompts.

    The one check of every entry point (the pipeline, the clients, gRPC, REST), so all refuse the
    same inputs: a `FieldTypeError` or `FieldValueError` naming `field`. `describe` words a bad
    value in the message (default: its type's name; REST describes it as JSON).
    """
    describe = describe or (lambda value: type(value).__name__)
    kinds = "a str, a list of str" + (", a list of token ids" if flat_ids else "") + " or a list of token-id lists"
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise FieldTypeError(f"{field} must be {kinds}, got {describe(prompts)}", field)
    if not prompts:
        raise FieldValueError(f"{field} is empty", field)
    if _token_ids(prompts):
        if flat_ids:
            return [list(prompts)]
        raise FieldTypeError(f"{field}: a flat list of ints is ambiguous: pass token ids as a list of lists, "
                             "e.g. [[1, 2, 3]]", field)
    out: list[str | list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(prompt)
        elif _token_ids(prompt):
            out.append(list(prompt))
        else:
            raise FieldTypeError(f"{field} must be {kinds}: {field}[{i}] must be a str or a list of int token ids, "
                                 f"got {describe(prompt)}", field)
    return out


def _per_prompt_lora(lora: str | None | Seq[str | None], num_prompts: int) -> list[str | None]:
    """`lora` as one adapter name (or None) per prompt: one name for all, or a list with one per prompt."""
    if lora is None or isinstance(lora, str):
        return [lora] * num_prompts
    if not isinstance(lora, (list, tuple)):
        raise TypeError(f"lora must be an adapter name, None or a list of them, got {type(lora).__name__}")
    if len(lora) != num_prompts:
        raise ValueError(f"lora has {len(lora)} entries for {num_prompts} prompts: give one per prompt")
    return list(lora)


class _PipelineRequest:
    """One request of a pipeline call's `RequestGroup`; whoever steps the engine delivers its deltas
    through the pipeline's `Deliveries`."""

    def __init__(self, engine: Engine, request_id: str, deliveries: Deliveries) -> None:
        self.request_id = request_id
        self._engine = engine
        self._deliveries = deliveries

    def abort(self) -> None:
        """Stop the request now; its group hears that it ended."""
        self._engine.abort(self.request_id)
        self._deliveries.close(self.request_id)


class Pipeline:
    """A loaded engine you call with prompts; `destroy()` frees it.

    Under `torchrun`, only rank 0 holds an engine; on the other ranks `pipeline()` returns a
    Pipeline with `is_rank_0` False once rank 0 has finished (MII's `if pipe.is_rank_0:` pattern).
    """

    def __init__(self, engine: Engine | None, rank: int = 0) -> None:
        self._engine: Engine | None = engine
        self.rank = rank
        # Whoever steps the engine (a call, or any of several open streams) delivers every open
        # request's deltas to its own group, so interleaved streams and calls never lose each
        # other's text.
        self._deliveries = Deliveries()

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

    def __call__(self, prompts: Prompts, lora: str | None | Seq[str | None] = None, **gen: Any) -> list[Response]:
        """Generate for every prompt; one Response per prompt (n per prompt with `n>1`), in input order.

        `lora` names the LoRA adapter (`load_lora`) every prompt runs under, or one per prompt (None:
        the base model). `gen` are `SamplingParams` fields; MII's `stream` is accepted and changes
        nothing (use `stream()`).

        Raises `RequestFailed` if the engine failed one of this call's requests (its other requests
        are aborted; other calls and streams are never affected).
        """
        return self._group(prompts, gen, lora).results()

    def stream(self, prompts: Prompts, lora: str | None | Seq[str | None] = None, **gen: Any) -> Iterator[Response]:
        """Yield text deltas as they are produced, for one or many prompts (see `Response.prompt_index`).

        With `return_full_text` the first delta of each completion starts with the prompt, so the
        deltas add up to the call's text; `lora` as in `__call__`. Closing the generator early aborts the
        unfinished requests.
        """
        yield from self._group(prompts, gen, lora)

    def _group(self, prompts: Prompts, gen: dict[str, Any], lora: str | None | Seq[str | None]) -> RequestGroup:
        """Validate every prompt, the params and the adapters, then queue one request per prompt as a
        group that steps the engine while its reader waits."""
        engine = self.engine
        gen, _ = split_mii_stream(gen)  # MII's flag: whether the call streams is the method's choice here
        params = SamplingParams.from_kwargs(**gen)
        encoded = [engine.encode_prompt(p) for p in normalise_prompts(prompts)]
        loras = _per_prompt_lora(lora, len(encoded))
        for name in loras:
            engine.lora_id(name)  # an unknown adapter raises before any request is queued
        prefixes = [full_text_prefix(engine.tokenizer, ids, params) for ids in encoded] \
            if params.return_full_text else None
        group = RequestGroup(params.n, drive=self._step, prefixes=prefixes)

        def submit(item: tuple[list[int], str | None], sink: Sink) -> _PipelineRequest:
            request_id = engine.add_request(item[0], params, lora=item[1])
            self._deliveries.open(request_id, sink, params.n)
            return _PipelineRequest(engine, request_id, self._deliveries)

        group.submit_each(list(zip(encoded, loras)), submit, "prompts")
        return group

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter at `path` (`adapter_config.json` + `adapter_model.safetensors`) as
        `name`, for calls to select with `lora=name`. Needs a pipeline built with `enable_lora=True`; a bad
        adapter raises ValueError naming the problem and nothing is loaded."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name`; refused (ValueError) while an open stream's requests still run under it."""
        self.engine.unload_lora(name)

    def _step(self) -> None:
        """One engine step; every open request's deltas go to its group."""
        self._deliveries.deliver_all(self.engine.step())

    def destroy(self) -> None:
        """Free the model and KV cache; later calls raise."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def pipeline(model_name_or_path: str | None = None, model_config: dict[str, Any] | None = None,
             all_rank_output: bool = False, **config: Any) -> Pipeline:
    """Load a model (None = the bundled demo model) and return a callable `Pipeline`.

    Keywords are `EngineConfig` fields (`dtype`, `device`, `max_length`, `token_budget`, `max_seqs`,
    `block_size`, `num_kv_blocks`, `kv_cache_memory`, `enable_prefix_caching`, `tensor_parallel`,
    `seed`, `offline` (True here: steps sized for the batch's throughput), ...) and MII's
    `ModelConfig` fields, as keywords or in `model_config={...}` (see
    `mii_options`: each is mapped onto ours, refused with the reason, or accepted with a
    `MIICompatibilityWarning` saying why it has no effect). `all_rank_output` is MII's: True is
    refused only under a torchrun launch of several ranks, where ranks > 0 do not generate. On a
    torchrun rank > 0 this serves rank 0's engine and returns when rank 0 destroys its pipeline or exits.
    """
    if not isinstance(all_rank_output, bool):
        raise TypeError(f"all_rank_output must be a bool, got {type(all_rank_output).__name__}")
    launch = torchrun_env()
    if all_rank_output and launch is not None and launch.world_size > 1:
        raise ValueError(
            "all_rank_output=True: under torchrun only rank 0 generates; ranks > 0 serve rank 0's engine inside "
            "pipeline() and return once rank 0 destroys its pipeline, so they have no outputs to return. Generate "
            "under `if pipe.is_rank_0:` and share the results yourself (torch.distributed.broadcast_object_list)")
    model, options = mii_options(model_name_or_path, model_config, None, config, serving=False)
    # A pipeline call returns when its whole batch is done: plan for throughput unless told otherwise.
    options.setdefault("offline", True)
    engine_config = EngineConfig.from_kwargs(model, **options)
    if launch is not None and launch.rank > 0:
        serve_torchrun_rank(engine_config.device)
        return Pipeline(None, rank=launch.rank)
    return Pipeline(Engine.from_config(engine_config))


def serve_torchrun_rank(device: str | None = None) -> bool:
    """On a torchrun rank > 0: serve rank 0's engine (its share of every step) until rank 0 stops, then
    return True. Anywhere else return False at once. `pipeline()` and `scripts/serve.py` call this."""
    launch = torchrun_env()
    if launch is None or launch.rank == 0:
        return False
    # Imported here: `python -m fastgen.executor.tp_worker` must not find the module already imported by fastgen.
    from fastgen.executor.tp_worker import serve_torchrun_rank as serve_torchrun_worker

    device_type = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    serve_torchrun_worker(launch, device_type)
    return True


def split_mii_stream(gen: dict[str, Any], where: str = "stream") -> tuple[dict[str, Any], bool]:
    """(generation keywords without MII's `stream`, its value).

    MII's `stream` is a generation keyword (MII's client adds `stream=True` by itself when given a
    `streaming_fn`); here the call decides whether it streams, so the flag never changes the answer:
    a non-streaming call still returns every completion in full.
    """
    if "stream" not in gen:
        return gen, False
    gen = dict(gen)
    stream = gen.pop("stream")
    if not isinstance(stream, bool):
        raise TypeError(f"{where} must be a bool, got {type(stream).__name__} ({stream!r})")
    return gen, stream

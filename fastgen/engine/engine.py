"""The engine: requests in, one Dynamic SplitFuse step at a time, tokens and text out.

`Engine` is synchronous and single-threaded (a notebook calls `step()` in a loop); the server
drives the same object from one background thread (`loop.py`). Requests are validated completely
before any state changes (`admission.py`), so a bad request raises and every other request keeps
going. A step is three calls: the scheduler decides (`Scheduler.schedule`), the executor runs the
model and samples (`StepExecutor.execute`, which isolates failing requests), the scheduler applies
the `StepOutput` (`Scheduler.update`: tokens, stop rules, finishing, `n` choices).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import weakref
from collections.abc import Iterable
from typing import Any, Sequence as Seq

import torch

from fastgen.config import EngineConfig
from fastgen.engine.admission import Admission, PreparedRequest
from fastgen.engine.block_manager import BlockManager
from fastgen.engine.builder import build_runner, plan_engine
from fastgen.engine.detokenizer import TextStream
from fastgen.engine.draft_proposer import DraftModelProposer
from fastgen.engine.grammar import StructuredOutputManager
from fastgen.engine.step.sampling_metadata import make_generator
from fastgen.engine.scheduler import ScheduledBatch, Scheduler
from fastgen.engine.sequence import Sequence, SequenceStatus
from fastgen.engine.speculator import Speculator
from fastgen.engine.lora_manager import LoRAManager
from fastgen.engine.step.inputs import kv_namespace
from fastgen.engine.step.executor import StepExecutor
from fastgen.engine.step.output import SequenceUpdate, StepOutput
from fastgen.engine.stop_rules import StopRules
from fastgen.executor.distributed import TensorParallelGroup
from fastgen.executor.runner import ModelRunner
from fastgen.models.rope import long_rope_switch
from fastgen.outputs import Response
from fastgen.planning.plan import Plan
from fastgen.sampling_params import SamplingParams

logger = logging.getLogger("fastgen")

SPEC_LOG_INTERVAL_S = 30.0
"""Seconds between log lines of speculative decoding's measured acceptance."""


def _stop_group(group: TensorParallelGroup, num_threads: int) -> None:
    """Stop a tensor-parallel group and give this process back the CPU threads it had before."""
    group.shutdown()
    torch.set_num_threads(num_threads)


class Engine:
    """Owns runner, KV blocks, scheduler and executor; turns requests into `Response` deltas."""

    def __init__(self, plan: Plan, runner: ModelRunner, tokenizer: Any, *, eos_token_ids: Iterable[int] = (),
                 config: EngineConfig | None = None, tp_group: TensorParallelGroup | None = None,
                 threads_before: int = 0, draft_runner: ModelRunner | None = None) -> None:
        """An engine serving `plan` over a `runner` built for it (see `fastgen.engine.builder`;
        `Engine.from_config` builds both from an `EngineConfig`). `plan` sets the scheduler's token
        budget and seats, `runner.spec` the KV blocks and context; `config` the remaining options
        (prefix caching, seed). The engine owns `tp_group` and stops it at `shutdown` (or when
        collected), giving this process back `threads_before` CPU threads. `draft_runner` is the draft
        model of the plan's `speculative_config`, when it names one."""
        if runner.spec.plan != plan:
            raise ValueError("the runner was built for another plan (its spec.plan): build it with "
                             "fastgen.engine.builder.build_runner(config, plan)")
        self.plan = plan
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config if config is not None else EngineConfig(model=runner.spec.model_dir)
        self.tp_group = tp_group
        if tp_group is not None:
            # A script that never calls destroy() still stops its workers (torchrun ranks included) at exit.
            self._stop_workers = weakref.finalize(self, _stop_group, tp_group, threads_before or torch.get_num_threads())
        spec = runner.spec
        self.model_dir, self.model_config, self.device = spec.model_dir, runner.config, runner.device
        self.dtype, self.block_size, self.max_model_len = plan.dtype, plan.block_size, spec.max_model_len
        self.vocab_size = self.model_config.vocab_size
        # The plan's reason for state_slots says why a hybrid model runs without prefix caching.
        self.block_manager = BlockManager(spec.num_blocks, plan.block_size,
                                          self.config.enable_prefix_caching and not plan.state_slots,
                                          num_state_slots=plan.state_slots)
        self.long_rope = long_rope_switch(runner.model)
        self.lora = None if runner.lora is None else LoRAManager(runner.model, runner.lora, plan.max_cpu_loras,
                                                                 plan.dtype, replicated=tp_group is not None)
        """The engine's LoRA adapters (None: the plan's enable_lora is off)."""
        namespace = None if self.long_rope is None and self.lora is None else functools.partial(
            kv_namespace, self.long_rope)
        self.stop_rules = StopRules(eos_token_ids, self.max_model_len)
        self.speculator = self._speculator(plan, draft_runner)
        self.scheduler = Scheduler(self.block_manager, plan.token_budget, plan.max_seqs, namespace,
                                   plan.context_per_budget_token, self.stop_rules, self.speculator, plan.max_loras)
        self.structured_outputs = StructuredOutputManager(plan.structured_outputs_backend, tokenizer,
                                                          self.vocab_size, self.stop_rules)
        self.executor = StepExecutor(runner, self.block_manager, self.stop_rules, self.long_rope, tp_group,
                                     self.structured_outputs, self.speculator, self.lora)
        self.admission = Admission(tokenizer, self.vocab_size, self.max_model_len, self.structured_outputs)
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        self._num_steps = 0
        self._step_seconds = 0.0
        self._spec_logged = (time.monotonic(), 0)  # when speculation's acceptance was last logged, at how many drafts
        logger.info("fastgen engine: %s on %s, %s, %d KV blocks of %d tokens, max_model_len %d, tensor_parallel %d",
                    self.model_dir, self.device, self.dtype, spec.num_blocks, self.block_size,
                    self.max_model_len, plan.tensor_parallel)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        """Plan for `config`'s model on this machine, load it (on every tensor-parallel rank) and
        build the engine: what `fastgen.pipeline` and `serve` do."""
        plan = plan_engine(config)
        built = build_runner(config, plan)
        return cls(plan, built.runner, built.tokenizer, eos_token_ids=built.eos_token_ids, config=config,
                   tp_group=built.tp_group, threads_before=built.threads_before, draft_runner=built.draft_runner)

    def _speculator(self, plan: Plan, draft_runner: ModelRunner | None) -> Speculator | None:
        """The plan's speculative decoding (None: off), over `draft_runner` for a draft model."""
        speculative = plan.speculative_config
        if speculative is None:
            return None
        if self.long_rope is not None:
            raise NotImplementedError("speculative_config with a LongRoPE model (Phi-3 long context) is not "
                                      "implemented yet: drafts may cross original_max_position_embeddings")
        draft = None if draft_runner is None else DraftModelProposer(
            draft_runner, draft_runner.spec.num_blocks, plan.block_size, speculative.num_speculative_tokens)
        return Speculator(speculative, self.stop_rules, draft)

    @property
    def eos_token_ids(self) -> set[int]:
        """The model's end-of-sequence ids (settable: the stop rules and the sampler's bans follow)."""
        return self.stop_rules.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Iterable[int]) -> None:
        self.stop_rules.eos_token_ids = set(ids)

    @property
    def requests(self) -> dict[str, list[Sequence]]:
        """Every unfinished request's sequences (choices), by request id."""
        return self.scheduler.requests

    # Requests -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of a text prompt, or validated ids of a token-id prompt (see `Admission`)."""
        return self.admission.encode_prompt(prompt)

    def prepare(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                lora: str | None = None) -> PreparedRequest:
        """Tokenize and validate a request, to run under the LoRA adapter named `lora` (None: the base
        model), without changing engine state (safe on any thread); raises ValueError/TypeError naming
        the problem (see `Admission.prepare`), `UnknownLoRAError` for an adapter not loaded."""
        self.lora_id(lora)  # an unknown adapter fails before the prompt is tokenized
        return self.admission.prepare(prompt, params, lora)

    def add_request(self, prompt: str | Seq[int] | PreparedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None, lora: str | None = None) -> str:
        """Validate (unless `prompt` is already a `PreparedRequest`) and queue a request, run under the
        LoRA adapter named `lora` (None: the base model; a `PreparedRequest` carries its own); returns
        its id. Raises before changing any state (`UnknownLoRAError` for an adapter not loaded)."""
        if isinstance(prompt, PreparedRequest):
            if params is not None or lora is not None:
                raise TypeError("a PreparedRequest carries its own params and lora: do not pass them as well")
            prepared = prompt
        else:
            prepared = self.prepare(prompt, params, lora)
        lora_id = self.lora_id(prepared.lora)  # again: the adapter may have been unloaded since `prepare`
        ids, params = prepared.prompt_token_ids, prepared.params
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = next(self._arrivals)
        seqs = []
        for index in range(params.n):
            seed = None if params.seed is None else (params.seed + 7919 * index) % (2**63)
            seq = Sequence(next(self._seq_ids), request_id, ids, params, arrival, index,
                           make_generator(seed, self.device) if not params.greedy else None)
            seq.stream = TextStream(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                    include_stop=params.include_stop_str_in_output)
            seq.bad_words_ids = prepared.bad_words_ids
            seq.lora_id = lora_id
            if prepared.grammar is not None:
                seq.grammar = prepared.grammar.for_sequence()
            seqs.append(seq)
        self.scheduler.add_request(seqs)
        if not seqs[0].ready:
            self.structured_outputs.track(request_id, seqs[0].grammar)
        return request_id

    # LoRA adapters ---------------------------------------------------------------------------

    def lora_id(self, name: str | None) -> int:
        """The `lora_id` requests naming adapter `name` run under (0 for None: the base model)."""
        if name is None:
            return 0
        if not isinstance(name, str):
            raise TypeError(f"lora must be an adapter's name (str) or None, got {type(name).__name__}")
        if self.lora is None:
            raise ValueError(f"LoRA adapter {name!r} requested but this engine serves none: build it with "
                             "enable_lora=True and load_lora(name, path)")
        return self.lora.get(name).lora_id

    def load_lora(self, name: str, path: str) -> None:
        """Read, check and register the PEFT adapter at `path` under `name`, for requests to name.
        ValueError, naming the problem, for a bad adapter (nothing is loaded; serving goes on)."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: build it with enable_lora=True")
        self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`. Refused (ValueError) while unfinished requests run under it: they are
        never broken; unload once they end (or abort them)."""
        lora_id = self.lora_id(name)
        users = sorted(rid for rid, seqs in self.requests.items() if any(s.lora_id == lora_id for s in seqs))
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished request(s) "
                             f"({', '.join(map(repr, users[:5]))}): unload it once they end")
        self.lora.unload(name)

    def lora_adapters(self) -> dict[str, str]:
        """The loaded adapters: name -> directory."""
        return {} if self.lora is None else {name: a.path for name, a in self.lora.adapters.items()}

    def abort(self, request_id: str) -> list[Response]:
        """Stop a request now and free its KV blocks; returns its final responses (unknown id: [])."""
        return [self._delta(SequenceUpdate(seq)) for seq in self.scheduler.abort(request_id)]

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    # Stepping -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Response]:
        """Run one SplitFuse step; return a delta per sequence that produced a token or finished.

        The only way results leave the engine. A failure that only some requests' rows meet (in the
        model, the sampler, the detokenizer) ends each such request with one final delta whose
        `finish_reason` is "error" and whose `error` is the `RequestFailed`; the step goes on for
        the others. Faults of the engine itself (a dead tensor-parallel rank, device OOM) raise.
        """
        failed = self._fail_unusable_grammars()
        batch = self.scheduler.schedule()
        if not batch.chunks:
            if failed or self.structured_outputs.wait_for_compile(0.05):  # only compiling requests are left
                return failed
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress although requests are pending (KV cache too small?)")
            return []
        started = time.perf_counter()
        output = self.executor.execute(batch)
        updates = self.scheduler.update(batch, output)
        # On a GPU without a sync the next step's time absorbs this one's.
        seconds = time.perf_counter() - started
        self._num_steps += 1
        self._step_seconds += seconds
        if self.speculator is not None:
            self._measure_speculation(batch, output, seconds)
            self._log_acceptance()
        return failed + [self._delta(update) for update in updates]

    def _measure_speculation(self, batch: ScheduledBatch, output: StepOutput, seconds: float) -> None:
        """Tell the speculator's governor what a step of decode rows alone made, and whether it verified drafts."""
        if any(chunk.num_new_tokens != 1 for chunk in batch.chunks):
            return  # a prompt chunk's cost would blur the rate of the choice the step made
        tokens = sum(len(output.sampled_token_ids.get(chunk.seq.seq_id, ())) for chunk in batch.chunks)
        self.speculator.governor.record(len(batch.chunks), any(chunk.draft_token_ids for chunk in batch.chunks),
                                        tokens, seconds)

    def _log_acceptance(self) -> None:
        """Every 30 s while speculation verifies drafts: its acceptance so far (vLLM logs the same)."""
        at, drafts = self._spec_logged
        stats = self.speculator.stats
        if stats.num_drafts > drafts and time.monotonic() - at >= SPEC_LOG_INTERVAL_S:
            self._spec_logged = (time.monotonic(), stats.num_drafts)
            logger.info("speculative decoding: acceptance %.2f (%d of %d draft tokens), %.2f tokens per verified "
                        "row-step, accepted per position %s", stats.acceptance_rate, stats.num_accepted_tokens,
                        stats.num_draft_tokens, 1 + stats.num_accepted_tokens / stats.num_drafts,
                        stats.accepted_per_position)

    def _fail_unusable_grammars(self) -> list[Response]:
        """End the queued requests whose grammar failed to compile (or took too long): their final deltas."""
        unusable = self.structured_outputs.unusable()
        if not unusable:
            return []
        output = StepOutput()
        for request_id, error in unusable:
            output.fail(request_id, "compiling its structured-output grammar", error)
        return [self._delta(update) for update in self.scheduler.update(ScheduledBatch(), output)]

    def stats(self) -> dict[str, float | list[int] | list[str]]:
        """A snapshot for metrics: requests, waiting/running sequences, KV blocks, prefix-cache hit rate,
        steps that ran the model and their total seconds; with speculative decoding its counters
        (`SpecDecodeStats`: rows verified with drafts, draft and accepted tokens, accepted per position);
        with LoRA the adapters of the running and the waiting sequences (names) and `max_loras`; with the
        plan's adaptive_threads the steps that gave up cores to other processes.

        Safe to call from another thread while the engine steps (it only reads counters); the numbers
        may then be a step apart from each other.
        """
        blocks = self.block_manager
        spec = {} if self.speculator is None else {
            "spec_num_drafts": self.speculator.stats.num_drafts,
            "spec_num_draft_tokens": self.speculator.stats.num_draft_tokens,
            "spec_num_accepted_tokens": self.speculator.stats.num_accepted_tokens,
            "spec_accepted_per_position": list(self.speculator.stats.accepted_per_position),
        }
        threads = {} if self.runner.threads is None else {"num_steps_fewer_threads": self.runner.threads.reduced_steps}
        return spec | threads | self._lora_stats() | {
            "num_requests": len(self.requests),
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "kv_blocks_total": blocks.num_blocks,
            "kv_blocks_free": blocks.num_free_blocks,
            "prefix_cache_hit_rate": blocks.stats.hit_rate,
            "num_steps": self._num_steps,
            "step_seconds_total": self._step_seconds,
        }

    def _lora_stats(self) -> dict[str, float | list[str]]:
        """The LoRA part of `stats` (empty without LoRA): adapter names in use by running and waiting sequences."""
        if self.lora is None:
            return {}
        # Copies first: another thread reads this while the engine thread changes the collections.
        names = {a.lora_id: a.name for a in list(self.lora.adapters.values())}

        def used(seqs: Iterable[Sequence]) -> list[str]:
            return sorted({names[s.lora_id] for s in seqs if s.lora_id in names})

        return {"lora_running": used(list(self.scheduler.running)), "lora_waiting": used(list(self.scheduler.waiting)),
                "lora_max_loras": self.lora.max_loras}

    def _delta(self, update: SequenceUpdate) -> Response:
        """The `Response` delta of one sequence's update (a failed request's: finish_reason "error")."""
        seq, token_ids = update.seq, update.token_ids
        return Response(
            generated_text=update.text,
            prompt_length=seq.num_prompt_tokens,
            generated_length=len(seq.output_token_ids),
            finish_reason="error" if update.error is not None else
            seq.finish_reason if seq.status is SequenceStatus.FINISHED else "none",
            token_ids=token_ids,
            logprobs=update.logprobs,
            # The prompt's logprobs ride on the first delta of the choice that computed them.
            prompt_logprobs=seq.prompt_logprobs if token_ids and len(seq.output_token_ids) == len(token_ids) else None,
            index=seq.index,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            request_id=seq.request_id,
            error=update.error,
        )

    def sequences(self, request_id: str) -> list[Sequence]:
        """The sequences (choices) of a live request."""
        return self.requests[request_id]

    def shutdown(self) -> None:
        """Abort everything and drop the model and KV cache so their memory can be freed."""
        for request_id in list(self.requests):
            self.abort(request_id)
        self.runner = None
        self.executor = None
        self.lora = None  # it holds the model too
        self.structured_outputs.shutdown()
        if self.tp_group is not None:
            self._stop_workers()
            self.tp_group = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

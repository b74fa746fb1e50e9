"""The engine: requests in, one Dynamic SplitFuse step at a time, tokens and text out.

`Engine` is synchronous and single-threaded (a notebook calls `step()` in a loop); the server
drives the same object from one background thread (`engine_loop.py`). Requests are validated
completely in `add_request` before any state changes, so a bad request raises and every other
request keeps going.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Sequence as Seq

import torch
from transformers import AutoTokenizer

from fastgen.engine.block_manager import BlockManager
from fastgen.config import EngineConfig
from fastgen.engine.detokenizer import TextStream
from fastgen.engine.request_group import full_text_prefix
from fastgen.executor.distributed import TensorParallelGroup, torchrun_env
from fastgen.planning.hardware import detect_hardware
from fastgen.planning.model_facts import model_facts
from fastgen.executor.runner import ModelRunner, RunnerSpec, kv_bytes_per_block, load_for_spec
from fastgen.models.config import ModelConfig
from fastgen.models.loader import resolve_model_dir
from fastgen.models.rope import long_rope_switch
from fastgen.models.registry import check_tensor_parallel_support
from fastgen.outputs import Response
from fastgen.planning.plan import Plan
from fastgen.planning.policy import make_plan
from fastgen.engine.sampler import Sampler
from fastgen.engine.sampling_metadata import SamplingMetadata, make_generator
from fastgen.sampling_params import FieldValueError, SamplingParams
from fastgen.engine.scheduler import Scheduler
from fastgen.engine.sequence import Sequence, SequenceStatus
from fastgen.engine.step_builder import build_host_inputs, long_rope_namespace, prompt_logit_positions

logger = logging.getLogger("fastgen")

DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_model")
"""The small Llama-architecture model shipped inside the package (used when no model is named)."""


class RequestFailed(RuntimeError):
    """One request failed inside the engine after it was admitted (a sampler, detokenizer or model
    error that only its rows hit). Only that request ends; it is a server error (gRPC INTERNAL,
    HTTP 500), never the caller's INVALID_ARGUMENT, since admission had accepted the request."""


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request tokenized and validated by `Engine.prepare`, ready for `add_request`.

    Preparing touches no engine state, so servers do it on their own threads (tokenizing a long
    prompt then never holds up the engine thread or an event loop).
    """

    prompt_token_ids: list[int]
    """The prompt's token ids (after `truncate_prompt_tokens`)."""
    params: SamplingParams
    """The request's validated generation parameters."""
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences of `params.bad_words` (each word alone and after a space)."""


def _stop_group(group: TensorParallelGroup, num_threads: int) -> None:
    """Stop a tensor-parallel group and give this process back the CPU threads it had before."""
    group.shutdown()
    torch.set_num_threads(num_threads)


class Engine:
    """Owns model, KV cache, scheduler and sampler; turns requests into `Response` deltas."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_path = config.model or DEMO_MODEL_DIR
        if config.model is None:
            logger.info("fastgen: no model named, using the bundled demo model %s", DEMO_MODEL_DIR)
        overrides = config.plan_overrides()
        if overrides["compile"] is None and os.environ.get("FASTGEN_COMPILE"):
            overrides["compile"] = os.environ["FASTGEN_COMPILE"]
        launch = torchrun_env()
        if launch is not None and overrides["tensor_parallel"] is None:
            overrides["tensor_parallel"] = launch.world_size
        self.plan = make_plan(model_facts(model_path), detect_hardware(config.device), offline=config.offline,
                              **overrides)
        plan = self.plan
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        logger.info("fastgen plan for %s on %s:\n%s", model_path, self.device, plan.table())
        self.model_dir = resolve_model_dir(model_path)
        self.model_config = ModelConfig.from_file(os.path.join(self.model_dir, "config.json"))
        self.dtype = plan.dtype
        self.block_size = plan.block_size
        model_max = self.model_config.max_position_embeddings
        if config.max_length is not None and config.max_length > model_max:
            raise ValueError(f"max_length {config.max_length} exceeds the model's context of {model_max} tokens")

        self.tp_group: TensorParallelGroup | None = None
        if plan.tensor_parallel > 1:
            check_tensor_parallel_support(self.model_config.model_type)
            self.tp_group = TensorParallelGroup(plan.tensor_parallel, self.device.type, self.device.index or 0)
            self.model_config.parallel = self.tp_group.parallel
            # A script that never calls destroy() still stops its workers (torchrun ranks included) at exit.
            self._stop_workers = weakref.finalize(self, _stop_group, self.tp_group, torch.get_num_threads())
        try:
            self._build(config, plan)
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.shutdown(graceful=False)  # workers may be loading or warming up
                self._stop_workers()
            raise
        logger.info("fastgen engine: %s on %s, %s, %d KV blocks of %d tokens, max_model_len %d, tensor_parallel %d",
                    self.model_dir, self.device, self.dtype, self.block_manager.num_blocks, self.block_size,
                    self.max_model_len, plan.tensor_parallel)

    def _build(self, config: EngineConfig, plan: Plan) -> None:
        """Load the weights (this rank's share), size the KV cache, build runner, scheduler and sampler."""
        wanted_len = config.max_length or self.model_config.max_position_embeddings
        num_blocks = self._num_kv_blocks(wanted_len)
        self.max_model_len = min(wanted_len, num_blocks * self.block_size)
        # Without compilation or graphs, padding to a bucket only adds work: run exact shapes.
        static = plan.compile != "off" or plan.cuda_graphs or config.buckets is not None
        buckets = plan.buckets if static else ()
        parallel = self.model_config.parallel
        threads = 0
        if self.tp_group is not None and self.device.type == "cpu":
            # Ranks share this machine's cores: split them so the ranks do not fight over threads.
            threads = max(1, torch.get_num_threads() // plan.tensor_parallel)
            logger.info("fastgen: %d CPU threads per tensor-parallel rank", threads)
            torch.set_num_threads(threads)
        spec = RunnerSpec(
            model_dir=self.model_dir, dtype=self.dtype, device_type=self.device.type,
            device_index=self.device.index or 0, num_blocks=num_blocks, block_size=self.block_size,
            max_model_len=self.max_model_len, max_seqs=plan.max_seqs, quantization=plan.quantization,
            quantization_group_size=plan.quantization_group_size, attention_backend=plan.attention_backend,
            buckets=tuple(buckets), compile=plan.compile, cuda_graphs=plan.cuda_graphs, num_threads=threads,
            progress=config.progress, offload=plan.offload, weight_memory=plan.weight_memory,
            weight_prepack=plan.weight_prepack, gemv_weights=plan.gemv_weights)
        if self.tp_group is not None:
            self.tp_group.send_spec(spec)  # workers load their shards while this rank loads its own
        loaded = load_for_spec(spec, self.device, parallel, config.progress)
        self.model_config = loaded.config
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.tokenizer = AutoTokenizer.from_pretrained(loaded.model_dir)
        if self.tokenizer.eos_token_id is not None and not self.eos_token_ids:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        self.vocab_size = self.model_config.vocab_size
        self.runner = ModelRunner(loaded.model, self.model_config, spec, self.device)
        self.block_manager = BlockManager(num_blocks, self.block_size, config.enable_prefix_caching)
        self.long_rope = long_rope_switch(loaded.model)
        namespace = None if self.long_rope is None else functools.partial(long_rope_namespace, self.long_rope)
        self.scheduler = Scheduler(self.block_manager, plan.token_budget, plan.max_seqs, namespace,
                                   plan.context_per_budget_token)
        self.sampler = Sampler()
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        self.requests: dict[str, list[Sequence]] = {}
        self._failures: dict[str, RequestFailed] = {}
        self._max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        self._num_steps = 0
        self._step_seconds = 0.0

    def _num_kv_blocks(self, max_len: int) -> int:
        """KV blocks from `num_kv_blocks`, else from the plan's KV memory, capped at what max_seqs
        full-length sequences could ever use."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        useful = self.plan.max_seqs * -(-max_len // self.block_size)
        return max(1, min(self.plan.kv_cache_memory // per_block, useful))

    # Requests -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of a text prompt, or validated ids of a token-id prompt.

        A text prompt whose length alone proves it cannot fit the context is refused before it is
        tokenized, so a huge body costs a `len()`, not seconds of tokenizer time.
        """
        if isinstance(prompt, str):
            if self._max_prompt_chars is not None and len(prompt) > self._max_prompt_chars:
                raise ValueError(
                    f"prompt has {len(prompt)} characters: more than the {self.max_model_len}-token context can hold "
                    f"(no text over {self._max_prompt_chars} characters fits it with this tokenizer)")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise TypeError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        return ids

    def prepare(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> PreparedRequest:
        """Tokenize and validate a request without touching engine state (safe on any thread).

        Raises ValueError/TypeError naming the problem; a request that passes can no longer fail
        validation in `add_request`.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.encode_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        max_len = min(params.max_length or self.max_model_len, self.max_model_len)
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_length is {max_len}: nothing is left to generate "
                f"(the engine holds at most {self.max_model_len} tokens per sequence)"
            )
        for name, token_ids in (("stop_token_ids", params.stop_token_ids),
                                ("logit_bias", tuple(params.logit_bias or ())),
                                ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in token_ids if t >= self.vocab_size]
            if bad:
                raise FieldValueError(f"{name} contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})", name)
        return PreparedRequest(ids, params, self._bad_words_ids(params.bad_words))

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens at the start of a text and after a space (vLLM's rule: the spaced
        form counts only when it is a different first token and the same number of tokens)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if bare and bare not in out:
                out.append(bare)
            if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare) and spaced not in out:
                out.append(spaced)
        return tuple(out)

    def add_request(self, prompt: str | Seq[int] | PreparedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate (unless `prompt` is already a `PreparedRequest`) and queue a request; returns its
        id. Raises before changing any state."""
        if isinstance(prompt, PreparedRequest):
            if params is not None:
                raise TypeError("a PreparedRequest carries its own params: do not pass params as well")
            prepared = prompt
        else:
            prepared = self.prepare(prompt, params)
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
            seqs.append(seq)
        # The other choices start once the first has computed the prompt, sharing its KV blocks.
        seqs[0].children = seqs[1:]
        self.requests[request_id] = seqs
        self.scheduler.add(seqs[0])
        return request_id

    def abort(self, request_id: str) -> list[Response]:
        """Stop a request now and free its KV blocks; returns its final responses (unknown id: [])."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return []
        out = []
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            out.append(self._delta(seq, "", [], None))
        return out

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    # Stepping -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Response]:
        """Run one SplitFuse step; return a delta per sequence that produced a token or finished.

        A failure that only some requests' rows meet (in the model, the sampler, the detokenizer)
        ends those requests with `RequestFailed` (see `pop_failures`) and the step goes on for the
        others. Faults of the engine itself (a dead tensor-parallel rank, device OOM) raise.
        """
        batch = self.scheduler.schedule()
        if not batch.chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress although requests are pending (KV cache too small?)")
            return []
        started = time.perf_counter()
        chunks, logits = self._forward(batch.chunks)
        logits = self._take_prompt_logprobs(chunks, logits)
        to_sample = self.scheduler.postprocess(chunks)
        live = [row for row, seq in enumerate(to_sample) if not seq.is_finished]
        if not live:
            self._count_step(started)  # on a GPU without the sync, the next step's time absorbs this one's
            return []
        if len(live) < len(to_sample):
            to_sample = [to_sample[row] for row in live]
            logits = logits[torch.tensor(live, device=logits.device)]
        tokens, logprobs = self._sample_isolated(logits, to_sample)
        outputs = []
        for seq, token, row_logprobs in zip(to_sample, tokens, logprobs):
            if token is None or seq.is_finished:  # its request failed in this step
                continue
            delta = self._isolated(seq, "detokenizing", self._append_token, seq, token, row_logprobs)
            if delta is not None:
                outputs.append(delta)
        self._count_step(started)
        return outputs

    def pop_failures(self) -> dict[str, RequestFailed]:
        """Requests that failed inside the engine since the last call: id -> error. They are already
        gone from the engine (blocks freed); whoever waits on them should get the error."""
        failures, self._failures = self._failures, {}
        return failures

    def _execute(self, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        host = build_host_inputs(chunks, self.block_manager, self.long_rope)
        if self.tp_group is not None:
            return self.tp_group.run_step(host, self.runner.execute)
        return self.runner.execute(host)

    def _forward(self, chunks: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]], torch.Tensor]:
        """The model over `chunks`: the chunks that ran and their logits (rows of chunks that end
        their sequence). When the batch fails, each chunk is rerun alone to find the requests that
        cause it; rerunning is safe because a step only writes its own tokens' KV slots."""
        try:
            return chunks, self._execute(chunks)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if self.tp_group is not None:
                raise  # the ranks may be mid-collective: the group is not in a state to retry
            failure = exc
        logger.warning("engine step over %d chunks failed (%s: %s); rerunning them one by one",
                       len(chunks), type(failure).__name__, failure)
        kept, rows = [], []
        for seq, num_new in chunks:
            if seq.is_finished:
                continue
            try:
                logits = self._execute([(seq, num_new)])
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                self._fail_request(seq.request_id, exc, "running the model")
                # Its full blocks were registered as cached prefixes before their KV was written.
                self.block_manager.reset_prefix_cache()
                continue
            kept.append((seq, num_new))
            rows.append(logits)
        # A request with several sequences may have failed after an earlier one ran.
        pairs = [(chunk, row) for chunk, row in zip(kept, rows) if not chunk[0].is_finished]
        logits_rows = [row for _, row in pairs if row.shape[0]]
        width = self.model_config.vocab_size
        logits = torch.cat(logits_rows) if logits_rows else torch.empty(0, width, device=self.device)
        return [chunk for chunk, _ in pairs], logits

    def _take_prompt_logprobs(self, chunks: list[tuple[Sequence, int]], logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs in this step's logits (see `prompt_logit_positions`); returns
        the rows that are sampled."""
        sample_rows, prompt_rows, owners = [], [], []
        row = 0
        for seq, num_new in chunks:
            for position in prompt_logit_positions(seq, num_new):
                prompt_rows.append(row)
                owners.append((seq, position))
                row += 1
            if seq.num_computed_tokens + num_new == seq.num_tokens:
                sample_rows.append(row)
                row += 1
        if not prompt_rows:
            return logits
        device = logits.device
        scores = logits[torch.tensor(prompt_rows, device=device)].float().log_softmax(dim=-1)
        targets = [seq.prompt_token_ids[position + 1] for seq, position in owners]
        chosen = scores.gather(1, torch.tensor(targets, device=device).unsqueeze(1)).squeeze(1).tolist()
        num_top = min(max(seq.params.prompt_logprobs for seq, _ in owners), scores.shape[1])
        top_lp, top_ids = scores.topk(num_top, dim=-1) if num_top else (scores[:, :0], scores[:, :0].long())
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        for i, (seq, position) in enumerate(owners):
            if len(seq.prompt_logprobs) != position + 1:
                continue  # recomputed after a preemption: already recorded
            entry = {targets[i]: chosen[i]}
            n = seq.params.prompt_logprobs
            for token_id, lp in zip(top_ids[i][:n], top_lp[i][:n]):
                entry.setdefault(token_id, lp)
            seq.prompt_logprobs.append(entry)
        return logits[torch.tensor(sample_rows, device=device, dtype=torch.int64)]

    def _sample_isolated(self, logits: torch.Tensor, seqs: list[Sequence]):
        """`_sample` for the batch; if it fails, row by row, failing only the rows' requests that fail."""
        try:
            return self._sample(logits, seqs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if len(seqs) == 1:
                self._fail_request(seqs[0].request_id, exc, "sampling")
                return [None], [None]
            logger.warning("sampling %d rows failed (%s: %s); sampling them one by one",
                           len(seqs), type(exc).__name__, exc)
        tokens, logprobs = [], []
        for row, seq in enumerate(seqs):
            result = self._isolated(seq, "sampling", self._sample, logits[row:row + 1], [seq])
            tokens.append(None if result is None else result[0][0])
            logprobs.append(None if result is None or result[1] is None else result[1][0])
        return tokens, logprobs

    def _isolated(self, seq: Sequence, what: str, fn, *args):
        """`fn(*args)`; an error fails `seq`'s request (None is returned) instead of the step."""
        try:
            return fn(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            self._fail_request(seq.request_id, exc, what)
            return None

    def _fail_request(self, request_id: str, exc: BaseException, what: str) -> None:
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        failure = RequestFailed(f"request {request_id} failed in the engine while {what}: {type(exc).__name__}: {exc}")
        failure.__cause__ = exc
        self._failures[request_id] = failure
        logger.error("%s", failure, exc_info=exc)

    def _count_step(self, started: float) -> None:
        self._num_steps += 1
        self._step_seconds += time.perf_counter() - started

    def stats(self) -> dict[str, float]:
        """A snapshot for metrics: requests, waiting/running sequences, KV blocks, prefix-cache hit rate,
        steps that ran the model and their total seconds.

        Safe to call from another thread while the engine steps (it only reads counters); the numbers
        may then be a step apart from each other.
        """
        blocks = self.block_manager
        return {
            "num_requests": len(self.requests),
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "kv_blocks_total": blocks.num_blocks,
            "kv_blocks_free": blocks.num_free_blocks,
            "prefix_cache_hit_rate": blocks.stats.hit_rate,
            "num_steps": self._num_steps,
            "step_seconds_total": self._step_seconds,
        }

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Next token per sequence (one host sync), and per-row logprob dicts when asked."""
        md = SamplingMetadata.build(
            [s.params for s in seqs], [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
            [s.generator for s in seqs], self.vocab_size, self.device, self._banned_tokens(seqs),
        )
        out = self.sampler(logits, md)
        tokens = out.sampled_token_ids.tolist()
        if out.logprobs is None:
            return tokens, [None] * len(tokens)
        lp, ids = out.logprobs.tolist(), out.logprob_token_ids.tolist()
        rows = []
        for seq, lp_row, id_row in zip(seqs, lp, ids):
            n = seq.params.logprobs
            rows.append(None if n is None else dict(zip(id_row[: 1 + n], lp_row[: 1 + n])))
        return tokens, rows

    def _banned_tokens(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """Per row, the ids it may not generate now: EOS and stop ids below `min_new_tokens`, and the
        token that would complete a bad word. None when no row bans anything."""
        banned: list[list[int]] = []
        for seq in seqs:
            p = seq.params
            row: list[int] = []
            if len(seq.output_token_ids) < p.min_new_tokens:
                row.extend(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
            output = seq.output_token_ids
            for word in seq.bad_words_ids:
                prefix = len(word) - 1
                if prefix == 0 or (len(output) >= prefix and tuple(output[-prefix:]) == word[:-1]):
                    row.append(word[-1])
            banned.append(row)
        return banned if any(banned) else None

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> Response:
        """Add a sampled token, update text, apply stop rules; returns the delta."""
        seq.append_token(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        p = seq.params
        generated = len(seq.output_token_ids)
        reason = None
        text = ""
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        else:
            text, stopped = seq.stream.append(token)
            if stopped:
                reason = "stop"
        max_len = min(p.max_length or self.max_model_len, self.max_model_len)
        if reason is None and (seq.num_tokens >= max_len or (p.max_new_tokens is not None and generated >= p.max_new_tokens)):
            reason = "length"
        if reason is not None:
            tail, _ = seq.stream.finish()
            text += tail
            self.scheduler.finish(seq, reason)
            self._forget_if_done(seq.request_id)
        return self._delta(seq, text, [token], logprobs)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]

    def _delta(self, seq: Sequence, text: str, token_ids: list[int], logprobs: dict[int, float] | None) -> Response:
        return Response(
            generated_text=text,
            prompt_length=seq.num_prompt_tokens,
            generated_length=len(seq.output_token_ids),
            finish_reason=seq.finish_reason if seq.status is SequenceStatus.FINISHED else "none",
            token_ids=token_ids,
            logprobs=None if logprobs is None else [logprobs],
            # The prompt's logprobs ride on the first delta of the choice that computed them.
            prompt_logprobs=seq.prompt_logprobs if len(seq.output_token_ids) == 1 and token_ids else None,
            index=seq.index,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            request_id=seq.request_id,
        )

    def final_response(self, seq: Sequence) -> Response:
        """The whole completion of a finished (or aborted) sequence."""
        text = seq.stream.text
        if seq.params.return_full_text:
            text = full_text_prefix(self.tokenizer, seq.prompt_token_ids, seq.params) + text
        return Response(
            generated_text=text,
            prompt_length=seq.num_prompt_tokens,
            generated_length=len(seq.output_token_ids),
            finish_reason=seq.finish_reason or "none",
            token_ids=list(seq.output_token_ids),
            logprobs=seq.logprobs,
            prompt_logprobs=seq.prompt_logprobs,
            index=seq.index,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            request_id=seq.request_id,
        )

    def sequences(self, request_id: str) -> list[Sequence]:
        """The sequences (choices) of a live request."""
        return self.requests[request_id]

    def shutdown(self) -> None:
        """Abort everything and drop the model and KV cache so their memory can be freed."""
        for request_id in list(self.requests):
            self.abort(request_id)
        self.runner = None
        if self.tp_group is not None:
            self._stop_workers()
            self.tp_group = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """The longest text prompt (in characters) that could fit `max_model_len` tokens, or None when
    `tokenizer` cannot say; a longer text is refused without tokenizing it.

    A vocabulary entry spells its token in the tokenizer's own alphabet (byte-level BPE: one
    character per byte; SentencePiece: byte-fallback entries like `<0xE2>` are longer than the
    byte they stand for), so its length bounds the characters of text the token covers. The bound
    is doubled for normalizers that compose characters (NFKC: "e" + U+0301 -> one char).
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(get_vocab):
        return None
    token_chars = max(1, max((len(piece) for piece in get_vocab()), default=1))
    return 2 * token_chars * max_model_len

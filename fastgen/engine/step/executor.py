"""Executes one `ScheduledBatch`: the model, the prompt logprobs, sampling; returns a `StepOutput`.

Failure isolation lives here. A failure that only some requests' rows meet (in the model, the
sampler) fails those requests in the output (`StepOutput.failed`) and the step goes on for the
others: a failing batch is rerun chunk by chunk, a failing sampling batch row by row. Faults of
the engine itself (a dead tensor-parallel rank, device OOM) raise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fastgen.engine.block_manager import BlockManager
from fastgen.engine.grammar import StructuredOutputManager
from fastgen.engine.lora_manager import LoRAManager
from fastgen.engine.rejection_sampler import RejectionSampler
from fastgen.engine.speculator import Speculator
from fastgen.engine.step.row_sampling import sample_rows, score_prompt_tokens, verify_rows
from fastgen.engine.step.sampler import Sampler
from fastgen.engine.scheduler import ScheduledBatch, ScheduledChunk
from fastgen.engine.sequence import Sequence
from fastgen.engine.step.inputs import build_host_inputs, prompt_logit_positions
from fastgen.engine.step.output import StepOutput, TokenLogprobs
from fastgen.engine.stop_rules import StopRules
from fastgen.executor.distributed import TensorParallelGroup
from fastgen.executor.runner import ModelRunner
from fastgen.models.rope import LongRopeSwitch

logger = logging.getLogger("fastgen")


class StepExecutor:
    """Runs scheduled batches on a `ModelRunner` (through its tensor-parallel group, if any) and samples."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, stop_rules: StopRules,
                 long_rope: LongRopeSwitch | None = None, tp_group: TensorParallelGroup | None = None,
                 structured_outputs: StructuredOutputManager | None = None,
                 speculator: Speculator | None = None, lora: LoRAManager | None = None) -> None:
        """`stop_rules` say which tokens a row may not sample yet; `long_rope` is the model's LongRoPE
        switch; `tp_group` runs each step on every rank (None: this process alone);
        `structured_outputs` fills the grammar bitmask of constrained rows (None: no row is);
        `speculator` counts what verification of draft tokens accepts (None: no row has drafts);
        `lora` puts each step's adapters into device slots (None: LoRA is off)."""
        self.structured_outputs = structured_outputs
        self.runner = runner
        self.block_manager = block_manager
        self.stop_rules = stop_rules
        self.long_rope = long_rope
        self.tp_group = tp_group
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.speculator = speculator
        self.lora = lora
        self.vocab_size = runner.config.vocab_size

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run the model over `batch`, score its prompt-logprob rows and sample its sampling rows."""
        output = StepOutput()
        chunks, logits = self._forward(batch.chunks, output)
        sampling: list[ScheduledChunk] = []
        sample_rows_at: list[int] = []
        owners: list[tuple[Sequence, int]] = []
        owner_rows: list[int] = []
        row = 0
        for chunk in chunks:
            for position in prompt_logit_positions(chunk.seq, chunk.num_new_tokens):
                owners.append((chunk.seq, position))
                owner_rows.append(row)
                row += 1
            if chunk.samples:
                sampling.append(chunk)
                sample_rows_at.extend(range(row, row + 1 + len(chunk.draft_token_ids)))
                row += 1 + len(chunk.draft_token_ids)
        if owners:
            entries = score_prompt_tokens(logits[torch.tensor(owner_rows, device=logits.device)], owners)
            for (seq, _), entry in zip(owners, entries):
                output.prompt_logprobs.setdefault(seq.seq_id, []).append(entry)
        if sampling:
            if len(sample_rows_at) < logits.shape[0]:
                logits = logits[torch.tensor(sample_rows_at, device=logits.device)]
            self._sample_isolated(logits, sampling, output)
        return output

    def _execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        lora_slots = None if self.lora is None else self.lora.activate({c.seq.lora_id for c in chunks} - {0})
        host = build_host_inputs(chunks, self.block_manager, self.long_rope, lora_slots)
        if self.tp_group is not None:
            if self.lora is not None and (writes := self.lora.take_writes()):
                self.tp_group.send_lora_writes(writes)
            return self.tp_group.run_step(host, self.runner.execute)
        return self.runner.execute(host)

    def _forward(self, chunks: list[ScheduledChunk], output: StepOutput) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """The model over `chunks`: the chunks that ran and their logits rows (see `build_host_inputs`).
        When the batch fails, each chunk is rerun alone to find the requests that cause it; rerunning
        is safe because a step only writes its own tokens' KV slots."""
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
        ran: list[tuple[ScheduledChunk, torch.Tensor]] = []
        for chunk in chunks:
            if chunk.seq.request_id in output.failed:
                continue
            try:
                ran.append((chunk, self._execute([chunk])))
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                self._fail(output, chunk.seq, "running the model", exc)
                # Its full blocks were registered as cached prefixes before their KV was written.
                self.block_manager.reset_prefix_cache()
        # A request with several sequences may have failed after an earlier one ran.
        ran = [(chunk, rows) for chunk, rows in ran if chunk.seq.request_id not in output.failed]
        logits_rows = [rows for _, rows in ran if rows.shape[0]]
        logits = torch.cat(logits_rows) if logits_rows else torch.empty(0, self.vocab_size, device=self.runner.device)
        return [chunk for chunk, _ in ran], logits

    def _sample_isolated(self, logits: torch.Tensor, chunks: list[ScheduledChunk], output: StepOutput) -> None:
        """`_sample` for the sampling chunks into `output`; if it fails, chunk by chunk, failing only
        the requests whose rows fail. Chunk i owns 1 + its drafts consecutive rows of `logits`."""
        try:
            self._record(output, chunks, *self._sample(logits, chunks))
            return
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if len(chunks) == 1:
                self._fail(output, chunks[0].seq, "sampling", exc)
                return
            logger.warning("sampling %d rows failed (%s: %s); sampling them one by one",
                           len(chunks), type(exc).__name__, exc)
        row = 0
        for chunk in chunks:
            rows = logits[row:row + 1 + len(chunk.draft_token_ids)]
            row += rows.shape[0]
            if chunk.seq.request_id in output.failed:
                continue
            result = self._isolated(output, chunk.seq, "sampling", self._sample, rows, [chunk])
            if result is not None:
                self._record(output, [chunk], *result)
        for chunk in chunks:  # a request with several rows may have failed after an earlier one sampled
            if chunk.seq.request_id in output.failed:
                output.sampled_token_ids.pop(chunk.seq.seq_id, None)
                output.logprobs.pop(chunk.seq.seq_id, None)

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """The tokens of each sampling chunk (one host sync; several for a verification row) and
        their logprob dicts when asked."""
        seqs = [chunk.seq for chunk in chunks]
        drafts = [chunk.draft_token_ids for chunk in chunks]
        if not any(drafts):
            tokens, logprobs = sample_rows(self.sampler, logits, seqs, self.vocab_size, self.stop_rules,
                                           self.structured_outputs)
            return [[t] for t in tokens], [None if lp is None else [lp] for lp in logprobs]
        tokens, logprobs = verify_rows(self.rejection_sampler, logits, seqs, drafts, self.vocab_size,
                                       self.stop_rules, self.structured_outputs)
        for seq, draft, emitted in zip(seqs, drafts, tokens):
            self.speculator.observe(seq.seq_id, len(draft), len(emitted) - 1)
        return tokens, logprobs

    @staticmethod
    def _record(output: StepOutput, chunks: list[ScheduledChunk], tokens: list[list[int]],
                logprobs: list[list[TokenLogprobs] | None]) -> None:
        for chunk, row_tokens, row_logprobs in zip(chunks, tokens, logprobs):
            output.sampled_token_ids[chunk.seq.seq_id] = row_tokens
            if row_logprobs is not None:
                output.logprobs[chunk.seq.seq_id] = row_logprobs

    def _isolated(self, output: StepOutput, seq: Sequence, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`; an error fails `seq`'s request in `output` (None is returned) instead of the step."""
        try:
            return fn(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            self._fail(output, seq, what, exc)
            return None

    @staticmethod
    def _fail(output: StepOutput, seq: Sequence, what: str, exc: BaseException) -> None:
        logger.error("%s", output.fail(seq.request_id, what, exc), exc_info=exc)

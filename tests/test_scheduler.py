"""Tests of the Dynamic SplitFuse Scheduler: the real `schedule` and `update`, with a fake model.

No torch model runs: a "KV cache" list records which (position, token) each slot holds, and the
next token of a sequence is a fixed function of its id and output length, handed to
`Scheduler.update` in a made-up `StepOutput`, so a preempted and recomputed sequence must
reproduce exactly the same output. Random traces (arrivals over time, long and short prompts,
shared prefixes, n > 1, aborts, tight to plentiful KV caches) are checked after every step; the
unit tests pin the policy on small hand-made cases.
"""

import copy
import itertools
import math
import random
from collections import Counter

import pytest

from fastgen.engine.block_manager import BlockManager
from fastgen.sampling_params import SamplingParams
from fastgen.engine.scheduler import ScheduledBatch, Scheduler
from fastgen.engine.sequence import Sequence, SequenceStatus
from fastgen.engine.step.output import StepOutput

VOCAB = 50


def fake_token(seq: Sequence) -> int:
    """The model's next token for `seq`: depends only on its id and how many it has generated."""
    return (seq.seq_id * 7919 + len(seq.output_token_ids) * 104729 + 13) % VOCAB


class Sim:
    """Drives a real Scheduler and BlockManager with a fake model, checking every step."""

    def __init__(self, num_blocks: int, block_size: int, token_budget: int, max_seqs: int,
                 prefix_caching: bool = True, context_per_budget_token: int = 0) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.bm, token_budget, max_seqs, context_per_budget_token=context_per_budget_token)
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.max_new: dict[int, int] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self.aborted: set[str] = set()
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    def add(self, prompt: list[int], max_new: int, n: int = 1) -> list[Sequence]:
        """Queue a request of `n` choices that stop after `max_new` tokens (children start at fork)."""
        arrival = next(self._arrivals)
        params = SamplingParams(max_new_tokens=max_new)
        seqs = [Sequence(next(self._seq_ids), str(arrival), prompt, params, arrival, i) for i in range(n)]
        for seq in seqs:
            self.max_new[seq.seq_id] = max_new
        self.requests[str(arrival)] = seqs
        self.sched.add_request(seqs)
        return seqs

    def abort(self, request_id: str) -> None:
        """Abort every unfinished choice of a request."""
        self.aborted.add(request_id)
        live = request_id in self.sched.requests
        assert live == (not all(s.is_finished for s in self.requests[request_id]))
        ended = self.sched.abort(request_id)
        assert ended == (self.requests[request_id] if live else [])
        assert all(s.is_finished for s in ended) and request_id not in self.sched.requests

    @property
    def all_seqs(self) -> list[Sequence]:
        """Every sequence ever added, finished or not."""
        return [s for seqs in self.requests.values() for s in seqs]

    def step(self) -> ScheduledBatch:
        """One step: schedule, write fake KV, sample fake tokens, `update`; then check everything."""
        sched, bm = self.sched, self.bm
        running_before = {s.seq_id: s.num_pending_tokens for s in sched.running}
        waiting_before = list(sched.waiting)
        outputs_before = {s.seq_id: list(s.output_token_ids) for s in self.all_seqs}
        batch = sched.schedule()
        self._check_batch(batch, running_before, waiting_before, outputs_before)
        for chunk in batch.chunks:
            seq, ids = chunk.seq, chunk.seq.token_ids
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_new_tokens):
                self.kv[bm.slot(seq.seq_id, pos)] = (pos, ids[pos])
        for chunk in batch.chunks:  # every computed position reads back its own token
            self._check_kv(chunk.seq, chunk.seq.num_computed_tokens + chunk.num_new_tokens)
        sampling = [c.seq for c in batch.chunks if c.samples]
        assert sampling == [c.seq for c in batch.chunks
                            if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens]
        output = StepOutput({seq.seq_id: [fake_token(seq)] for seq in sampling})
        updates = sched.update(batch, output)
        assert [u.seq for u in updates] == sampling
        for update in updates:
            seq = update.seq
            assert update.token_ids == output.sampled_token_ids[seq.seq_id] == seq.output_token_ids[-1:]
            assert update.error is None and update.logprobs is None and update.text == ""
            done = len(seq.output_token_ids) >= self.max_new[seq.seq_id]
            assert seq.is_finished == done and (seq.finish_reason == "length" if done else True)
        self._check_state()
        return batch

    def _check_kv(self, seq: Sequence, num_computed: int) -> None:
        ids = seq.token_ids
        for pos in range(num_computed):
            assert self.kv[self.bm.slot(seq.seq_id, pos)] == (pos, ids[pos]), (seq, pos)

    def _check_batch(self, batch, running_before, waiting_before, outputs_before) -> None:
        sched, bm = self.sched, self.bm
        chunks = [(c.seq, c.num_new_tokens) for c in batch.chunks]
        ids = [s.seq_id for s, _ in chunks]
        assert len(ids) == len(set(ids)) <= sched.max_seqs
        assert batch.budget_spent == sum(charge(sched, s, n) for s, n in chunks)
        # Within the budget, unless a lone token had to overrun it for its prompt to progress.
        assert batch.budget_spent <= sched.token_budget or (
            chunks[-1][1] == 1 and batch.budget_spent - charge(sched, *chunks[-1]) < sched.token_budget)
        for seq, num_new in chunks:
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert 1 <= num_new <= seq.num_pending_tokens
            assert len(bm.block_table(seq.seq_id)) == bm.blocks_needed(seq.num_computed_tokens + num_new)
        # Decodes (one pending token, already running) come before every multi-token chunk.
        first_multi = next((i for i, (_, n) in enumerate(chunks) if n > 1), len(chunks))
        for i, (seq, _) in enumerate(chunks):
            if running_before.get(seq.seq_id) == 1:
                assert i < first_multi, f"decode of {seq} after a prompt chunk"
        # A chunk is cut only because one more token would overrun the budget left at its turn. Without
        # the attention charge that is the last chunk; with it, a later prompt's cheaper first tokens may
        # still fit what a deeper chunk's next token could not.
        spent = 0
        for i, (seq, num_new) in enumerate(chunks):
            if num_new < seq.num_pending_tokens:
                assert charge(sched, seq, num_new + 1) > sched.token_budget - spent
                assert sched.context_per_budget_token or i == len(chunks) - 1
            spent += charge(sched, seq, num_new)
        # FCFS: the sequences admitted are the head of the queue, in order.
        admitted = [s for s, _ in chunks if s.seq_id not in running_before]
        assert admitted == waiting_before[: len(admitted)]
        for seq in admitted:
            assert seq.num_computed_tokens % bm.block_size == 0 and seq.num_computed_tokens < seq.num_tokens
            if not bm.enable_prefix_caching:
                assert seq.num_computed_tokens == 0
        # Preempted: KV freed, outputs kept, back in the queue in arrival order (strict FCFS).
        arrivals = [s.arrival for s in sched.waiting]
        assert arrivals == sorted(arrivals), "waiting queue out of arrival order"
        assert all(seq in sched.waiting for seq in batch.preempted)
        left_out = [s for s in sched.running if s.seq_id not in set(ids)]
        for seq in batch.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
            assert seq.seq_id in running_before and seq.seq_id not in ids and seq not in sched.running
            assert seq.output_token_ids == outputs_before[seq.seq_id]
            with pytest.raises(ValueError, match="unknown seq_id"):
                bm.block_table(seq.seq_id)
            assert all(s.arrival <= seq.arrival for s in left_out), "an older sequence was preempted"
        # No budget is wasted while work is pending and the KV cache allows it.
        left = sched.token_budget - batch.budget_spent
        if left > 0 and len(chunks) < sched.max_seqs and not batch.preempted:
            assert not left_out, "a running sequence was skipped although budget was left"
            if sched.waiting:
                head, probe = sched.waiting[0], copy.deepcopy(bm)
                hit = probe.match_prefix(head.seq_id, head.token_ids)
                assert not probe.can_allocate(head.seq_id, hit + wanted_chunk(sched, head, hit, left)), \
                    "the head of the queue fit but was not admitted"

    def _check_state(self) -> None:
        sched, bm = self.sched, self.bm
        assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
        assert all(s.status is SequenceStatus.WAITING for s in sched.waiting)
        assert len({s.seq_id for s in sched.running} | {s.seq_id for s in sched.waiting}) == \
            len(sched.running) + len(sched.waiting)
        refs: Counter[int] = Counter()
        for seq in self.all_seqs:
            if seq.status is SequenceStatus.RUNNING:
                table = bm.block_table(seq.seq_id)
                assert len(table) == bm.blocks_needed(seq.num_computed_tokens)
                refs.update(table)
            else:
                with pytest.raises(ValueError, match="unknown seq_id"):
                    bm.block_table(seq.seq_id)
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == [refs[b] for b in range(bm.num_blocks)]
        assert bm.num_free_blocks == bm.num_blocks - len(refs)

    def check_done(self) -> None:
        """Everything finished, every block free, every completed output exactly as the model said."""
        assert not self.sched.has_unfinished() and not self.sched.running and not self.sched.waiting
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))
        for seq in self.all_seqs:
            assert seq.is_finished
            if seq.request_id in self.aborted:
                assert seq.finish_reason in ("abort", "length")
                continue
            assert seq.finish_reason == "length"
            expected = [(seq.seq_id * 7919 + i * 104729 + 13) % VOCAB for i in range(self.max_new[seq.seq_id])]
            assert seq.output_token_ids == expected


def charge(sched: Scheduler, seq: Sequence, num_new: int, computed: int | None = None) -> int:
    """The budget `num_new` of `seq`'s pending tokens spend (from `computed`, default its own), from the rule
    itself, not the Scheduler's code: one each, plus one per `context_per_budget_token` positions a prompt
    chunk's tokens attend."""
    context = sched.context_per_budget_token
    computed = seq.num_computed_tokens if computed is None else computed
    if not context or seq.num_tokens - computed == 1:
        return num_new
    attended = sum(computed + i + 1 for i in range(num_new))
    return num_new + math.ceil(attended / context)


def wanted_chunk(sched: Scheduler, seq: Sequence, computed: int, left: int) -> int:
    """The chunk the rule gives `seq` from `computed` with `left` budget: the longest whose charge fits, at least 1."""
    pending = seq.num_tokens - computed
    return max([n for n in range(1, min(pending, left) + 1) if charge(sched, seq, n, computed) <= left] or [1])


def run_until_done(sim: Sim, max_steps: int = 1000) -> int:
    """Step until nothing is left; every step must make progress. Returns the step count."""
    steps = 0
    while sim.sched.has_unfinished():
        assert sim.step().chunks, "deadlock: no tokens scheduled although requests are pending"
        steps += 1
        assert steps <= max_steps
    return steps


def random_trace(rng: random.Random, budget: int, block_size: int, shared_only: bool = False):
    """Requests (arrival step, prompt, max_new, n, abort step or None), sorted by arrival."""
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randint(2 * block_size, 3 * budget + block_size))]
             for _ in range(3)]
    reqs = []
    for _ in range(rng.randint(12, 20)):
        kind = rng.random()
        if shared_only or kind < 0.35:
            base = rng.choice(bases)
            prompt = base[: rng.randint(1, len(base))] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, budget))]
        elif kind < 0.5 and reqs:
            prompt = list(rng.choice(reqs)[1])
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3 * budget))]
        n = rng.choice([1, 1, 1, 2, 3])
        arrival = rng.randint(0, 40)
        abort = arrival + rng.randint(0, 25) if rng.random() < 0.15 else None
        reqs.append((arrival, prompt, rng.randint(1, 12), n, abort))
    return sorted(reqs, key=lambda r: r[0])


def run_trace(seed: int, budget: int, max_seqs: int, block_size: int, cache: str, caching: bool,
              shared_only: bool = False, context_per_budget_token: int = 0) -> Sim:
    """Play a seeded random trace to the end (arrivals and aborts by step), checking every step."""
    rng = random.Random(seed)
    reqs = random_trace(rng, budget, block_size, shared_only)
    longest = max(len(p) + m for _, p, m, _, _ in reqs)
    need = -(-longest // block_size)
    total = sum(n * -(-(len(p) + m) // block_size) for _, p, m, n, _ in reqs)
    num_blocks = {"tight": need, "medium": 2 * need, "plenty": total}[cache]
    sim = Sim(num_blocks, block_size, budget, max_seqs, caching, context_per_budget_token)
    # Generous no-starvation bound: one token of work per step, for every token of every choice (twice that
    # with the attention charge, whose shorter chunks make recomputing a preempted sequence take more steps).
    bound = (41 + sum(n * (len(p) + m) for _, p, m, n, _ in reqs)) * (2 if context_per_budget_token else 1)
    todo, aborts, step = list(reqs), [], 0
    while todo or sim.sched.has_unfinished():
        while todo and todo[0][0] <= step:
            _, prompt, max_new, n, abort = todo.pop(0)
            seqs = sim.add(prompt, max_new, n)
            if abort is not None:
                aborts.append((abort, seqs[0].request_id))
        for when, request_id in [a for a in aborts if a[0] <= step]:
            aborts.remove((when, request_id))
            sim.abort(request_id)
        if sim.sched.has_unfinished():
            assert sim.step().chunks, "deadlock: no tokens scheduled although requests are pending"
        step += 1
        assert step <= bound, f"not finished after {step} steps: starvation"
    sim.check_done()
    return sim


CONFIGS = [  # token_budget, max_seqs, block_size, KV cache, prefix caching
    (8, 1, 2, "tight", True),
    (8, 4, 4, "medium", False),
    (8, 8, 16, "tight", True),
    (16, 16, 2, "tight", False),
    (16, 3, 8, "plenty", True),
    (32, 8, 4, "tight", True),
    (32, 16, 16, "medium", True),
    (64, 12, 8, "plenty", False),
    (64, 2, 4, "tight", True),
]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("budget,max_seqs,block_size,cache,caching", CONFIGS)
def test_random_traces(seed, budget, max_seqs, block_size, cache, caching):
    run_trace(seed * 1000 + budget + max_seqs, budget, max_seqs, block_size, cache, caching)


@pytest.mark.parametrize("context", [1, 5, 40])
@pytest.mark.parametrize("budget,max_seqs,block_size,cache,caching", CONFIGS[::2])
def test_random_traces_with_attention_charge(context, budget, max_seqs, block_size, cache, caching):
    """Prompt chunks charged for their attention (1: a token attending 3 positions costs more than an
    8-token budget, so lone tokens must overrun it to progress)."""
    run_trace(context * 100 + budget + max_seqs, budget, max_seqs, block_size, cache, caching,
              context_per_budget_token=context)


@pytest.mark.parametrize("cache", ["tight", "plenty"])
def test_shared_prefix_trace_hits_the_prefix_cache(cache):
    sim = run_trace(7, 16, 4, 4, cache, True, shared_only=True)
    assert sim.bm.stats.hits > 0


def test_tight_cache_forces_preemption_and_recovers():
    preempted = 0
    for seed in range(4):
        sim = run_trace(100 + seed, 16, 8, 4, "tight", seed % 2 == 0)
        preempted += sum(s.num_preemptions for s in sim.all_seqs)
    assert preempted > 0


def test_constructor_errors():
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="token_budget"):
        Scheduler(bm, 0, 1)
    with pytest.raises(ValueError, match="max_seqs"):
        Scheduler(bm, 4, 5)
    with pytest.raises(ValueError, match="max_seqs"):
        Scheduler(bm, 4, 0)
    with pytest.raises(TypeError, match="token_budget"):
        Scheduler(bm, 8.0, 1)
    with pytest.raises(TypeError, match="max_seqs"):
        Scheduler(bm, 8, True)
    sched = Scheduler(bm, 4, 4)
    assert not sched.has_unfinished() and len(sched.schedule()) == 0


def chunk_sizes(batch: ScheduledBatch) -> list[tuple[int, int]]:
    """The batch as (seq_id, num_new) pairs."""
    return [(c.seq.seq_id, c.num_new_tokens) for c in batch.chunks]


def test_long_prompt_is_split_into_exact_chunks():
    sim = Sim(16, 4, 8, 4)
    (seq,) = sim.add(list(range(21)), max_new=2)
    assert [chunk_sizes(sim.step()) for _ in range(4)] == [[(0, 8)], [(0, 8)], [(0, 5)], [(0, 1)]]
    assert seq.is_finished and seq.num_preemptions == 0
    sim.check_done()


def test_attention_charge_shortens_deeper_chunks():
    # Budget 16, one budget token per 16 attended positions. Worked by hand from the rule: 11 tokens at
    # offset 0 spend 11 + ceil(66 / 16) = 16; 8 at 11 spend 8 + ceil((88 + 36) / 16) = 16; 6 at 19 spend
    # 6 + ceil(135 / 16) = 15 (7 would spend 18); then 5, 5, 4; the last token pending is charged alone.
    sim = Sim(16, 4, 16, 4, context_per_budget_token=16)
    (seq,) = sim.add(list(range(40)), max_new=2)
    batches = [sim.step() for _ in range(8)]
    assert [chunk_sizes(b) for b in batches] == [[(0, n)] for n in (11, 8, 6, 5, 5, 4, 1, 1)]
    assert [b.budget_spent for b in batches] == [16, 16, 15, 14, 16, 14, 1, 1]
    assert seq.is_finished
    sim.check_done()


def test_attention_charge_lets_a_lone_token_overrun_the_budget_to_progress():
    # One budget token per attended position: the first token of a prompt spends 1 + 1 of a 2-token
    # budget, each later one 1 + its position + 1, more than the budget, yet one goes each step; the
    # last pending token is charged alone.
    sim = Sim(8, 4, 2, 1, context_per_budget_token=1)
    (seq,) = sim.add(list(range(5)), max_new=1)
    batches = [sim.step() for _ in range(5)]
    assert [chunk_sizes(b) for b in batches] == [[(0, 1)]] * 5
    assert [b.budget_spent for b in batches] == [2, 3, 4, 5, 1]
    assert seq.is_finished
    sim.check_done()


def test_short_prompts_are_fused_and_the_last_is_cut():
    sim = Sim(32, 4, 16, 8)
    for length in (3, 4, 5, 10):
        sim.add([length] * length, max_new=1)
    assert chunk_sizes(sim.step()) == [(0, 3), (1, 4), (2, 5), (3, 4)]
    assert chunk_sizes(sim.step()) == [(3, 6)]
    run_until_done(sim)
    sim.check_done()


def test_decodes_come_before_a_new_long_prompt():
    sim = Sim(32, 4, 8, 4)
    sim.add([1, 2, 3], max_new=5)
    sim.add([4, 5], max_new=5)
    assert chunk_sizes(sim.step()) == [(0, 3), (1, 2)]
    sim.add(list(range(20)), max_new=1)
    assert chunk_sizes(sim.step()) == [(0, 1), (1, 1), (2, 6)]
    assert chunk_sizes(sim.step()) == [(0, 1), (1, 1), (2, 6)]
    run_until_done(sim)
    sim.check_done()


def test_preemption_takes_the_newest_first():
    # 6 blocks of 2 hold A (4 tokens), B and C (3 each). A's decode needs a seventh block: the
    # newest, C, is preempted (not B), freeing 2 blocks; B's decode fits in its own last block.
    sim = Sim(6, 2, 16, 4)
    a, b, c = (sim.add(p, max_new=3)[0] for p in ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10]))
    assert chunk_sizes(sim.step()) == [(0, 4), (1, 3), (2, 3)]
    batch = sim.step()
    assert chunk_sizes(batch) == [(0, 1), (1, 1)] and batch.preempted == [c]
    assert list(sim.sched.waiting) == [c] and c.num_preemptions == 1 and len(c.output_token_ids) == 1
    assert a.num_preemptions == b.num_preemptions == 0
    run_until_done(sim)
    sim.check_done()


def test_second_identical_prompt_reuses_the_finished_ones_blocks():
    sim = Sim(8, 4, 8, 2)
    prompt = list(range(13))
    sim.add(prompt, max_new=2)
    run_until_done(sim)
    (second,) = sim.add(prompt, max_new=2)
    batch = sim.step()
    assert chunk_sizes(batch) == [(1, 1)] and second.num_computed_tokens == 13
    assert second.num_cached_prompt_tokens == 12 and sim.bm.stats.hits == 12
    run_until_done(sim)
    sim.check_done()


def test_n_choices_fork_and_share_the_prompt_blocks():
    sim = Sim(16, 4, 16, 4)
    parent, *children = sim.add(list(range(9)), max_new=3, n=3)
    assert chunk_sizes(sim.step()) == [(0, 9)]
    table = sim.bm.block_table(parent.seq_id)
    assert [c.num_computed_tokens for c in children] == [8, 8] and not parent.children
    assert [sim.bm.ref_count(b) for b in table] == [3, 3, 1]
    assert chunk_sizes(sim.step()) == [(0, 1), (1, 1), (2, 1)]  # each child recomputes token 8 only
    run_until_done(sim)
    sim.check_done()


@pytest.mark.parametrize("caching", [True, False])
def test_sequence_that_cannot_grow_preempts_itself_and_resumes(caching):
    # 4 blocks of 2: A (3 tokens) and B (4 tokens) fill the cache. A's decode fits in its
    # half-full block, B's needs a fifth block and A is already scheduled: B preempts itself.
    sim = Sim(4, 2, 8, 2, caching)
    a = sim.add([1, 2, 3], max_new=2)[0]
    b = sim.add([4, 5, 6, 7], max_new=3)[0]
    assert chunk_sizes(sim.step()) == [(0, 3), (1, 4)]
    batch = sim.step()
    assert chunk_sizes(batch) == [(0, 1)] and batch.preempted == [b]
    assert a.is_finished and b.num_preemptions == 1 and len(b.output_token_ids) == 1
    batch = sim.step()  # B resumes: with prefix caching only its last token is recomputed
    assert chunk_sizes(batch) == [(1, 1 if caching else 5)]
    assert b.num_computed_tokens == 5
    run_until_done(sim)
    sim.check_done()

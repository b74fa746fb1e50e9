"""`Scheduler.update` applying made-up `StepOutput`s: several tokens per row (a stop id, stop string or
length limit in the middle of the list), logprobs, prompt logprobs, failed requests, `n` choices."""

import itertools

import pytest

from fastgen.engine.block_manager import BlockManager
from fastgen.engine.detokenizer import TextStream
from fastgen.engine.scheduler import ScheduledBatch, Scheduler
from fastgen.engine.sequence import Sequence
from fastgen.engine.step.output import RequestFailed, StepOutput
from fastgen.engine.stop_rules import StopRules
from fastgen.sampling_params import SamplingParams

EOS = 9
NUM_BLOCKS = 16


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i): text is easy to predict."""

    @staticmethod
    def decode(ids, **_):
        return "".join(chr(97 + i) for i in ids)


class Harness:
    """A real Scheduler over a real BlockManager; steps are applied with hand-written outputs."""

    def __init__(self, max_model_len: int | None = None) -> None:
        self.bm = BlockManager(NUM_BLOCKS, 4)
        self.sched = Scheduler(self.bm, 32, 8, stop_rules=StopRules([EOS], max_model_len))
        self._ids = itertools.count()

    def add(self, prompt: list[int], n: int = 1, text: bool = False, **params) -> list[Sequence]:
        p = SamplingParams(**params)
        request_id = f"r{next(self._ids)}"
        arrival = next(self._ids)
        seqs = [Sequence(next(self._ids), request_id, prompt, p, arrival, i) for i in range(n)]
        if text:
            for seq in seqs:
                seq.stream = TextStream(Letters(), prompt, p.stop, include_stop=p.include_stop_str_in_output)
        self.sched.add_request(seqs)
        return seqs

    def step(self, tokens: dict[Sequence, list[int]], **output) -> tuple[ScheduledBatch, list]:
        """Schedule, then update with `tokens` for every sampling row (missing rows get [1])."""
        batch = self.sched.schedule()
        sampled = {c.seq.seq_id: tokens.get(c.seq, [1]) for c in batch.chunks if c.samples}
        return batch, self.sched.update(batch, StepOutput(sampled, **output))


def test_eos_in_the_middle_of_a_row_truncates_it():
    h = Harness()
    (seq,) = h.add([1, 2, 3], max_new_tokens=10)
    _, (update,) = h.step({seq: [4, EOS, 5]})
    assert update.token_ids == [4, EOS] and seq.output_token_ids == [4, EOS]
    assert seq.is_finished and seq.finish_reason == "stop" and not h.sched.requests
    assert h.bm.num_free_blocks == NUM_BLOCKS


def test_stop_string_in_the_middle_of_a_row_truncates_text_and_tokens():
    h = Harness()
    (seq,) = h.add([0], text=True, stop=["cd"], max_new_tokens=10)
    _, (first,) = h.step({seq: [1]})  # "b"
    assert (first.token_ids, first.text, seq.is_finished) == ([1], "b", False)
    _, (update,) = h.step({seq: [2, 3, 4]})  # "c", "d" matches "cd": "e" is never appended
    assert update.token_ids == [2, 3] and seq.output_token_ids == [1, 2, 3]
    assert update.text == "" and seq.stream.text == "b" and seq.finish_reason == "stop"


def test_length_limits_cut_a_row():
    h = Harness(max_model_len=7)
    (short,) = h.add([1, 2], max_new_tokens=3)
    (capped,) = h.add([1, 2, 3, 4], max_new_tokens=10)  # max_model_len 7: three tokens left
    _, updates = h.step({short: [5, 6, 7, 8], capped: [5, 6, 7, 8]})
    assert [u.token_ids for u in updates] == [[5, 6, 7], [5, 6, 7]]
    assert short.finish_reason == capped.finish_reason == "length"
    (limited,) = h.add([1, 2], max_length=4)
    _, (update,) = h.step({limited: [3, 3, 3]})
    assert update.token_ids == [3, 3] and limited.finish_reason == "length"


def test_stop_ids_do_not_stop_below_min_new_tokens():
    h = Harness()
    (seq,) = h.add([1, 2], min_new_tokens=2, stop_token_ids=[7], max_new_tokens=10)
    _, (update,) = h.step({seq: [7, EOS, 7, 5]})
    assert update.token_ids == [7, EOS, 7] and seq.finish_reason == "stop"
    # The same rule bans them from sampling while the output is shorter than min_new_tokens.
    assert set(h.sched.stop_rules.banned_tokens(Sequence(99, "x", [1], seq.params, 0))) == {7, EOS}


def test_each_token_advances_logprobs_and_prompt_logprobs_land_once():
    h = Harness()
    (seq,) = h.add([1, 2, 3], logprobs=1, prompt_logprobs=1, max_new_tokens=10)
    entries = [{2: -0.5}, {3: -0.25}]
    lps = [{4: -0.1}, {5: -0.2}]
    _, (update,) = h.step({seq: [4, 5]}, logprobs={seq.seq_id: lps}, prompt_logprobs={seq.seq_id: entries})
    assert update.logprobs == lps and seq.logprobs == lps
    assert seq.prompt_logprobs == [None, *entries]
    assert seq.num_computed_tokens == 3 and seq.num_tokens == 5 and seq.num_pending_tokens == 2


def test_failed_request_ends_every_choice_and_frees_its_blocks():
    h = Harness()
    ok = h.add([1, 2, 3], max_new_tokens=5)[0]
    parent, child = h.add([4, 5, 6, 7, 8], n=2, max_new_tokens=5)
    h.step({})  # both prompts: the parent's child is forked
    assert not child.is_finished and child in h.sched.running
    error = RequestFailed("boom")
    _, updates = h.step({}, failed={parent.request_id: error})
    failed = [u for u in updates if u.error is not None]
    assert [(u.seq, u.error, u.token_ids) for u in failed] == [(parent, error, [])]
    assert parent.finish_reason == child.finish_reason == "error"
    assert parent.request_id not in h.sched.requests and ok.request_id in h.sched.requests
    assert [u.seq for u in updates if u.error is None] == [ok]
    h.step({ok: [EOS]})
    assert h.bm.num_free_blocks == NUM_BLOCKS and not h.sched.has_unfinished()


def test_detokenizer_fault_fails_only_its_request():
    h = Harness()
    (good,) = h.add([0], text=True, max_new_tokens=5)
    bad, sibling = h.add([0], n=2, text=True, max_new_tokens=5)
    h.step({})

    class Exploding:
        def append(self, token):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated decoder fault")

    bad.stream = Exploding()
    _, updates = h.step({})
    assert [u.seq for u in updates if u.error is None] == [good]
    (failure,) = [u for u in updates if u.error is not None]
    assert isinstance(failure.error, RequestFailed) and "detokenizing" in str(failure.error)
    assert bad.finish_reason == sibling.finish_reason == "error" and h.sched.running == [good]


def test_n_choices_fork_once_the_prompt_is_computed():
    h = Harness()
    parent, *children = h.add(list(range(1, 10)), n=3, max_new_tokens=2)
    batch, updates = h.step({})
    assert [c.num_new_tokens for c in batch.chunks] == [9] and [u.seq for u in updates] == [parent]
    assert all(c in h.sched.running and c.num_computed_tokens == 8 for c in children)
    batch, updates = h.step({})
    assert [u.seq for u in updates] == [parent, *children]
    assert parent.is_finished and all(c.num_tokens == 10 for c in children)


def test_a_sampling_row_without_tokens_is_an_engine_bug():
    h = Harness()
    h.add([1, 2])
    batch = h.sched.schedule()
    with pytest.raises(KeyError):
        h.sched.update(batch, StepOutput())

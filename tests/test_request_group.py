"""The way out to callers, driven directly: `merge_deltas`, `RequestGroup` (blocking, driven and
asyncio faces; prefixes, early exit, failures, refusals) and `Deliveries` (when a request's sink ends)."""

import asyncio
import threading

import pytest

from fastgen.engine import END, Deliveries, RequestFailed, RequestGroup, merge_deltas
from fastgen.outputs import Response
from fastgen.sampling_params import FieldError


def delta(text, finish="none", *, rid="r", index=0, prompt_index=0, ids=None, logprobs=None, error=None):
    return Response(generated_text=text, prompt_length=3, generated_length=len(text), finish_reason=finish,
                    token_ids=list(ids if ids is not None else range(len(text))), logprobs=logprobs, index=index,
                    prompt_index=prompt_index, request_id=rid, error=error)


class FakeMember:
    """A submitted request that records its aborts."""

    def __init__(self, request_id):
        self.request_id = request_id
        self.aborts = 0

    def abort(self):
        self.aborts += 1


def group_of(count, num_choices=1, **kwargs):
    group = RequestGroup(num_choices, **kwargs)
    sinks = []
    for i in range(count):
        sinks.append(group.sink(i))
        group.add(FakeMember(f"r{i}"))
    return group, sinks


# merge_deltas ----------------------------------------------------------------------------------

def test_merge_deltas_concatenates_each_completion_in_prompt_then_choice_order():
    deltas = [
        delta("Hel", prompt_index=1, index=1, ids=[1], logprobs=[{1: -0.5}]),
        delta("ab", prompt_index=0, index=0, ids=[7, 8]),
        delta("lo", "length", prompt_index=1, index=1, ids=[2], logprobs=[{2: -0.25}]),
        delta("Yo", "stop", prompt_index=1, index=0, ids=[5]),
        delta("c", "stop", prompt_index=0, index=0, ids=[9]),
    ]
    merged = merge_deltas(deltas)
    assert [(r.prompt_index, r.index) for r in merged] == [(0, 0), (1, 0), (1, 1)]
    assert [r.generated_text for r in merged] == ["abc", "Yo", "Hello"]
    assert [r.token_ids for r in merged] == [[7, 8, 9], [5], [1, 2]]
    assert [r.finish_reason for r in merged] == ["stop", "stop", "length"]
    assert merged[2].logprobs == [{1: -0.5}, {2: -0.25}] and merged[0].logprobs is None
    assert merged[2].generated_length == 2  # the last delta's count, not a sum
    assert deltas[0].generated_text == "Hel" and deltas[0].token_ids == [1]  # the inputs are left alone


def test_merge_deltas_of_nothing_is_nothing():
    assert merge_deltas([]) == []


# RequestGroup ----------------------------------------------------------------------------------

def test_group_interleaves_prompts_stamps_them_and_prefixes_each_completion():
    group, sinks = group_of(2, num_choices=2, prefixes=["P0 ", ""])

    def produce():
        sinks[1](delta("x", rid="r1"))
        sinks[0](delta("a", rid="r0", index=1))
        sinks[0](delta("b", "stop", rid="r0", index=0))
        sinks[0](delta("c", "stop", rid="r0", index=1))
        sinks[0](END)
        sinks[1](delta("y", "length", rid="r1"))
        sinks[1](END)

    threading.Thread(target=produce).start()
    seen = list(group)
    assert [(d.prompt_index, d.index, d.generated_text) for d in seen] == [
        (1, 0, "x"), (0, 1, "P0 a"), (0, 0, "P0 b"), (0, 1, "c"), (1, 0, "y")]
    assert [r.generated_text for r in merge_deltas(seen)] == ["P0 b", "P0 ac", "xy"]
    assert [m.aborts for m in group.members] == [0, 0]  # read to the end: nothing to abort
    assert group.request_ids == ["r0", "r1"]


def test_results_are_the_merged_finals():
    group, sinks = group_of(2)
    for i, sink in enumerate(sinks):
        sink(delta("he", rid=f"r{i}"))
        sink(delta("y" * (i + 1), "stop", rid=f"r{i}"))
        sink(END)
    assert [(r.prompt_index, r.generated_text) for r in group.results()] == [(0, "hey"), (1, "heyy")]


def test_leaving_early_aborts_only_the_requests_that_have_not_ended():
    group, sinks = group_of(3)
    sinks[0](delta("a", rid="r0"))
    sinks[1](delta("done", "stop", rid="r1"))
    sinks[1](END)
    for _ in group:
        break
    # r1 had ended by the time the batch was read: only r0 and r2 are aborted.
    assert [m.aborts for m in group.members] == [1, 0, 1]


def test_a_failure_aborts_the_others_and_is_raised_once_every_request_has_ended():
    group, sinks = group_of(2)
    failure = RequestFailed("request r1 failed in the engine")
    sinks[0](delta("a", rid="r0"))
    sinks[1](failure)
    sinks[1](END)

    def finish_r0_after_its_abort():
        while group.members[0].aborts == 0:
            pass
        sinks[0](delta("b", "abort", rid="r0"))  # what an aborted request still delivers
        sinks[0](END)

    thread = threading.Thread(target=finish_r0_after_its_abort)
    thread.start()
    seen = []
    with pytest.raises(RequestFailed, match="r1 failed"):
        for d in group:
            seen.append(d)
    thread.join(5)
    assert group.members[0].aborts >= 1  # (aborting the failed one as well is harmless: it has ended)
    assert all(d.generated_text != "b" for d in seen)  # nothing after the failure reaches the reader


def test_drive_is_called_while_the_inbox_is_empty():
    group, sinks = group_of(1)
    script = iter([lambda: None, lambda: sinks[0](delta("a", rid="r0")), lambda: None,
                   lambda: (sinks[0](delta("b", "stop", rid="r0")), sinks[0](END))])
    calls = []

    def drive():
        calls.append(1)
        next(script)()

    group._drive = drive
    assert [d.generated_text for d in group] == ["a", "b"]
    assert len(calls) == 4


def test_submit_each_names_the_refused_prompt_and_aborts_the_submitted_ones():
    group = RequestGroup()
    submitted = []

    def submit(prompt, sink):
        if prompt == "bad":
            raise ValueError("token id 10**6 is outside the vocabulary")
        submitted.append(FakeMember(f"r{len(submitted)}"))
        return submitted[-1]

    with pytest.raises(ValueError, match=r"prompts\[1\]: token id") as info:
        group.submit_each(["ok", "bad", "never"], submit, "prompts")
    assert isinstance(info.value, FieldError) and info.value.field == "prompts"
    assert [m.aborts for m in submitted] == [1]  # the third prompt was never submitted


def test_asyncio_face_reads_deltas_delivered_from_another_thread():
    async def main():
        group = RequestGroup(asynchronous=True)
        sinks = [group.sink(0), group.sink(1)]
        for i in range(2):
            group.add(FakeMember(f"r{i}"))

        def produce():
            for i, sink in enumerate(sinks):
                sink(delta("hi", rid=f"r{i}"))
                sink(delta("!", "stop", rid=f"r{i}"))
                sink(END)

        threading.Thread(target=produce).start()
        return [(d.prompt_index, d.generated_text) async for d in group]

    seen = asyncio.run(main())
    assert sorted(seen) == [(0, "!"), (0, "hi"), (1, "!"), (1, "hi")]


# Deliveries ------------------------------------------------------------------------------------

def recorder():
    items = []
    return items, items.append


def test_a_request_ends_after_the_final_delta_of_each_choice():
    deliveries = Deliveries()
    items, sink = recorder()
    deliveries.open("a", sink, num_choices=2)
    assert deliveries.deliver(delta("x", rid="a"))
    assert deliveries.deliver(delta("y", "stop", rid="a", index=1))
    assert "a" in deliveries and items[-1] is not END
    assert deliveries.deliver(delta("z", "length", rid="a"))
    assert items[-1] is END and "a" not in deliveries and len(items) == 4
    assert not deliveries.deliver(delta("late", rid="a"))  # an ended request's sink is never called again
    assert len(items) == 4


def test_an_error_delta_ends_its_request_with_the_error():
    deliveries = Deliveries()
    items, sink = recorder()
    deliveries.open("a", sink, num_choices=3)
    error = RequestFailed("boom")
    assert deliveries.deliver(delta("", "error", rid="a", error=error))
    assert items == [error, END] and not deliveries


def test_close_all_ends_every_open_request_once():
    deliveries = Deliveries()
    logs = {rid: recorder() for rid in "abc"}
    for rid, (_, sink) in logs.items():
        deliveries.open(rid, sink)
    deliveries.deliver(delta("done", "stop", rid="b"))
    error = RuntimeError("the engine loop was shut down")
    assert sorted(deliveries.close_all(error)) == ["a", "c"]
    assert logs["a"][0] == [error, END] and logs["b"][0][-1] is END and error not in logs["b"][0]
    assert not deliveries.close("a") and deliveries.request_ids() == []


def test_a_request_opened_without_a_choice_count_ends_only_when_closed():
    deliveries = Deliveries()
    items, sink = recorder()
    deliveries.open("remote", sink, num_choices=None)
    deliveries.deliver(delta("x", "stop", rid="remote"))
    assert "remote" in deliveries and END not in items
    assert deliveries.close("remote") and items[-1] is END


def test_open_refuses_a_duplicate_id_and_a_bad_choice_count():
    deliveries = Deliveries()
    deliveries.open("a", lambda item: None)
    with pytest.raises(ValueError, match="already open"):
        deliveries.open("a", lambda item: None)
    with pytest.raises(ValueError, match="num_choices"):
        deliveries.open("b", lambda item: None, num_choices=0)

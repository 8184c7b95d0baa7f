"""fuzz/targets/streams.py: the deferred executor standing in for a GPU's streams and events."""

from __future__ import annotations

from radixspec.fuzz.targets.streams import Executor


def test_a_stream_runs_its_operations_in_order_only_when_told() -> None:
    ex = Executor()
    device = ex.module()
    lane = device.Stream()
    ran: list[int] = []
    with device.stream(lane):
        for n in range(3):
            device.current_stream().enqueue(lambda n=n: ran.append(n))
        done = device.Event()
        done.record()
    assert ex.current is ex.default and ran == [] and not done.query() and lane.pending == 3
    assert lane.step(2) == 2 and ran == [0, 1] and not done.query()
    done.synchronize()
    assert ran == [0, 1, 2] and done.query() and lane.query()
    assert lane.step(5) == 0


def test_the_default_stream_runs_at_once_and_an_unrecorded_event_is_done() -> None:
    ex = Executor()
    ran: list[str] = []
    ex.default.enqueue(lambda: ran.append("now"))
    assert ran == ["now"] and ex.module().Event().query()


def test_a_wait_runs_the_other_stream_first() -> None:
    """A stream that waits on another's event (or on the stream) runs it that far before its own next operation."""
    ex = Executor()
    device = ex.module()
    first, second = device.Stream(), device.Stream()
    ran: list[str] = []
    first.enqueue(lambda: ran.append("a1"))
    marker = device.Event()
    marker.record(first)
    first.enqueue(lambda: ran.append("a2"))
    second.wait_event(marker)
    second.enqueue(lambda: ran.append("b1"))
    second.step(2)
    assert ran == ["a1", "b1"] and first.pending == 1
    second.wait_stream(first)
    second.synchronize()
    assert ran == ["a1", "b1", "a2"]


def test_synchronize_runs_every_stream() -> None:
    ex = Executor()
    device = ex.module()
    lanes = [device.Stream(), device.Stream()]
    ran: list[int] = []
    for n, lane in enumerate(lanes):
        lane.enqueue(lambda n=n: ran.append(n))
    device.synchronize()
    assert sorted(ran) == [0, 1] and all(lane.query() for lane in lanes)

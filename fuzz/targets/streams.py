"""A GPU's streams and events as a deferred executor the fuzzer drives: an engine's transfers between tiers run
when the machine says, not when the engine submits them.

An engine submits a host<->device copy on a stream and learns that it finished by querying an event recorded
after it. On a GPU the copy runs some time later, in stream order; the engine must neither free nor reuse the
pages it reads or writes before that event. Here each stream is a :class:`Lane`: a queue of operations, run in
order only when the machine (or a wait the engine itself makes) runs them. An :class:`Event` is recorded at a
lane's tail and is done once the lane ran that far; ``synchronize`` runs the lane to it, as a blocking wait
does on a GPU; a lane that waits on an event or on another lane runs that one far enough first. The default
lane (the compute stream) runs what is put on it at once.

``Executor.module()`` is what the engine gets in place of ``torch.cuda`` (its ``get_device_module()``):
``Stream``, ``Event``, ``current_stream``, ``stream(...)``, ``synchronize``. Copies enter a lane through the
engine's transfer kernels, which an adapter replaces by torch copies that ``enqueue`` themselves
(``fuzz/targets/sglang_hicache.py``). Nothing here knows an engine.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator


class Lane:
    """A stream: its operations run in order, when ``run_to`` reaches them (the default lane runs them at once)."""

    def __init__(self, executor: Executor, name: str, immediate: bool = False) -> None:
        self.executor, self.name, self.immediate = executor, name, immediate
        self.ops: list[Callable[[], None]] = []
        # how many operations ran
        self.done = 0

    @property
    def pending(self) -> int:
        return len(self.ops) - self.done

    def enqueue(self, op: Callable[[], None]) -> None:
        self.ops.append(op)
        if self.immediate:
            self.run_to(len(self.ops))

    def run_to(self, index: int) -> None:
        """Run the operations before ``index`` that have not run, in order."""
        while self.done < min(index, len(self.ops)):
            op = self.ops[self.done]
            self.done += 1
            op()

    def step(self, count: int) -> int:
        """Run up to ``count`` more operations; how many ran."""
        before = self.done
        self.run_to(self.done + count)
        return self.done - before

    # torch.cuda.Stream's methods, as the engine calls them
    def synchronize(self) -> None:
        self.run_to(len(self.ops))

    def query(self) -> bool:
        return self.pending == 0

    def wait_event(self, event: Event) -> None:
        lane, index = event.lane, event.index
        if lane is not None and lane is not self:
            self.enqueue(lambda: lane.run_to(index))

    def wait_stream(self, other: Lane) -> None:
        if other is not self:
            index = len(other.ops)
            self.enqueue(lambda: other.run_to(index))


class Event:
    """torch.cuda.Event: recorded at a lane's tail, done once the lane ran that far (never recorded: done)."""

    def __init__(self, executor: Executor, enable_timing: bool = False, **_: object) -> None:
        self.executor = executor
        self.lane: Lane | None = None
        self.index = 0

    def record(self, stream: Lane | None = None) -> None:
        self.lane = stream or self.executor.current
        self.index = len(self.lane.ops)

    def query(self) -> bool:
        return self.lane is None or self.lane.done >= self.index

    def synchronize(self) -> None:
        if self.lane is not None:
            self.lane.run_to(self.index)

    def wait(self, stream: Lane | None = None) -> None:
        (stream or self.executor.current).wait_event(self)

    def elapsed_time(self, other: Event) -> float:
        return 0.0


class Executor:
    """The lanes of one process: the default one, and every stream the engine made that is still alive (a
    campaign builds an engine per example: their streams go with them)."""

    def __init__(self) -> None:
        self.default = Lane(self, "default", immediate=True)
        self.current = self.default
        self.lanes: weakref.WeakSet[Lane] = weakref.WeakSet()
        self.made = 0

    def make_lane(self, *args: object, **kwargs: object) -> Lane:
        lane = Lane(self, f"stream {self.made}")
        self.made += 1
        self.lanes.add(lane)
        return lane

    @contextlib.contextmanager
    def stream(self, lane: Lane | None) -> Iterator[None]:
        before, self.current = self.current, lane or self.default
        try:
            yield
        finally:
            self.current = before

    def synchronize(self, *args: object, **kwargs: object) -> None:
        for lane in self.lanes:
            lane.synchronize()

    def module(self, name: str = "radixspec_streams") -> types.ModuleType:
        """The device module the engine is given in place of ``torch.cuda``."""
        module = types.ModuleType(name)
        for attribute, value in {
            "Stream": self.make_lane,
            "Event": lambda *args, **kwargs: Event(self, *args, **kwargs),
            "current_stream": lambda *args, **kwargs: self.current,
            "stream": self.stream,
            "synchronize": self.synchronize,
            "is_available": lambda: True,
            "device_count": lambda: 1,
        }.items():
            setattr(module, attribute, value)
        return module

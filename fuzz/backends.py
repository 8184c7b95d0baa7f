"""Where a campaign's batches run: in this process, in worker processes (a fork server that imported the
machines once), or as Ray tasks. Each backend takes batch specs and hands back batch results; a backend that
breaks (a worker died, Ray unreachable) raises BackendError, and the campaign exits 3."""

from __future__ import annotations

import argparse
import os
import queue
import sys
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from multiprocessing.queues import Queue
from typing import TYPE_CHECKING, Protocol

from .batches import BatchResult, BatchSpec, Notify, run_batch

if TYPE_CHECKING:
    from ray import ObjectRef

# a failure announced by a worker: run_batch's notify arguments (machine, seed, message, time)
Announcement = tuple[str, int, str, float]


class BackendError(RuntimeError):
    """The campaign's own machinery failed (a worker died, Ray is unreachable)."""


class InProcessBackend:
    """Batches one at a time in this process (``--workers 0``)."""

    name = "this process"

    def __init__(self, args: argparse.Namespace) -> None:
        self.pending: list[BatchSpec] = []

    def has_room(self) -> bool:
        return not self.pending

    def submit(self, spec: BatchSpec) -> None:
        self.pending.append(spec)

    def busy(self) -> bool:
        return bool(self.pending)

    def collect(self, timeout: float, notify: Notify) -> list[BatchResult]:
        spec = self.pending.pop()
        return [run_batch(spec, notify)]

    def cancel(self) -> None:
        self.pending.clear()

    def close(self) -> None:
        pass


_NOTIFY_QUEUE: Queue[Announcement] | None = None


def _init_worker(notify_queue: Queue[Announcement]) -> None:
    """A worker process: keep the queue failures are announced on; one torch thread (the cores are the workers),
    without importing torch where no target needs it (it reads OMP_NUM_THREADS when a target imports it)."""
    global _NOTIFY_QUEUE
    _NOTIFY_QUEUE = notify_queue
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _announce(machine: str, seed: int, message: str, at: float) -> None:
    """A worker's failure, put on the queue the campaign's process drains."""
    assert _NOTIFY_QUEUE is not None, "_init_worker sets the queue in every worker"
    _NOTIFY_QUEUE.put((machine, seed, message, at))


def _run_batch_in_worker(spec: BatchSpec) -> BatchResult:
    return run_batch(spec, _announce)


class ProcessBackend:
    """Batches in worker processes, one per core by default (``--workers N``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        # a fork server that imported the machines once: each worker starts in milliseconds, not seconds
        context = get_context("forkserver")
        context.set_forkserver_preload(["radixspec.fuzz.batches", "radixspec.fuzz.machines"])
        self.workers: int = args.workers
        self.name = f"{self.workers} worker processes"
        self.notify_queue: Queue[Announcement] = context.Queue()
        self.pool = ProcessPoolExecutor(
            max_workers=self.workers, mp_context=context, initializer=_init_worker, initargs=(self.notify_queue,)
        )
        self.futures: set[Future[BatchResult]] = set()

    def has_room(self) -> bool:
        return len(self.futures) < int(self.workers)

    def submit(self, spec: BatchSpec) -> None:
        self.futures.add(self.pool.submit(_run_batch_in_worker, spec))

    def busy(self) -> bool:
        return bool(self.futures)

    def collect(self, timeout: float, notify: Notify) -> list[BatchResult]:
        done, self.futures = wait(self.futures, timeout=timeout, return_when=FIRST_COMPLETED)
        self.drain(notify)
        results = []
        for future in done:
            try:
                results.append(future.result())
            except Exception as exc:  # a worker that died takes its batch with it: the campaign is broken
                raise BackendError(f"a worker process failed: {exc!r}") from exc
        return results

    def drain(self, notify: Notify) -> None:
        while True:
            try:
                event = self.notify_queue.get_nowait()
            except queue.Empty:
                return
            notify(*event)

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()
        for process in list(getattr(self.pool, "_processes", {}).values()):
            process.terminate()
        self.futures.clear()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class ReportsResources(Protocol):
    """The ``ray`` module's resource listing (untyped in Ray): what the backend reads to size itself."""

    def cluster_resources(self) -> dict[str, float]: ...


class RayBackend:
    """Batches as Ray tasks on a cluster (``--ray ADDRESS|auto``) or a local one (``--ray local``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        self.ray = ray
        address = args.ray
        try:
            if address == "local":
                ray.init(num_cpus=max(1, args.workers), include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        except Exception as exc:
            raise RuntimeError(f"cannot reach Ray at {address!r}: {exc}") from exc
        resources: ReportsResources = ray
        self.capacity = max(1, int(resources.cluster_resources().get("CPU", 1)))
        self.name = f"Ray ({address}, {self.capacity} CPUs)"
        self.remote = ray.remote(num_cpus=1)(run_batch)
        self.refs: dict[ObjectRef, BatchSpec] = {}

    def has_room(self) -> bool:
        return len(self.refs) < self.capacity

    def submit(self, spec: BatchSpec) -> None:
        self.refs[self.remote.remote(spec)] = spec

    def busy(self) -> bool:
        return bool(self.refs)

    def collect(self, timeout: float, notify: Notify) -> list[BatchResult]:
        done, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=timeout)
        results = []
        for ref in done:
            del self.refs[ref]
            try:
                results.append(self.ray.get(ref))
            except Exception as exc:
                raise BackendError(f"a Ray task failed: {exc!r}") from exc
        return results

    def cancel(self) -> None:
        for ref in self.refs:
            self.ray.cancel(ref, force=True)
        self.refs.clear()

    def close(self) -> None:
        self.ray.shutdown()


def make_backend(args: argparse.Namespace) -> InProcessBackend | ProcessBackend | RayBackend:
    """Where the campaign's batches run: Ray tasks (--ray), this process (--workers 0), or worker processes."""
    if args.ray is not None:
        return RayBackend(args)
    if args.workers == 0:
        return InProcessBackend(args)
    return ProcessBackend(args)

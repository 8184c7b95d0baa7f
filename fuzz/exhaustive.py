"""``radixspec exhaustive``: every sequence of cache operations up to a depth, not a sample of them.

    radixspec exhaustive --depth 6 [--page-sizes 1,2] [--machine cache|manager|all] [--workers N] [--out DIR]

A breadth-first, TLC-style exploration over a small alphabet, per page size
P: four token sequences with shared prefixes and partial pages (one of them
in a second namespace, with tokens the first namespace also caches), and the
operations

* ``match s``, ``insert s`` (new pages take the lowest free page starts),
  ``lock s`` (match, then lock the matched path), ``unlock s`` (the latest
  outstanding lock of ``s``; without one, a fresh match's handle: a bad
  unlock), ``evict 1`` (one page), ``evict all``, ``reset``;
* bad inputs: ``insert s`` with a cached slot for its first new page, with a
  misaligned page (P > 1), an eviction past the evictable size, a negative
  one, a namespace outside the domain.

Each operation runs on the spec, the reference and the optimized cache side
by side (the same outcome, or the same error class with nothing changed);
after it: the spec's invariants, each implementation's integrity check,
equal abstract states, equal sizes, and the KV events replaying to the cache.
The manager alphabet (``--machine manager``) drives the manager machine's own
lifecycle rules on the reference and optimized CacheManagers over a pool of
six pages and two request rows: admit one of three prompts (sharing pages,
partial pages) wanting one or two new tokens, forward every live request
(chunks of 1 or 8 tokens, with or without a lazy free region), forward one,
abort one (lazily or not), and the three impossible batches. Each call is
checked against the spec's relation (spec/cache_manager.py), the two
managers against each other, and the accounting invariants after it.

States are deduplicated up to the order-isomorphism of their logical stamps
(LRU compares stamps only) plus the outstanding locks; each new state is
explored once, so the first counterexample is a shortest one. It is printed
and written as a runnable pytest file.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace, copied_fields
from radixspec.spec.helpers import compute_page_to_token
from radixspec.spec.invariants import check_invariants

from .cli import available_cpus
from .differential import apply_all, describe_difference
from .targets.ours import IMPLEMENTATIONS, ReferenceCache, SpecCache
from .targets.ours_optimized import OptimizedCache

Op = tuple[str, ...]
# the implementations the cache alphabet runs side by side
Impl = SpecCache | ReferenceCache | OptimizedCache
# the second namespace (a tuple of the spec's domain)
OTHER: Namespace = ("tenant", 1)
# locks outstanding at once, at most (bounds the state space: a lock's path is all it adds)
MAX_LOCKS = 2


def sequences(page_size: int) -> list[tuple[tuple[int, ...], Namespace]]:
    """The alphabet's token sequences: A and B share two pages, C shares one, D is A's pages in OTHER."""
    p = page_size

    def pages(*values: int) -> tuple[int, ...]:
        return tuple(v for v in values for _ in range(p))

    return [
        (pages(1, 2) + (3,) * (p > 1), None),  # two pages and a partial one (P > 1)
        (pages(1, 2, 4), None),
        ((*pages(1, 5), 6), None),
        (pages(1, 2), OTHER),
    ]


# each operation of the alphabet -> the spec's operation it drives (prefix_cache.OPERATIONS: the alphabet
# drives every one; size_info is compared after every operation)
DRIVES = {
    "match": "match_prefix",
    "bad_namespace": "match_prefix",
    "insert": "insert_prefix",
    "insert_cached_slot": "insert_prefix",
    "insert_misaligned": "insert_prefix",
    "lock": "lock",
    "unlock": "unlock",
    "evict": "evict",
    "reset": "reset",
}


def alphabet(page_size: int) -> list[Op]:
    """Every operation of the alphabet for page size P."""
    ops: list[Op] = []
    for s in map(str, range(len(sequences(page_size)))):
        ops += [("match", s), ("insert", s), ("lock", s), ("unlock", s), ("insert_cached_slot", s)]
        if page_size > 1:
            ops.append(("insert_misaligned", s))
    ops += [("evict", "1"), ("evict", "all"), ("evict", "over"), ("evict", "negative"), ("reset",), ("bad_namespace",)]
    return ops


def pages_up_to_stamp_order(state: pc.PrefixCacheState) -> tuple[tuple[str, tuple[int, ...], int, int, int, int], ...]:
    """The cached pages with their stamps replaced by their ranks: LRU compares stamps only, so two states
    equal up to that order behave the same (the dedup key's cache part)."""
    entries = state.entries
    stamps = sorted({e.last_access for e in entries.values()} | {e.generation for e in entries.values()})
    rank = {stamp: index for index, stamp in enumerate(stamps)}
    return tuple(
        sorted(
            (repr(ns), prefix.tokens, e.slot_start, rank[e.last_access], rank[e.generation], e.ref_count)
            for (ns, prefix), e in entries.items()
        )
    )


@dataclass
class Lock:
    """An outstanding lock: on which sequence, how long its path, each implementation's handle."""

    seq: int
    cached_len: int
    # a handle per implementation, each of its own type (the spec's, the reference tree's, the C tree's)
    handles: list[Any]


def evicted_slots(impl: Impl, size: int) -> list[int]:
    """``impl.evict(size)`` and the slots it gave back, in the order given."""
    impl.evict(size)
    return [slot for unit in impl.take_evicted() for slot in unit]


class World:
    """The spec, the reference and the optimized cache after the same operations, with their locks."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.seqs = tuple(sequences(page_size))
        # the spec's target, first: the oracle apply_all judges the others against
        self.spec_target = SpecCache(page_size)
        self.impls: list[Impl] = [self.spec_target, ReferenceCache(page_size), OptimizedCache(page_size)]
        self.locks: list[Lock] = []
        self.replayers = {impl.name: ev.Replayer(page_size) for impl in self.impls[1:]}

    def __deepcopy__(self, memo: dict[int, object]) -> World:
        """The same state, independent: the implementations, their locks and replayers copied deep (each lock's
        handles name the copies' paths), the sequences shared (nobody changes them)."""
        return copied_fields(self, memo, shared=("seqs",))

    @property
    def spec(self) -> pc.PrefixCacheState:
        return self.spec_target.state

    def key(self) -> tuple[Hashable, ...]:
        """The state up to stamp order: pages (tokens, slot, ranks of stamps, refs) and the locks."""
        return (pages_up_to_stamp_order(self.spec), tuple(sorted(map(repr, map(self.path_of, self.locks)))))

    def enabled(self, op: Op) -> bool:
        """Whether ``op`` belongs to this state's transitions (locks are bounded; bad inputs need material)."""
        name = op[0]
        if name == "lock":
            return len(self.locks) < MAX_LOCKS
        if name == "insert_cached_slot":
            return bool(self.spec.entries) and bool(self.new_pages(int(op[1])))
        if name == "insert_misaligned":
            return bool(self.new_pages(int(op[1])))
        return True

    def path_of(self, lock: Lock) -> tuple[Namespace, tuple[int, ...]]:
        """The locked path: its namespace and tokens."""
        tokens, ns = self.seqs[lock.seq]
        return (ns, tokens[: lock.cached_len])

    def new_pages(self, seq: int) -> list[pc.PageKey]:
        tokens, ns = self.seqs[seq]
        return [key for key in pc.get_page_keys(self.spec, ns, tokens) if key not in self.spec.entries]

    def slots_for(self, seq: int) -> list[int]:
        """A manager's slots for an insert of ``seq``: cached pages' own, then the lowest free page starts."""
        p = self.page_size
        tokens, ns = self.seqs[seq]
        used = {e.slot_start for e in self.spec.entries.values()}
        fresh = (start for start in range(0, 10_000 * p, p) if start not in used)
        starts = []
        for key in pc.get_page_keys(self.spec, ns, tokens):
            entry = self.spec.entries.get(key)
            starts.append(entry.slot_start if entry is not None else next(fresh))
        if len(tokens) % p:
            starts.append(next(fresh))  # the partial page's slots: the request's own, never cached
        return compute_page_to_token(starts, p)[: len(tokens)]

    def apply(self, op: Op, check: bool = True) -> None:
        """Run ``op`` on every implementation; AssertionError when they disagree or (``check``) a check fails."""
        label = " ".join(op)
        name, args = op[0], op[1:]
        if name in ("match", "insert", "lock", "unlock", "insert_cached_slot", "insert_misaligned"):
            seq = int(args[0])
            tokens, ns = self.seqs[seq]
            tokens_list = list(tokens)
        if name == "match":
            apply_all(label, self.impls, lambda impl, i: impl.match_prefix(tokens_list, ns), observe=cached_len)
        elif name.startswith("insert"):
            slots = self.slots_for(seq)
            if name == "insert_cached_slot":
                # the first new page takes the start of a cached page (a slot the cache holds)
                first_new = len(pc.get_page_keys(self.spec, ns, tokens)) - len(self.new_pages(seq))
                taken = min(e.slot_start for e in self.spec.entries.values())
                p = self.page_size
                slots[first_new * p : (first_new + 1) * p] = range(taken, taken + p)
            elif name == "insert_misaligned":
                first_new = len(pc.get_page_keys(self.spec, ns, tokens)) - len(self.new_pages(seq))
                p = self.page_size
                slots[first_new * p : (first_new + 1) * p] = [s + 1 for s in slots[first_new * p : (first_new + 1) * p]]
            apply_all(label, self.impls, lambda impl, i: impl.insert_prefix(tokens_list, list(slots), ns)[0])
        elif name == "lock":
            handles: list[Any] = [None] * len(self.impls)

            def lock_path(impl: Any, i: int) -> int:
                handles[i] = impl.match_prefix(tokens_list, ns)
                impl.lock(handles[i])
                return int(impl.cached_len(handles[i]))

            out = apply_all(label, self.impls, lock_path)
            self.locks.append(Lock(seq, out.results[0], handles))
        elif name == "unlock":
            held = [lock for lock in self.locks if lock.seq == seq]
            if held:
                latest = held[-1]
                outcome = apply_all(label, self.impls, lambda impl, i: impl.unlock(latest.handles[i]))
                if outcome.ok:
                    self.locks.remove(latest)
            else:
                # a handle nobody locked: taken by a match first (which stamps), then unlocked (a bad unlock)
                fresh = apply_all(
                    f"match for {label}",
                    self.impls,
                    lambda impl, i: impl.match_prefix(tokens_list, ns),
                    observe=cached_len,
                )
                outcome = apply_all(
                    label, self.impls, lambda impl, i: impl.unlock(fresh.results[i]), observe=lambda impl, r: None
                )
                if outcome.ok:
                    # the match landed on a locked path (another sequence's lock): that lock is released
                    path = (ns, tokens[: self.impls[0].cached_len(fresh.results[0])])
                    released = next((lock for lock in reversed(self.locks) if self.path_of(lock) == path), None)
                    if released is not None:  # (an empty path is always unlockable, locked or not)
                        self.locks.remove(released)
        elif name == "evict":
            evictable = pc.size_info(self.spec).evictable_size
            size = {"1": min(1, evictable), "all": evictable, "over": evictable + 1, "negative": -1}[args[0]]
            apply_all(label, self.impls, lambda impl, i: evicted_slots(impl, size))
        elif name == "reset":
            reset = apply_all(label, self.impls, lambda impl, i: list(impl.reset()))
            assert not (reset.ok and any(lock.cached_len for lock in self.locks)), "reset succeeded while locked"
        elif name == "bad_namespace":
            apply_all(label, self.impls, lambda impl, i: impl.match_prefix([1], (True,)))
        else:
            raise ValueError(f"unknown operation {op}")
        if check:
            self.check(label)

    def check(self, label: str) -> None:
        """Every invariant, every implementation's integrity, equal states, the events replayed."""
        expected = self.spec
        check_invariants(expected)
        cached = {key: e.slot_start for key, e in expected.entries.items()}
        for impl in self.impls[1:]:
            impl.check_integrity()
            actual = impl.abstract_state()
            assert actual == expected, f"after {label}: {impl.name} differs from the spec:\n" + describe_difference(
                expected, actual
            )
            assert tuple(impl.size_info()) == tuple(pc.size_info(expected)), f"after {label}: size_info of {impl.name}"
            ev.events_match_cache(self.replayers[impl.name].apply(impl.take_events()).cached(), cached)


class ManagerWorld:
    """The manager machine on both CacheManagers, driven by the exhaustive alphabet (its rules called directly)."""

    PAGES = 6

    def __init__(self, page_size: int) -> None:
        from .manager_machine import ManagerMachine

        self.page_size = page_size
        self.machine = ManagerMachine()
        # (the first prompt also seeds the machine's bundle; the rules take prompts as plain values)
        self.machine.setup(page_size, self.PAGES, [([0, 1], [2])])
        self.prompts = tuple(manager_prompts(page_size))

    def __deepcopy__(self, memo: dict[int, object]) -> ManagerWorld:
        """The same state, independent: the machine copied deep (``ManagerBase.__deepcopy__``), the prompts shared."""
        return copied_fields(self, memo, shared=("prompts",))

    def key(self) -> tuple[Hashable, ...]:
        """Pages (up to stamp order), the free list in order, the live requests' rows and progress."""
        state = self.machine.exact_target(0).abstract_state()
        live = tuple(
            (
                tuple(live.tokens),
                live.prompt_len,
                live.cached_len,
                live.generated,
                live.max_new_tokens,
                tuple(self.machine.first.row(live.reqs[0])),
                live.reqs[0].table_idx,
            )
            for live in self.machine.live
        )
        return (pages_up_to_stamp_order(state.cache), tuple(state.free_slots), live)

    def enabled(self, op: Op) -> bool:
        name = op[0]
        if name == "admit":
            return len(self.machine.live) < 2
        if name in ("forward_one", "abort", "bad_batch"):
            return int(op[1]) < len(self.machine.live)
        if name == "forward_all":
            return bool(self.machine.live)
        return True

    def apply(self, op: Op, check: bool = True) -> None:
        """Run ``op`` through the machine's rule; with ``check``, the relations and the invariant too."""
        machine = self.machine
        machine.relations = check
        name, args = op[0], op[1:]
        if name == "admit":
            machine.try_admit(self.prompts[int(args[0])], None, int(args[1]))
        elif name == "forward_all":
            machine.forward_all(int(args[0]), args[1] == "lazy")
        elif name == "forward_one":
            machine.forward_some([int(args[0])], 8, False)
        elif name == "abort":
            machine.abort(int(args[0]), args[1] == "lazy")
        elif name == "bad_batch":
            machine.allocate_bad_batch(int(args[0]), args[1])
        else:
            raise ValueError(f"unknown operation {op}")
        if check:
            machine.targets_agree()


def manager_prompts(page_size: int) -> list[tuple[int, ...]]:
    """Three prompts: two pages and a partial one, the same two pages and another, one shared page and a partial."""
    p = page_size

    def pages(*values: int) -> tuple[int, ...]:
        return tuple(v for v in values for _ in range(p))

    return [(*pages(1, 2), 3), pages(1, 2, 4), (*pages(1), 5)]


def manager_alphabet(page_size: int) -> list[Op]:
    """Every operation of the manager alphabet."""
    ops: list[Op] = [("admit", str(s), str(m)) for s in range(3) for m in (1, 2)]
    ops += [("forward_all", str(chunk), lazy) for chunk in (1, 8) for lazy in ("eager", "lazy")]
    ops += [("forward_one", str(row)) for row in range(2)]
    ops += [("abort", str(row), lazy) for row in range(2) for lazy in ("eager", "lazy")]
    ops += [("bad_batch", "0", how) for how in ("same row twice", "past max_seq_len", "backwards")]
    return ops


def cached_len(impl: Impl, handle: Any) -> int:
    """A handle observed as its cached length."""
    return int(impl.cached_len(handle))


def run_ops(page_size: int, ops: Sequence[Op], check: bool = True, machine: str = "cache") -> World | ManagerWorld:
    """Replay ``ops`` from an empty cache (or manager), every check after each (``check``); the world after.

    The search replays a known state's path unchecked (it was checked when found): outcomes are still
    compared on every call that moves the state (the manager's calls made only to see a refusal are not made
    again); the checks run after the new operation.
    """
    world: World | ManagerWorld = World(page_size) if machine == "cache" else ManagerWorld(page_size)
    for op in ops:
        world.apply(tuple(op), check)
    return world


def alphabet_of(machine: str, page_size: int) -> list[Op]:
    """The alphabet of ``machine`` (cache or manager)."""
    return alphabet(page_size) if machine == "cache" else manager_alphabet(page_size)


# ---------------------------------------------------------------- the search


def expand(
    job: tuple[str, int, tuple[Op, ...]],
) -> tuple[list[tuple[tuple[Hashable, ...], tuple[Op, ...]]], int, str | None, tuple[Op, ...]]:
    """The transitions out of the state ``path`` leads to: (key, path) of each successor, how many, and the
    first failure with its operation sequence (or None).

    The state is replayed once and kept; a transition that moves the world to another state is followed by a
    deep copy of the kept state (the caches copy their trees, the C tree in C: a fraction of a replay)."""
    machine, page_size, path = job
    out: list[tuple[tuple[Hashable, ...], tuple[Op, ...]]] = []
    world = run_ops(page_size, path, check=False, machine=machine)
    key = world.key()
    enabled = [op for op in alphabet_of(machine, page_size) if world.enabled(op)]
    # the state itself, copied whenever a transition moved ``world`` away from it (the last copy is itself)
    kept = copy.deepcopy(world) if len(enabled) > 1 else world
    # operations applied to ``world`` since it was copied, each of which left it in the state ``path`` leads to
    # (equal keys: the states the search itself takes for one); None once it must be copied again
    since: list[Op] | None = []
    for index, op in enumerate(enabled):
        if since is None:
            world, since = (kept if index == len(enabled) - 1 else copy.deepcopy(kept)), []
        try:
            world.apply(op)
        except Exception as exc:  # any escape is a finding: a failed check, a crash
            return out, index + 1, *shortest_failure(machine, page_size, path, since, op, exc)
        after = world.key()
        out.append((after, (*path, op)))
        since = [*since, op] if after == key else None
    return out, len(enabled), None, ()


def shortest_failure(
    machine: str, page_size: int, path: tuple[Op, ...], since: list[Op], op: Op, exc: Exception
) -> tuple[str, tuple[Op, ...]]:
    """The failure of ``op`` and the sequence that shows it: ``path + op`` when that fails alone, replayed from
    an empty cache (a shortest one), else with the operations the world had run since it was copied (they left
    its key unchanged). A failure neither shows is the copy's: a deep copy that differs from its replay."""
    try:
        run_ops(page_size, path, check=False, machine=machine).apply(op)
    except Exception as alone:  # the failure without them: the shortest sequence
        return f"{type(alone).__name__}: {alone}", (*path, op)
    if since:
        return f"{type(exc).__name__}: {exc}", (*path, *since, op)
    return f"a deep copy of the state differs from its replay: on the copy, {type(exc).__name__}: {exc}", (*path, op)


def one_thread() -> None:
    """A worker runs torch on one thread: forked after the parent's thread pool started, more threads stall."""
    import torch

    torch.set_num_threads(1)


@dataclass
class Result:
    """What one exploration found."""

    machine: str
    page_size: int
    depth: int
    states: int
    transitions: int
    seconds: float
    failure: str | None = None
    counterexample: tuple[Op, ...] = ()


def explore(page_size: int, depth: int, workers: int, progress: bool = True, machine: str = "cache") -> Result:
    """Breadth-first over every operation sequence up to ``depth``; states deduplicated; stops at a failure."""
    start = time.perf_counter()
    seen = {run_ops(page_size, (), machine=machine).key()}
    level: list[tuple[Op, ...]] = [()]
    transitions = 0
    reached = 0
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=one_thread) if workers > 1 else None
    try:
        for d in range(1, depth + 1):
            jobs = [(machine, page_size, path) for path in level]
            results = pool.imap(expand, jobs, chunksize=8) if pool else map(expand, jobs)
            next_level: list[tuple[Op, ...]] = []
            for found, count, failure, failing in results:
                transitions += count
                if failure is not None:
                    return Result(
                        machine, page_size, d, len(seen), transitions, time.perf_counter() - start, failure, failing
                    )
                for key, path in found:
                    if key not in seen:
                        seen.add(key)
                        next_level.append(path)
            reached = d
            if progress:
                print(
                    f"  {machine} P={page_size} depth {d}: {len(next_level)} new states, {len(seen)} in all,"
                    f" {transitions} transitions, {time.perf_counter() - start:.1f} s",
                    flush=True,
                )
            level = next_level
            if not level:
                break
    finally:
        if pool:
            pool.terminate()
    return Result(machine, page_size, reached, len(seen), transitions, time.perf_counter() - start)


def write_test(result: Result, out: Path) -> Path:
    """The counterexample as a runnable pytest file."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"test_exhaustive_{result.machine}_P{result.page_size}_depth{len(result.counterexample)}.py"
    ops = ",\n".join(f"        {op!r}" for op in result.counterexample)
    first_line = (result.failure or "").splitlines()[0] if result.failure else ""
    path.write_text(
        f'''"""A shortest counterexample found by radixspec exhaustive (P={result.page_size}).

{first_line}
"""

from radixspec.fuzz.exhaustive import run_ops


def test_exhaustive_counterexample() -> None:
    run_ops(
        {result.page_size},
        [
{ops},
        ],
        machine={result.machine!r},
    )
'''.replace(",\\n", ",\n")
    )
    return path


# the small scope: deeper or wider would run for days (depth 6, P = 1 and 2, takes minutes)
MAX_DEPTH, MAX_PAGE_SIZE = 12, 64


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixspec exhaustive", description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=6, help="longest operation sequence explored (>= 1)")
    parser.add_argument("--page-sizes", default="1,2", help="comma-separated page sizes (default 1,2)")
    parser.add_argument("--machine", choices=("cache", "manager", "all"), default="all", help="which alphabet(s)")
    parser.add_argument(
        "--workers",
        type=int,
        default=available_cpus(),
        help="worker processes (default: the CPUs this process may use)",
    )
    parser.add_argument("--out", type=Path, default=Path("fuzz-failures"), help="where a counterexample's test goes")
    args = parser.parse_args(argv)
    if not 1 <= args.depth <= MAX_DEPTH:
        parser.error(f"--depth must be in [1, {MAX_DEPTH}] (the states grow exponentially), got {args.depth}")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    try:
        sizes = [int(part) for part in args.page_sizes.split(",")]
    except ValueError:
        parser.error(f"--page-sizes: expected comma-separated ints, got {args.page_sizes!r}")
    if not sizes or min(sizes) < 1 or max(sizes) > MAX_PAGE_SIZE:
        parser.error(f"--page-sizes must be in [1, {MAX_PAGE_SIZE}] (a small scope), got {args.page_sizes}")
    if args.workers == 1:
        one_thread()  # this process explores: its tensors are tiny, more threads only contend (as in a worker)
    print(
        f"radixspec exhaustive: depth {args.depth}, page sizes {sizes}, machines {args.machine},"
        f" spec + {', '.join(IMPLEMENTATIONS)}, {args.workers} workers"
    )
    total_states = total_transitions = 0
    start = time.perf_counter()
    machines = ("cache", "manager") if args.machine == "all" else (args.machine,)
    for machine, size in ((machine, size) for machine in machines for size in sizes):
        result = explore(size, args.depth, args.workers, machine=machine)
        total_states += result.states
        total_transitions += result.transitions
        if result.failure is not None:
            path = write_test(result, args.out)
            print(f"COUNTEREXAMPLE ({machine}, P={size}, {len(result.counterexample)} operations): {result.failure}")
            for op in result.counterexample:
                print(f"    {' '.join(op)}")
            print(f"regression test: {path}  (python -m pytest {path})")
            return 1
        print(
            f"{machine} P={size}: {result.states} states, {result.transitions} transitions, depth {result.depth},"
            f" {result.seconds:.1f} s: no counterexample"
        )
    print(
        f"all: {total_states} states, {total_transitions} transitions explored in"
        f" {time.perf_counter() - start:.1f} s; every invariant held"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

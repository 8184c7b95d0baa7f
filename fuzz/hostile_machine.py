"""The hostile-input machine: what a buggy caller passes, against the spec, the reference and the optimized cache.

Every call either does what the spec says or raises a named error of ``spec/errors.py`` with nothing changed;
the process stays alive. The machine draws valid operations (so that the trees grow, split, lock and evict) and,
between them, hostile ones:

* ``evict(out=)`` with a buffer changed after its first use (restrided, resized, dtype-swapped, made 2-D);
* handles of another cache, of a reset cache, or stale ones;
* int subclasses with lying dunders (``__index__``, ``__eq__``, ``__hash__``) as sizes, tokens and slots;
* a list that changes while the cache reads it;
* namespaces one tuple too deep, or very wide;
* sizes, tokens and slots at and past every edge of their domains;
* copies of a cache; two threads on one cache;
* on the hybrid caches: groups outside the cache, handles of another cache, namespaces too deep;
* on the cache managers: requests of another manager, released ones, malformed ones (no prompt, a float
  length, a bool or lying row, a batch that is no list), a lazy free region opened twice;
* on the KV pool: K/V and slot tensors of every wrong dtype, shape, stride, device and range, lying layers;
* ``kv_events.decode`` of random bytes (``EventStreamError``), trace lines of any shape (a request, or a
  ValueError naming the line).

The laws, checked on every call (``attempt``): the outcome is a value or a ``CacheError`` (any other exception
is a failure: a foreign error, a crash the process survived); every implementation agrees with the spec on
which; a refused call leaves every abstract state as it was; after every step each cache passes its own
integrity check and equals the spec state, each manager passes its own (with its live requests) and both
managers hold the same state, and the KV pool holds exactly what the accepted stores wrote.
"""

from __future__ import annotations

from .hostile.base import LyingInt, ShiftingList
from .hostile.engines import EngineCalls

__all__ = ["HostileMachine", "LyingInt", "ShiftingList"]


class HostileMachine(EngineCalls):
    """The spec beside our caches, managers and KV pool, under valid and hostile calls alike. Its parts
    (``fuzz/hostile/``): the state, the law and the checks (``base``), the calls on the caches and readers
    (``caches``), on the managers and the KV pool (``engines``)."""

"""The threading policy of every cache (docs/semantics.md, "Threads"): a cache may be shared between threads;
its calls run one at a time. Each public method named in ``serialized`` takes the instance's lock
(re-entrant: a method may call another), so that two threads never interleave inside a cache; in the optimized
caches this also keeps C's shared scratch buffers to one caller (cffi lets other threads run during a C call).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

C = TypeVar("C", bound=type)

# the calls of a radix prefix cache (reference and optimized) that take its lock; each family adds its own
PREFIX_CACHE_CALLS = (
    "stats",
    "match_prefix",
    "insert_prefix",
    "lock",
    "unlock",
    "is_handle_locked",
    "evict",
    "reset",
    "size_info",
    "check_integrity",
    "abstract_state",
    "abstract_handle",
    "take_events",
    "enable_events",
)


def new_mutex() -> threading.RLock:
    """The lock a cache makes in its ``__init__`` (as ``self._mutex``)."""
    return threading.RLock()


def serialized(*names: str) -> Callable[[C], C]:
    """Class decorator: each method (or property) of ``names`` runs holding ``self._mutex``."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self._mutex:
                return method(self, *args, **kwargs)

        return call

    def decorate(cls: C) -> C:
        for name in names:
            found = getattr(cls, name)
            if isinstance(found, property):
                assert found.fget is not None, f"{cls.__name__}.{name} has no getter"
                setattr(cls, name, property(wrap(found.fget), doc=found.__doc__))
            else:
                setattr(cls, name, wrap(found))
        return cls

    return decorate

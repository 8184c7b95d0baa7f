"""A cache and its pool of pages, used as a serving engine's cache manager uses them for a prompt: what the
trace replays (``radixspec.fuzz.replay``, ``radixspec.fuzz.routing``) drive.

``Driver`` puts a prefix-cache target (``fuzz/targets/api.py``) behind the calls a replay makes; ``Pool`` places
one request: match, lock, take pages (evicting LRU pages when short), insert the whole pages, unlock.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Generic, TypeVar

from radixspec.spec.domains import Namespace
from radixspec.spec.helpers import compute_page_starts, compute_page_to_token

if TYPE_CHECKING:
    from .targets.api import PrefixCacheTarget
    from .targets.ours_optimized import OptimizedCache

# a request of a trace: its prompt and namespace
Request = tuple[list[int], Namespace]
# a target's handle: the driver hands it back to the target that made it
H = TypeVar("H")


class Driver(Generic[H]):
    """A prefix-cache target behind the replay's calls (``fuzz/targets/api.py``: the target turns what its cache
    returns into ints and lists); slots are page starts the replay hands out, unless the target takes its own pages
    (``allocates``)."""

    def __init__(self, name: str, target: PrefixCacheTarget[H], page_size: int) -> None:
        """Raises TargetError, before any request, for a target that takes the caller's slots but cannot evict."""
        from .targets.api import Evicts, TargetError

        self.name = name
        self.target = target
        self.page_size = page_size
        profile = target.profile
        # True: the cache takes its own pages (and evicts for them)
        self.allocates = profile.slots == "target"
        self.namespaces = profile.namespaces
        # the target itself when it evicts on request (every target that takes the caller's slots must)
        self.evicts = target if isinstance(target, Evicts) else None
        if not self.allocates and self.evicts is None:
            raise TargetError(f"target {name} takes the caller's slots but has no evict(): it cannot be replayed")
        # pages the target evicted to take its own
        self.evicted_by_allocation = 0

    def ns(self, namespace: Namespace) -> Namespace:
        """The request's namespace as the target takes it (None for a target without namespaces)."""
        return namespace if self.namespaces else None

    def match(self, tokens: list[int], namespace: Namespace) -> tuple[int, H]:
        """(cached tokens, a handle on the matched path)."""
        handle = self.target.match_prefix(tokens, self.ns(namespace))
        return int(self.target.cached_len(handle)), handle

    def lock(self, handle: H) -> None:
        """Protect the matched path while the request is placed."""
        self.target.lock(handle)

    def unlock(self, handle: H) -> None:
        """Release it."""
        self.target.unlock(handle)

    def slots(self, handle: H) -> list[int]:
        """The matched path's slots."""
        return list(self.target.get_matched_indices(handle))

    def insert(self, tokens: list[int], slots: list[int] | None, namespace: Namespace) -> None:
        """Cache the whole pages (slots: the matched ones then the new pages'; None when the cache allocates)."""
        self.target.insert_prefix(tokens, slots, self.ns(namespace))
        if self.allocates:
            self.evicted_by_allocation += sum(len(group) for group in self.target.take_evicted()) // self.page_size

    def evict(self, tokens: int) -> list[int]:
        """Free at least ``tokens`` tokens of LRU pages; their slots."""
        assert self.evicts is not None, "checked when the driver was made"
        self.evicts.evict(tokens)
        return [slot for group in self.target.take_evicted() for slot in group]

    def cached_page_count(self) -> int:
        """Pages the cache holds now."""
        evictable, protected = self.target.size_info()
        return int(evictable + protected) // self.page_size


def optimized_target(page_size: int) -> OptimizedCache:
    """The optimized target fed the replay's lists as they are (the fuzzer's target converts each input to
    another format in turn: a replay would time the conversions); imports torch and the C tree."""
    from .targets.ours_optimized import OptimizedCache

    class ListsAsGiven(OptimizedCache):
        def convert(self, values: list[int], shift: int = 0) -> list[int]:
            return values

    return ListsAsGiven(page_size)


class Pool(Generic[H]):
    """One cache (``driver``) and its pool of ``pool_pages`` pages, used as a cache manager uses them for a prompt."""

    def __init__(self, driver: Driver[H], pool_pages: int, page_size: int) -> None:
        self.driver, self.pool_pages, self.page_size = driver, pool_pages, page_size
        self.free: deque[int] = deque(range(0, pool_pages * page_size, page_size))
        # pages evicted to make room (the driver's own evictions, for a cache that allocates, counted apart)
        self.evicted = 0

    # nothing drawn: a prefix cache is what it is
    config = ""

    @property
    def name(self) -> str:
        return self.driver.name

    def finish(self) -> None:
        """The replay's end: nothing to check beyond what each call checked."""

    def cached_page_count(self) -> int:
        """Pages the cache holds now."""
        return self.driver.cached_page_count()

    def evicted_pages(self) -> int:
        """Pages evicted so far: to make room, and by the cache to take its own."""
        return self.evicted + self.driver.evicted_by_allocation

    def place(self, tokens: list[int], namespace: Namespace) -> int | None:
        """Match the prompt, lock the matched path, take pages for the rest (evicting LRU pages when the pool is
        short), insert the whole pages, unlock; the partial last page goes back to the pool. The tokens that hit,
        or None for a prompt longer than the whole pool (or empty): not placed."""
        p, driver, free = self.page_size, self.driver, self.free
        needed = -(-len(tokens) // p)
        if needed > self.pool_pages or not tokens:
            return None
        cached, handle = driver.match(tokens, namespace)
        driver.lock(handle)
        if driver.allocates:
            driver.insert(tokens, None, namespace)
        else:
            new = needed - cached // p
            if new > len(free):
                gone = driver.evict((new - len(free)) * p)
                self.evicted += len(gone) // p
                free.extend(compute_page_starts(gone, p))
            pages = [free.popleft() for _ in range(new)]
            slots = driver.slots(handle) + compute_page_to_token(pages, p)[: len(tokens) - cached]
            driver.insert(tokens, slots, namespace)
            if len(tokens) % p:
                free.append(pages[-1])  # the partial last page is not cached
        driver.unlock(handle)
        return cached

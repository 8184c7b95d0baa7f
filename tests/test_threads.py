"""The threading policy (docs/semantics.md, "Threads"): a cache may be shared between threads; its calls run one
at a time. Two threads hammering one cache end with the cache intact and only errors the callers' own races
explain (a path evicted between match and lock, pages locked between size_info and evict)."""

import inspect
import subprocess
import sys
import textwrap

import pytest

from radixspec import optimized, reference
from radixspec.optimized._hotpath import Core
from radixspec.optimized.hybrid_cache import HybridRadixCache as OptimizedHybrid
from radixspec.reference.hybrid_cache import HybridRadixCache as ReferenceHybrid

PROBE = textwrap.dedent(
    """
    import random, sys, threading, time
    from radixspec import optimized, reference
    from radixspec.spec.errors import CacheError, EvictionError, StaleHandleError
    family = sys.argv[1]
    # optimized-hot: no events, so that match_prefix and insert_prefix run in C (csrc/hotpath.c) without the lock
    cache = (optimized.RadixPrefixCache(page_size=2, device="cpu", enable_events=family == "optimized")
             if family.startswith("optimized") else reference.RadixPrefixCache(page_size=2, enable_events=True))
    stop = time.time() + float(sys.argv[2])
    unexpected = []
    def work(seed):
        rng, base, n = random.Random(seed), seed * 10**8, 0
        while time.time() < stop:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
            try:
                cache.insert_prefix(tokens, list(range(base + n, base + n + len(tokens))))
                n += len(tokens) + len(tokens) % 2
                handle = cache.match_prefix(tokens)
                cache.lock(handle)
                handle.get_matched_indices()
                cache.unlock(handle)
                if rng.random() < 0.3:
                    cache.evict(min(4, cache.size_info.evictable_size))
                if rng.random() < 0.05:
                    cache.take_events()
            except EvictionError:
                pass  # the other thread locked pages between size_info and evict: a race of the caller's
            except StaleHandleError:
                pass  # the other thread evicted the matched path between match_prefix and lock: the caller's race too
            except CacheError as error:
                unexpected.append(repr(error))
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cache.check_integrity()
    assert not unexpected, unexpected[:3]
    print("intact")
    """
)

# the optimized cache's operations on the hot path and the Python methods they hand calls to
HOT_PATH = {"match_prefix": "_match_prefix", "insert_prefix": "_insert_prefix", "evict": "_evict"}


@pytest.mark.parametrize("family", ["reference", "optimized", "optimized-hot"])
def test_two_threads_on_one_cache_leave_it_intact(family: str) -> None:
    """Before the lock the optimized cache died (double free, unaligned tcache chunk) within 3 s."""
    run = subprocess.run([sys.executable, "-c", PROBE, family, "1.5"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "intact" in run.stdout, (run.returncode, run.stderr[-2000:])


@pytest.mark.parametrize(
    "cache_class",
    [reference.RadixPrefixCache, optimized.RadixPrefixCache, ReferenceHybrid, OptimizedHybrid],
    ids=["reference", "optimized", "reference-hybrid", "optimized-hybrid"],
)
def test_every_public_method_of_a_cache_holds_its_lock(cache_class: type) -> None:
    for name, member in inspect.getmembers(cache_class):
        if name.startswith("__"):
            continue
        function = member.fget if isinstance(member, property) else member
        if name in HOT_PATH and member is getattr(Core, name):
            # the hot path (csrc/hotpath.c) runs without Python code once it has seen the lock free; what it does not
            # take goes to the Python method, which holds the lock
            function = getattr(cache_class, HOT_PATH[name])
        if name.startswith("_") or not callable(function):
            continue
        assert hasattr(function, "__wrapped__"), f"{cache_class.__module__}.{name} runs without the cache's lock"

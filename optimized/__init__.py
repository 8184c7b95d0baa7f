"""radixspec's fast implementation, optimized for speed rather than clarity.

Same names, semantics and errors as ``reference`` (each class names its
twin); token ids are CPU tensors (or lists), slots are int32 tensors on the
chosen device, key compare is C through cffi (``fast_compare_key``). The
physical side lives here too: ``MHAKVCache`` (the paged KV pool) and
``store_cache`` / ``store_cache_fast`` (C on the CPU, a CUDA kernel on GPUs).
"""

from .cache_manager import CacheManager, make_page_table
from .engine import Engine, EngineResult
from .kv_pool import MHAKVCache
from .model import HashModel
from .naive_cache import NaiveCacheHandle, NaivePrefixCache
from .radix_cache import RadixCacheHandle, RadixPrefixCache, RadixTreeNode
from .radix_kernel import fast_compare_key
from .scheduler import Scheduler
from .store import store_cache, store_cache_fast

__all__ = [
    "CacheManager",
    "Engine",
    "EngineResult",
    "HashModel",
    "MHAKVCache",
    "NaiveCacheHandle",
    "NaivePrefixCache",
    "RadixCacheHandle",
    "RadixPrefixCache",
    "RadixTreeNode",
    "Scheduler",
    "fast_compare_key",
    "make_page_table",
    "store_cache",
    "store_cache_fast",
]

"""The seed's system in clear pure Python: radix tree, naive cache, CacheManager, scheduler, HashModel.

Plain lists and ints; read it side by side with the seed chapter and ``spec/``.
"""

from .base import BaseCacheHandle, BasePrefixCache
from .cache_manager import CacheManager, make_page_table
from .engine import Engine, EngineResult
from .model import HashModel
from .naive_cache import NaiveCacheHandle, NaivePrefixCache
from .radix_cache import RadixCacheHandle, RadixPrefixCache, RadixTreeNode
from .scheduler import Scheduler

__all__ = [
    "BaseCacheHandle",
    "BasePrefixCache",
    "CacheManager",
    "Engine",
    "EngineResult",
    "HashModel",
    "NaiveCacheHandle",
    "NaivePrefixCache",
    "RadixCacheHandle",
    "RadixPrefixCache",
    "RadixTreeNode",
    "Scheduler",
    "make_page_table",
]

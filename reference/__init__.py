"""The seed's system in clear pure Python: radix tree, naive cache, CacheManager.

Plain lists and ints; read it side by side with the seed chapter and ``spec/``.
"""

from .base import BaseCacheHandle, BasePrefixCache
from .cache_manager import CacheManager, make_page_table
from .naive_cache import NaiveCacheHandle, NaivePrefixCache
from .radix_cache import RadixCacheHandle, RadixPrefixCache, RadixTreeNode

__all__ = [
    "BaseCacheHandle",
    "BasePrefixCache",
    "CacheManager",
    "NaiveCacheHandle",
    "NaivePrefixCache",
    "RadixCacheHandle",
    "RadixPrefixCache",
    "RadixTreeNode",
    "make_page_table",
]

"""The three layers use the same names (the seed's vocabulary), so a reader maps each one 1:1."""

import inspect

from radixspec import optimized, reference
from radixspec.spec import cache_manager as spec_manager
from radixspec.spec import prefix_cache as spec_cache

CACHE_OPERATIONS = ["match_prefix", "insert_prefix", "lock", "unlock", "evict", "reset", "size_info"]
MANAGER_OPERATIONS = [
    "match_req",
    "lock",
    "unlock",
    "available_size",
    "allocate_paged",
    "cache_req",
    "lazy_free_region",
]


def public_names(module: object) -> set[str]:
    return {name for name in getattr(module, "__all__", []) if not name.startswith("_")}


def test_reference_and_optimized_export_the_same_public_names() -> None:
    # the abstract bases exist once, in reference; the kernels and the KV pool only in optimized
    bases = {"BaseCacheHandle", "BasePrefixCache"}
    physical = {"fast_compare_key", "MHAKVCache", "store_cache", "store_cache_fast"}
    assert public_names(reference) - bases == public_names(optimized) - physical


def test_every_spec_operation_has_a_method_of_the_same_name_in_both_implementations() -> None:
    for name in CACHE_OPERATIONS:
        assert callable(getattr(spec_cache, name)), name
        for cls in (
            reference.RadixPrefixCache,
            optimized.RadixPrefixCache,
            reference.NaivePrefixCache,
            optimized.NaivePrefixCache,
        ):
            assert hasattr(cls, name), (cls, name)
    for name in MANAGER_OPERATIONS:
        assert callable(getattr(spec_manager, name)), name
        for cls in (reference.CacheManager, optimized.CacheManager):
            assert hasattr(cls, name), (cls, name)


def test_each_optimized_class_names_its_reference_twin() -> None:
    for name in public_names(optimized) - {"fast_compare_key", "make_page_table", "store_cache", "store_cache_fast"}:
        doc = inspect.getdoc(getattr(optimized, name)) or ""
        assert "Twin of" in doc, name

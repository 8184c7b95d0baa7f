"""radixspec's executable specification: the prefix cache and page accounting as abstract models.

stdlib only. ``radixspec.spec.prefix_cache`` holds the cache as a dict of pages
keyed by token prefix; ``radixspec.spec.cache_manager`` the page accounting around
it; ``radixspec.spec.invariants`` the named invariants; ``radixspec.spec.tiers`` a cache whose pages
have copies in device memory, host memory and storage, moved by transfers; ``radixspec.spec.errors`` the error
tree every implementation raises.
"""

from . import cache_manager, errors, helpers, invariants, prefix_cache, types

__all__ = ["cache_manager", "errors", "helpers", "invariants", "prefix_cache", "types"]

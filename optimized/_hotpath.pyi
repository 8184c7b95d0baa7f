# The types of radixspec.optimized._hotpath (csrc/hotpath.c), for mypy.
from typing import Any

def read_int64(values: list[int] | tuple[int, ...], address: int, capacity: int) -> int: ...
def setup(
    match: int,
    insert: int,
    evict: int,
    drop_root: int,
    tensor_type: type,
    int32: Any,
    int64: Any,
    new_slots: Any,
    handle_type: type,
    insert_result_type: type,
) -> None: ...

class Mutex:
    held: int
    def __init__(self, lock: Any) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, *exc: object) -> bool: ...

class Handle:
    cached_len: int
    node: int
    version: int
    namespace: Any
    cache: Any
    def __init__(self, cached_len: int, node: int, version: int, namespace: Any, cache: Any) -> None: ...

class Counts:
    match_requests: int
    hit_requests: int
    match_tokens: int
    hit_tokens: int
    pages_stored: int
    pages_evicted: int
    pages_dropped: int

class Core:
    clock: int
    roots: dict[Any, int]
    _namespace_of: dict[int, Any]
    _evict_clock_sum: int
    events: Any
    _counts: dict[Any, Any]
    _mutex: Mutex
    def _bind_tree(self, owner: Any, address: int, page_size: int, on_host: bool) -> None: ...

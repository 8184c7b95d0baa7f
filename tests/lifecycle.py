"""Small drivers of the request lifecycle over a reference CacheManager (the scheduler's part, by hand)."""

from __future__ import annotations

from collections.abc import Sequence

from radixspec.reference import CacheManager, make_page_table
from radixspec.spec.domains import Namespace
from radixspec.spec.requests import Req


def new_manager(
    num_pages: int, page_size: int, rows: int = 4, max_seq_len: int = 64, type: str = "radix"
) -> CacheManager:
    return CacheManager(num_pages, page_size, make_page_table(rows, max_seq_len), type=type)


def admit(manager: CacheManager, prompt: Sequence[int], table_idx: int, namespace: Namespace = None) -> Req:
    """match_req, lock, copy the matched slots into the request's row."""
    req = Req(input_ids=list(prompt), table_idx=table_idx, cache_handle=None, namespace=namespace, uid=table_idx)
    handle = manager.match_req(req)
    manager.lock(handle)
    matched = handle.get_matched_indices()
    manager.page_table[table_idx][: len(matched)] = matched
    req.cache_handle = handle
    req.cached_len = req.device_len = req.alloc_len = handle.cached_len
    return req


def prefill(manager: CacheManager, req: Req) -> None:
    """Allocate pages for the rest of the prompt and mark its KV computed."""
    req.device_len = len(req.input_ids)
    manager.allocate_paged([req])
    req.cached_len = req.device_len


def decode(manager: CacheManager, req: Req, token: int) -> None:
    """Append a sampled token, allocate its page, mark its KV computed."""
    req.input_ids.append(token)
    req.device_len = req.cached_len + 1
    manager.allocate_paged([req])
    req.cached_len = req.device_len

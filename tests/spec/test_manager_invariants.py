"""Every accounting invariant of the manager (radixspec.spec.cache_manager.MANAGER_INVARIANTS) fails, by its name, on a
reference manager's state that breaks it and nothing else; the healthy state passes (no check is a no-op)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from radixspec.spec import cache_manager as sm
from radixspec.spec.errors import IntegrityError
from radixspec.spec.requests import Req

from .managers import manager_with_a_cached_prefix


def healthy() -> tuple[Any, Req]:
    """P=2, 8 pages: [1 1 2 2] cached, a live request matched on it with a private page (positions 4..5)."""
    adapter, req = manager_with_a_cached_prefix(num_pages=8)
    adapter.set_lengths(req, 4, 6)
    adapter.allocate_paged([req])
    return adapter.manager, req


def swap_private_slots(manager: Any, req: Req) -> list[Req]:
    row = manager.page_table[req.table_idx]
    row[4], row[5] = row[5], row[4]
    return [req]


def leak_a_free_page(manager: Any, req: Req) -> list[Req]:
    manager.free_slots.pop()
    return [req]


def free_a_page_twice(manager: Any, req: Req) -> list[Req]:
    manager.free_slots.append(manager.free_slots[0])
    return [req]


def point_a_cached_position_elsewhere(manager: Any, req: Req) -> list[Req]:
    manager.page_table[req.table_idx][0] += 100
    return [req]


BREAKS: dict[str, Callable[[Any, Req], list[Req]]] = {
    "live_requests_hold_distinct_rows": lambda manager, req: [req, req],
    "free_slots_are_aligned_and_unique": free_a_page_twice,
    "private_rows_are_page_runs": swap_private_slots,
    "pages_are_partitioned": leak_a_free_page,
    "rows_match_handles": point_a_cached_position_elsewhere,
}


def test_every_manager_invariant_has_a_breaking_example() -> None:
    assert list(BREAKS) == [name for name, _ in sm.MANAGER_INVARIANTS]


def test_the_healthy_state_passes() -> None:
    manager, req = healthy()
    assert manager.page_table[req.table_idx][:6] != [0] * 6
    manager.check_integrity([req])


@pytest.mark.parametrize("name", list(BREAKS))
def test_a_broken_invariant_is_named(name: str) -> None:
    manager, req = healthy()
    live = BREAKS[name](manager, req)
    with pytest.raises(IntegrityError) as raised:
        manager.check_integrity(live)
    assert str(raised.value).startswith(f"{name}: "), str(raised.value)

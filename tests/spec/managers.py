"""Reference-manager states the manager spec's tests start from, and how they observe one."""

from __future__ import annotations

from radixspec.fuzz.targets.ours import ReferenceManager
from radixspec.spec import cache_manager as sm
from radixspec.spec.requests import Req

PROMPT = [1, 1, 2, 2, 3, 3, 4]


def admitted(manager: ReferenceManager, prompt: list[int], row: int, uid: int) -> Req:
    """A request matched, locked and given its row, as the PrefillAdder does."""
    req = manager.new_req(prompt, row, None, uid)
    handle = manager.match_req(req)
    manager.lock(handle)
    manager.admit(req, handle)
    return req


def observe(manager: ReferenceManager, req: Req) -> tuple[sm.ManagerState, sm.RequestView]:
    """The manager's state and the request's view in it."""
    state = manager.abstract_state()
    return state, manager.view(state, req)


def manager_with_a_cached_prefix(num_pages: int = 5) -> tuple[ReferenceManager, Req]:
    """P=2; [1 1 2 2] cached (2 pages), the rest free; a request on PROMPT admitted with 4 tokens matched."""
    manager = ReferenceManager(num_pages=num_pages, page_size=2, rows=3, max_seq_len=8)
    first = admitted(manager, [1, 1, 2, 2, 9], 0, 0)
    manager.set_lengths(first, 0, 5)
    manager.allocate_paged([first])
    manager.set_lengths(first, 5, 5)
    manager.cache_req(first, True)
    return manager, admitted(manager, PROMPT, 1, 1)

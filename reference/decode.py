"""The decode queue (the seed's ``scheduler/decode.py``), in admission order: an ordered dict, never a set."""

from __future__ import annotations

from collections.abc import Iterable

from radixspec.spec.helpers import compute_pages_to_finish
from radixspec.spec.requests import Batch, Req


class DecodeManager:
    """Requests whose prefill is done and which have tokens left to generate."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        # uid -> request, in the order they entered decode
        self.running_reqs: dict[int, Req] = {}

    def filter_reqs(self, reqs: Iterable[Req]) -> None:
        """After a forward: keep the running requests that can still decode, then add the batch's new ones."""
        merged = {uid: req for uid, req in self.running_reqs.items() if req.can_decode}
        for req in reqs:
            if req.can_decode and req.uid not in merged:
                merged[req.uid] = req
        self.running_reqs = merged

    def remove_req(self, req: Req) -> None:
        """Drop a finished request (no-op if already gone)."""
        self.running_reqs.pop(req.uid, None)

    def abort_req(self, uid: int) -> Req | None:
        """Drop request ``uid``; returns it if it was running."""
        return self.running_reqs.pop(uid, None)

    @property
    def inflight_tokens(self) -> int:
        """Tokens of pages the running requests will still allocate: what new admissions must leave free."""
        p = self.page_size
        return sum(
            p * compute_pages_to_finish(req.max_device_len, req.alloc_len, p) for req in self.running_reqs.values()
        )

    def schedule_next_batch(self) -> Batch | None:
        """Every running request, in admission order."""
        if not self.runnable:
            return None
        return Batch(reqs=list(self.running_reqs.values()), phase="decode")

    @property
    def runnable(self) -> bool:
        return bool(self.running_reqs)

"""The router's view: what a cache-aware router's index must believe about its workers, and the laws it obeys.

A router (NVIDIA Dynamo's KV router, llm-d, SGLang's router) keeps one index of
every worker's cache, fed by the workers' KV events (``radixspec.spec.events``),
and scores each prompt per worker: how many leading pages of the prompt that
worker holds. The abstract index is the workers' replayed event streams, one
``Replayer`` per worker; the laws compare any router's index with the workers'
own pages (their truth), after every step:

* ``router_scores_match_workers``: for every prompt and every worker, the
  router's score is exactly the pages that worker would match (asked without
  changing its state), never more (a request sent for a hit that is not
  there), never less (a hit the router cannot see);
* ``router_holds_live_blocks``: the index holds exactly the workers' live
  pages: nothing removed stays, nothing live is missing;
* ``router_namespaces_apart``: no two live pages of different namespaces
  share one router entry (a namespace folded into another scores one
  tenant's prompts with another tenant's pages).

Pages are named by ``PageKey`` (namespace, token prefix); a router that names
them otherwise (Dynamo: a chain of per-block content hashes) maps its names
back through the translation it was fed with. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from .domains import Namespace
from .errors import InvalidSizeError, RouterLawError
from .events import Event, Replayer
from .prefix_cache import PageKey, Prefix


def longest_cached_pages(
    pages: Mapping[PageKey, object], tokens: Sequence[int], namespace: Namespace, page_size: int
) -> int:
    """How many leading whole pages of ``tokens`` (in ``namespace``) ``pages`` holds: what a match would hit."""
    prefix: Prefix | None = None
    count = 0
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prefix = Prefix.extend(prefix, tuple(tokens[start : start + page_size]))
        if (namespace, prefix) not in pages:
            break
        count += 1
    return count


class RouterIndex:
    """The abstract router: each worker's event stream replayed from empty (``Replayer``), scored by pages.

    ``check_hashes``: our events' hashes are checked against parent and tokens; an engine's (another hash
    function) are not. A stream that cannot be replayed raises EventStreamError, index unchanged for that
    event's worker up to the bad event.
    """

    def __init__(self, page_size: int, check_hashes: bool = True) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidSizeError.not_positive("page_size", page_size)
        self.page_size = page_size
        self.check_hashes = check_hashes
        self.workers: dict[int, Replayer] = {}

    def apply(self, worker: int, events: Iterable[Event]) -> None:
        """Apply one worker's events in order."""
        replayer = self.workers.get(worker)
        if replayer is None:
            replayer = self.workers[worker] = Replayer(self.page_size, check_hashes=self.check_hashes)
        replayer.apply(events)

    def remove_worker(self, worker: int) -> None:
        """Forget a worker (it left, or restarts empty)."""
        self.workers.pop(worker, None)

    def live(self) -> dict[int, set[PageKey]]:
        """Per worker, the pages its stream says it holds (workers holding none left out)."""
        return {worker: set(replayer.cached()) for worker, replayer in self.workers.items() if replayer.pages}

    def scores(self, tokens: Sequence[int], namespace: Namespace) -> dict[int, int]:
        """Per worker, the leading pages of the prompt it holds (workers scoring 0 left out, as Dynamo's)."""
        found = {}
        for worker, replayer in self.workers.items():
            count = longest_cached_pages(replayer.cached(), tokens, namespace, self.page_size)
            if count:
                found[worker] = count
        return found


# ---------------------------------------------------------------------------------------------- the laws


def router_scores_match_workers(
    scores: Mapping[int, int], truth: Mapping[int, int], tokens: Sequence[int], namespace: Namespace
) -> None:
    """The router's scores of one prompt (``{worker: pages}``, zero scores absent) are the workers' matches."""
    nonzero = {worker: pages for worker, pages in truth.items() if pages}
    if dict(scores) == nonzero:
        return
    wrong = sorted(set(scores) | set(nonzero))
    detail = "; ".join(
        f"worker {worker}: router {scores.get(worker, 0)}, worker {nonzero.get(worker, 0)}"
        for worker in wrong
        if scores.get(worker, 0) != nonzero.get(worker, 0)
    )
    raise RouterLawError(
        f"router_scores_match_workers: a prompt of {len(tokens)} tokens in {namespace!r}, in pages: {detail}"
    )


def router_holds_live_blocks(
    index: Mapping[int, AbstractSet[Hashable]], truth: Mapping[int, AbstractSet[Hashable]]
) -> None:
    """The router's index holds exactly each worker's live pages (both named the same way)."""
    problems = []
    for worker in sorted(set(index) | set(truth)):
        held, live = set(index.get(worker, ())), set(truth.get(worker, ()))
        stale, missing = held - live, live - held
        if stale or missing:
            problems.append(f"worker {worker}: {len(stale)} removed pages still indexed, {len(missing)} live missing")
    if problems:
        raise RouterLawError("router_holds_live_blocks: " + "; ".join(problems))


def router_namespaces_apart(truth: Mapping[int, Iterable[PageKey]], name_of: Callable[[PageKey], Hashable]) -> None:
    """No router entry (``name_of(page)``: what the router keys a page by) stands for live pages of two
    namespaces."""
    owner: dict[Hashable, PageKey] = {}
    for pages in truth.values():
        for key in pages:
            name = name_of(key)
            other = owner.setdefault(name, key)
            if other[0] != key[0]:
                raise RouterLawError(
                    f"router_namespaces_apart: {key[1].length} tokens in {key[0]!r} and in {other[0]!r}"
                    " share one router entry"
                )


__all__ = [
    "RouterIndex",
    "RouterLawError",
    "longest_cached_pages",
    "router_holds_live_blocks",
    "router_namespaces_apart",
    "router_scores_match_workers",
]

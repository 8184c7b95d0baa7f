"""The scheduler's laws: what any scheduler of this design must do, stated on what it shows, not on its code.

Both schedulers (``reference.Scheduler`` and ``optimized.Scheduler``) share
one core, so comparing them checks the core against itself. These laws are
the independent oracle: written from the design (DESIGN.md, "Scheduler"),
they use none of the scheduler's helpers (their own page arithmetic and stop
rule), and the fuzzer checks them on every step of every scheduler.

* **admission law** (``check_step``): a step schedules a prefill batch when
  the head of the waiting queue can run, else a decode batch of every running
  request in admission order. The prefill batch is exactly what first come,
  first served gives under the token budget, the free rows and the pages:
  a continuing chunk always runs while budget is left; a new request runs
  when a row is free and the pages it will still need, plus the pages
  reserved for every running or admitted request, fit in what is available
  once its matched prefix is locked; the first request that does not fit
  stops the batch (nobody overtakes it). Each runs ``min(budget left, prompt
  tokens left)`` tokens. The batch is demanded exactly, so the law is one of
  liveness as well as safety: a scheduler that admits less than it may (a
  reservation one token too large, a recheck too strict) breaks it as surely
  as one that admits too much.
* **generation law** (``expected_output``): a finished request's output is
  the model's sequence: each token the HashModel's next token of the
  sequence so far, up to ``max_tokens`` or the first EOS (unless
  ``ignore_eos``); an aborted request's output is a prefix of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import prefix_cache as pc
from .domains import Namespace
from .errors import SchedulingLawError
from .hashing import compute_next_token, compute_prefix_hashes
from .requests import SchedulerConfig, StepReport


@dataclass(frozen=True)
class WaitingView:
    """A request in the waiting queue, as the scheduler shows it."""

    uid: int
    prompt: tuple[int, ...]
    max_tokens: int
    namespace: Namespace
    # a request whose prefill was cut into chunks: it holds a row and pages already
    chunked: bool = False
    # for a chunked request: prompt tokens computed, and positions backed by pages
    cached_len: int = 0
    alloc_len: int = 0


@dataclass(frozen=True)
class RunningView:
    """A request in decode: its final length and the positions backed by pages."""

    uid: int
    max_device_len: int
    alloc_len: int


@dataclass(frozen=True)
class SchedulerView:
    """What the laws read of a scheduler before a step."""

    waiting: tuple[WaitingView, ...]
    running: tuple[RunningView, ...]
    # tokens the cache manager can still hand out (free pages and evictable cached ones)
    available: int
    free_rows: int
    # the cache's abstract state (what a match finds, what a lock protects)
    cache: pc.PrefixCacheState
    # "radix" (matches share pages) or "naive" (never)
    cache_type: str


def pages_still_needed(final_len: int, alloc_len: int, page_size: int) -> int:
    """Pages a request will still allocate: positions [0, final_len - 1) get K/V, the last token never does."""
    positions = final_len - 1
    pages_total = (positions + page_size - 1) // page_size
    return max(0, pages_total - alloc_len // page_size)


def matched_pages(view: SchedulerView, request: WaitingView) -> list[pc.PageKey]:
    """Cached pages a new request's match finds: the whole pages of its prompt but the last token."""
    if view.cache_type != "radix":
        return []
    found = []
    for key in pc.get_page_keys(view.cache, request.namespace, request.prompt[: len(request.prompt) - 1]):
        if key not in view.cache.entries:
            break
        found.append(key)
    return found


def admitted_batch(config: SchedulerConfig, view: SchedulerView) -> list[tuple[int, int]]:
    """(uid, tokens) of the prefill batch the admission law gives, in queue order; empty when none."""
    p = config.page_size
    budget = config.max_extend_tokens
    rows = view.free_rows
    available = view.available
    reserved = sum(p * pages_still_needed(r.max_device_len, r.alloc_len, p) for r in view.running)
    locked = {key for key, entry in view.cache.entries.items() if entry.ref_count > 0}
    batch: list[tuple[int, int]] = []
    for request in view.waiting:
        if budget <= 0:
            break
        final_len = len(request.prompt) + request.max_tokens
        if request.chunked:
            start, alloc_len = request.cached_len, request.alloc_len
        else:
            if rows == 0:
                break
            matched = matched_pages(view, request)
            start = alloc_len = len(matched) * p
            newly_locked = [key for key in matched if key not in locked]
            need = p * pages_still_needed(final_len, alloc_len, p)
            if need + reserved > available - len(newly_locked) * p:
                break
            available -= len(newly_locked) * p
            locked.update(newly_locked)
            rows -= 1
        tokens = min(budget, len(request.prompt) - start)
        batch.append((request.uid, tokens))
        budget -= tokens
        reserved += p * pages_still_needed(final_len, alloc_len, p)
    return batch


def check_step(config: SchedulerConfig, before: SchedulerView, report: StepReport) -> None:
    """The admission law: the batch a step scheduled is the one the law gives for the state before it."""
    expected = admitted_batch(config, before)
    if expected:
        if report.phase != "prefill" or report.scheduled != expected:
            raise SchedulingLawError(
                f"admission law: the waiting queue {[w.uid for w in before.waiting]} (available {before.available},"
                f" free rows {before.free_rows}) admits prefill {expected}; the scheduler ran"
                f" {report.phase} {report.scheduled}"
            )
        return
    decode = [(r.uid, 1) for r in before.running]
    if decode:
        if report.phase != "decode" or report.scheduled != decode:
            raise SchedulingLawError(
                f"admission law: nothing waiting can run, so every running request decodes in admission order"
                f" {decode}; the scheduler ran {report.phase} {report.scheduled}"
            )
    elif report.phase is not None:
        raise SchedulingLawError(f"admission law: nothing can run, yet the scheduler ran {report.phase}")


def expected_output(
    prompt: Sequence[int],
    namespace: Namespace,
    max_tokens: int,
    ignore_eos: bool,
    eos_token_id: int,
    vocab_size: int,
    eos_per_mille: int,
) -> list[int]:
    """The generation law: the HashModel's tokens for this request, up to max_tokens or EOS."""
    sequence = list(prompt)
    output: list[int] = []
    while len(output) < max_tokens:
        token = compute_next_token(
            compute_prefix_hashes(namespace, sequence)[-1], vocab_size, eos_token_id, eos_per_mille
        )
        output.append(token)
        sequence.append(token)
        if token == eos_token_id and not ignore_eos:
            break
    return output


def check_output(expected: list[int], output: list[int], finished: bool, uid: int) -> None:
    """A finished request produced exactly its sequence; an aborted one a prefix of it."""
    if finished and output != expected:
        raise SchedulingLawError(f"generation law: request {uid} finished with {output}, its sequence is {expected}")
    if not finished and output != expected[: len(output)]:
        raise SchedulingLawError(f"generation law: request {uid} produced {output}, not a prefix of {expected}")

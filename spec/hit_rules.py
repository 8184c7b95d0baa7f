"""Which match lengths a hybrid cache may return: the rule every engine's hit is checked against.

A hybrid cache keeps one *group* per kind of layer (``spec/hybrid.py``). A
match of length ``L`` *uses* some cached entries in each group; ``L`` is
*valid* when every group caches every entry it uses, and the hit is the
longest valid ``L``. An entry is named by where it ends along the prompt
(the length of the prefix it is keyed by), so the rule reads any cache: the
spec's dict, a tree, vLLM's block hashes. Four things vary between engines;
each is a field of ``HitRule``::

    group kind   None      full attention: the pages holding a token in [0, L)
                 W >= 1    sliding window: the pages holding a token in [L - (W - 1), L)
                 STATE     a state group (Mamba, linear attention): one checkpoint of the
                           recurrent state after exactly the first L tokens
    unit h       a divisor of P (vLLM's prefix_match_unit): lengths are multiples of h;
                 a length inside a page uses the page's *partial* entry ending exactly there
    lookahead m  the entry ending at e is keyed by tokens[:e + m] (EAGLE: SGLang's bigram
                 keys, m = 1; vLLM's lookahead hashes), so n known tokens match at most n - m
    drop d       the hit's last d units are found, then recomputed (vLLM's EAGLE without
                 lookahead hashes: a KV connector, or disable_lookahead_block_hashes)

A page of a full or window group owns one full entry, or, while it is not full, the
partial entries of the lengths it was cached at. When the page fills, its full entry
replaces them (*promotion*, ``page_entries_are_current``); when it is evicted, every
entry it owns goes with it. A hit that ends inside a page does not share that page:
the request copies the page's first tokens into a page of its own. A state group's
checkpoints are sparse: a length with no checkpoint is not valid there, however many
pages the other groups cache; a match copies the checkpoint into the request's own
state slot, which the request then advances.

The named choices against vLLM and SGLang are in ``docs/hybrid.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from .errors import InvalidInputError, InvalidTypeError
from .helpers import align_down, div_ceil

# a state group: caches checkpoints of a recurrent state (Mamba, linear attention), one slot each
STATE: Final = "state"

# the kind of a group: None for full attention, W >= 1 tokens for a sliding window, STATE for checkpoints
Window = int | Literal["state"] | None

# (group, end) -> True when the group caches the entry of the prompt's first ``end`` tokens
IsCached = Callable[[int, int], bool]


@dataclass(frozen=True)
class HitRule:
    """How a hybrid cache turns what it caches into a hit (the fields are the named choices above)."""

    # tokens per page (P)
    page_size: int
    # one kind per group
    kinds: tuple[Window, ...]
    # hash unit h, a divisor of P: hits are multiples of h (P: whole pages only)
    unit: int
    # EAGLE: tokens past an entry that its key covers (0: none)
    lookahead: int = 0
    # EAGLE with a KV connector: units of a hit dropped and recomputed (0: none)
    drop: int = 0


def check_kinds(kinds: object, *, state_groups: bool = True) -> tuple[Window, ...]:
    """``kinds`` as a non-empty tuple of group kinds, or raise (``state_groups``: whether STATE is admitted)."""
    if not isinstance(kinds, (tuple, list)) or not kinds:
        raise InvalidTypeError(f"windows must be a non-empty tuple of None or ints >= 1, got {kinds!r}")
    for i, kind in enumerate(kinds):
        if kind is None:
            continue
        if isinstance(kind, str) and kind == STATE:
            if not state_groups:
                raise InvalidInputError(f"windows[{i}]: this cache has no state groups (Mamba), only windows")
            continue
        if not isinstance(kind, int) or isinstance(kind, bool):
            raise InvalidTypeError(f"windows[{i}] must be None, an int or STATE, got {type(kind).__name__}")
        if kind < 1:
            raise InvalidInputError(f"windows[{i}] = {kind}: a sliding window holds at least one token")
    return tuple(kinds)


def new_hit_rule(
    page_size: int, kinds: Sequence[Window], unit: int | None = None, lookahead: int = 0, drop: int = 0
) -> HitRule:
    """A checked HitRule (``unit`` None: the page)."""
    unit = page_size if unit is None else unit
    for name, value, least in (("page_size", page_size, 1), ("unit", unit, 1), ("lookahead", lookahead, 0)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < least:
            raise InvalidInputError(f"{name} = {value}, at least {least}")
    if not isinstance(drop, int) or isinstance(drop, bool) or drop < 0:
        raise InvalidInputError(f"drop = {drop!r}: a number of units >= 0")
    if page_size % unit:
        raise InvalidInputError(f"the hash unit {unit} does not divide the page size {page_size}")
    return HitRule(page_size, check_kinds(kinds), unit, lookahead, drop)


# ---------------------------------------------------------------- what a length uses


def compute_used_pages(length: int, window: Window, page_size: int) -> range:
    """Page numbers a match of ``length`` tokens uses in a group of kind ``window``.

    Full attention: every page before ``length``. Window W: the pages holding
    a token in ``[length - (W - 1), length)``, i.e. what the query at
    position ``length`` attends to besides itself. The same range is what a
    request with ``length`` tokens of KV must still hold: every page before
    its start may be released (vLLM's ``remove_skipped_blocks``). State: the
    page holding the checkpoint, the last one (a state group keeps one entry
    per page at most, at the page's end or, inside the page, at ``length``).
    """
    end = div_ceil(length, page_size)
    if window == STATE:
        return range(max(0, end - 1), end)
    first = 0 if window is None else max(0, length - (window - 1)) // page_size
    return range(first, end)


def compute_used_ends(length: int, window: Window, page_size: int) -> list[int]:
    """The ends of the entries a match of ``length`` tokens uses in a group: whole pages, then a partial tail."""
    return [min((page + 1) * page_size, length) for page in compute_used_pages(length, window, page_size)]


def is_valid_length(rule: HitRule, length: int, is_cached: IsCached) -> bool:
    """True when every group caches every entry a match of ``length`` uses (L = 0 always)."""
    return all(
        is_cached(group, end)
        for group, kind in enumerate(rule.kinds)
        for end in compute_used_ends(length, kind, rule.page_size)
    )


def compute_longest_valid(rule: HitRule, longest: int, is_cached: IsCached) -> int:
    """The longest valid length that is a multiple of the unit and at most ``longest``."""
    for length in range(align_down(max(0, longest), rule.unit), 0, -rule.unit):
        if is_valid_length(rule, length, is_cached):
            return length
    return 0


# ---------------------------------------------------------------- the hit


def is_valid_with_drop(rule: HitRule, length: int, is_cached: IsCached) -> bool:
    """True when ``length`` is valid and, with a drop, every full and window group also caches what a match
    ``drop`` units longer uses (the units dropped are recomputed, but must have been found: vLLM pops them
    off a longer hit). A state group resumes from its checkpoint at ``length``: no drop there."""
    if not is_valid_length(rule, length, is_cached):
        return False
    longer = length + rule.drop * rule.unit
    return not rule.drop or all(
        is_cached(group, end)
        for group, kind in enumerate(rule.kinds)
        if kind != STATE
        for end in compute_used_ends(longer, kind, rule.page_size)
    )


def compute_hit(rule: HitRule, is_cached: IsCached, known: int, limit: int, margin: int = 0) -> int:
    """The hit of a prompt on a cache that holds what ``is_cached`` says.

    ``known``: tokens the keys may read (the entry ending at e is keyed by tokens[:e + lookahead],
    so no entry past ``known - lookahead`` can be looked up); ``limit``: the longest hit the
    scheduler allows (all tokens but the last: one is always recomputed). With a drop, the
    units dropped may reach ``margin`` tokens past the limit (vLLM's hybrid coordinator looks
    one unit further, its single-group manager does not).
    """
    dropped = rule.drop * rule.unit
    longest = min(limit, known - rule.lookahead - dropped, limit + margin - dropped)
    for length in range(align_down(max(0, longest), rule.unit), 0, -rule.unit):
        if is_valid_with_drop(rule, length, is_cached):
            return length
    return 0


def compute_cacheable_len(rule: HitRule, computed: int, known: int, holds: IsCached) -> int:
    """What a request, running or finished, may insert: the longest valid length of what it holds.

    ``computed``: tokens whose KV (and state) the request stored; ``known``: its tokens so
    far; ``holds(group, end)``: the request holds that entry (a window page not released
    early; for a state group, a checkpoint it saved after exactly ``end`` tokens, SGLang's
    snapshot at a chunk's end, vLLM's state at a block boundary). Whole pages only: a
    partial entry is cached where the engine chooses (``page_entries_are_current``). A
    running request with no checkpoint inserts nothing.
    """
    whole_pages = HitRule(rule.page_size, rule.kinds, rule.page_size, rule.lookahead)
    return compute_longest_valid(whole_pages, min(computed, known - rule.lookahead), holds)


# ---------------------------------------------------------------- what a page owns


def page_entries_are_current(page_size: int, pages: Sequence[tuple[int, int, Sequence[int]]]) -> str | None:
    """Every page owns only entries of what it holds now: once full, only its full entry (promotion removed
    the partial ones: vLLM #49125 is a partial entry left behind); before, only partial entries of tokens
    written into it.

    ``pages``: per page, (its first token along its prefix, the tokens written into it, the ends of the
    entries it is cached under).
    """
    for first, written, ends in pages:
        if written == page_size:
            allowed: set[int] = {first + page_size}
        else:
            allowed = set(range(first + 1, first + written + 1))
        stale = sorted(set(ends) - allowed)
        if stale:
            return (
                f"the page of tokens [{first}, {first + page_size}) holds {written} of them"
                f" but is cached under entries ending at {stale}"
            )
    return None

"""Pure helpers of page arithmetic, with PEP316 contracts checked by CrossHair.

``tox -e crosshair`` runs ``crosshair check spec/helpers.py``: each ``post:``
line below is searched for a counterexample. Comparisons in contracts are
element-wise (``all(a[i] == b[i] ...)``), not slice against slice, because
CrossHair 0.0.113 misjudges ``a[:k] == b[:k]`` on symbolic lists.
"""

from __future__ import annotations

from collections.abc import Sequence


def align_down(n: int, page_size: int) -> int:
    """Largest multiple of ``page_size`` not above ``n``.

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ % page_size == 0
    post: 0 <= __return__ <= n
    post: n - __return__ < page_size
    """
    return n - n % page_size


def div_ceil(n: int, page_size: int) -> int:
    """Number of pages needed to hold ``n`` tokens.

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ * page_size >= n
    post: (__return__ - 1) * page_size < n or __return__ == 0
    """
    return -(-n // page_size)


def align_up(n: int, page_size: int) -> int:
    """Smallest multiple of ``page_size`` not below ``n``.

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ % page_size == 0
    post: n <= __return__ < n + page_size
    """
    return div_ceil(n, page_size) * page_size


def compute_match_len(key: Sequence[int], input_ids: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of ``key`` and ``input_ids[start:]`` (what ``fast_compare_key`` returns).

    pre: 0 <= start <= len(input_ids)
    post: 0 <= __return__ <= min(len(key), len(input_ids) - start)
    post: all(key[i] == input_ids[start + i] for i in range(__return__))
    post: __return__ == min(len(key), len(input_ids) - start) or key[__return__] != input_ids[start + __return__]
    """
    n = min(len(key), len(input_ids) - start)
    # a whole match, the common case on a long shared prefix, at C speed
    if list(key[:n]) == list(input_ids[start : start + n]):
        return n
    i = 0
    while i < n and key[i] == input_ids[start + i]:
        i += 1
    return i


def compute_page_to_token(pages: Sequence[int], page_size: int) -> list[int]:
    """Expand page starts to every slot of each page: ``[X] -> [X, X+1, ..., X+P-1]``.

    pre: page_size >= 1
    post: len(__return__) == len(pages) * page_size
    post: all(__return__[i] == pages[i // page_size] + i % page_size for i in range(len(__return__)))
    """
    return [start + offset for start in pages for offset in range(page_size)]


def compute_page_starts(slots: Sequence[int], page_size: int) -> list[int]:
    """Every ``page_size``-th slot, i.e. ``slots[::P]`` (the seed's ``indices[::page_size]``).

    pre: page_size >= 1
    post: len(__return__) == (len(slots) + page_size - 1) // page_size
    post: all(__return__[i] == slots[i * page_size] for i in range(len(__return__)))
    """
    return list(slots[::page_size])


def is_page_run(slots: Sequence[int], page_size: int) -> bool:
    """True when ``slots`` is one whole page: ``start .. start+P-1``, ``start >= 0``, ``start % P == 0``.

    pre: page_size >= 1
    post: __return__ == (len(slots) == page_size and slots[0] >= 0 and slots[0] % page_size == 0 and all(slots[i] == slots[0] + i for i in range(page_size)))
    """
    return (
        # exactly one page long
        len(slots) == page_size
        # starts on a page boundary of the pool
        and slots[0] >= 0
        and slots[0] % page_size == 0
        # and is consecutive (compared as one list: C speed for big pages)
        and list(slots) == list(range(slots[0], slots[0] + page_size))
    )


def compute_pages_to_finish(max_device_len: int, alloc_len: int, page_size: int) -> int:
    """Pages a request still needs: positions [0, max_device_len - 1) get KV (the last token never does).

    pre: page_size >= 1
    pre: max_device_len >= 1
    pre: alloc_len >= 0 and alloc_len % page_size == 0
    post: __return__ >= 0
    post: alloc_len + __return__ * page_size >= max_device_len - 1
    post: __return__ == 0 or alloc_len + (__return__ - 1) * page_size < max_device_len - 1
    """
    return max(0, div_ceil(max_device_len - 1, page_size) - alloc_len // page_size)

"""The input domains every implementation accepts, exactly: page sizes, namespaces, token ids, slots.

A value outside its domain is rejected with the spec's error (``InvalidTypeError`` for a wrong type,
``InvalidInputError`` / ``SlotOutOfRangeError`` for a value out of range) before anything changes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from typing import Any, Self, TypeAlias, TypeVar

from .errors import (
    InvalidInputError,
    InvalidSizeError,
    InvalidTypeError,
    LengthMismatchError,
    NamespaceDepthError,
    SlotOutOfRangeError,
)

# A namespace isolates cache lines (LoRA id, tenant salt). ``None`` is the
# default namespace; any other namespace is a tuple, never a joined string
# (its domain: ``check_namespace``).
Namespace: TypeAlias = "tuple[Hashable, ...] | None"


class Immutable:
    """A value nobody changes once made (a page's prefix, an event, a handle): a copy of it, deep or shallow, is
    the value itself (a deep copy of a cache, as the exhaustive checker takes one per state, shares them)."""

    __slots__ = ()

    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Self:
        return self


T = TypeVar("T")


def copied_fields(
    original: T,
    memo: dict[int, object],
    shared: Container[str] = (),
    made: Mapping[str, Callable[[Any], object]] | None = None,
) -> T:
    """A deep copy of ``original``, field by field (what a class's ``__deepcopy__`` returns): the copy goes into
    ``memo`` first, so that what points back to the original points to the copy; a field named in ``shared`` is
    shared, one named in ``made`` is made by its function from the original's, every other is copied deep."""
    clone = object.__new__(type(original))
    memo[id(original)] = clone
    made = made or {}
    fields = vars(clone)
    for name, value in vars(original).items():
        fields[name] = value if name in shared else made[name](value) if name in made else copy.deepcopy(value, memo)
    return clone


def check_page_size(page_size: object) -> int:
    """``page_size`` as an int, 1 <= page_size <= SLOT_LIMIT (a page's slots lie in the slot domain), or raise."""
    if not isinstance(page_size, int) or isinstance(page_size, bool):
        raise InvalidTypeError(f"page_size must be an int, got {type(page_size).__name__}")
    page_size = int(page_size)
    if page_size < 1:
        raise InvalidInputError(f"page_size must be >= 1, got {page_size}")
    if page_size > SLOT_LIMIT:
        raise InvalidInputError(f"page_size must be <= 2**31 (a page's slots lie in the slot domain), got {page_size}")
    return page_size


def check_pool_size(num_pages: object, page_size: int) -> int:
    """``num_pages`` as an int >= 1 whose pages' slots all lie in the slot domain (num_pages * page_size <= 2**31),
    or raise (InvalidTypeError, InvalidSizeError)."""
    if not isinstance(num_pages, int) or isinstance(num_pages, bool):
        raise InvalidTypeError(f"num_pages must be an int, got {type(num_pages).__name__}")
    num_pages = int(num_pages)
    if num_pages < 1:
        raise InvalidSizeError(f"num_pages must be >= 1, got {num_pages}")
    if num_pages * page_size > SLOT_LIMIT:
        raise InvalidSizeError(
            f"num_pages * page_size must be <= 2**31 (every slot of the pool in the slot domain),"
            f" got {num_pages} * {page_size} = {num_pages * page_size}"
        )
    return num_pages


# Slots index the KV pool through int32 page tables, as every engine's kernels do.
SLOT_LIMIT = 2**31
# Token ids are kept as int64.
TOKEN_LIMIT = 2**63
# What a namespace tuple may hold, besides nested tuples: exactly these types (not bool, not a
# subclass such as IntEnum, not float), so that two namespaces are equal only when they are the same value.
NAMESPACE_ITEM_TYPES = (str, bytes, int)


# How deep tuples may nest in a namespace: far beyond any real key (a LoRA id, a tenant salt), far below what
# CPython's recursive tuple hash and repr survive (a namespace is hashed and printed)
NAMESPACE_DEPTH_LIMIT = 32


def check_namespace(namespace: object) -> Namespace:
    """``namespace`` if it lies in the namespace domain, else raise InvalidTypeError (a wrong type) or
    NamespaceDepthError (nested too deep).

    The domain: ``None``, or a tuple whose items are ``str``, ``bytes`` or ``int``
    (exactly those types) or tuples of the same, nested up to NAMESPACE_DEPTH_LIMIT
    tuples deep. Python calls ``("lora", 1)``, ``("lora", True)`` and ``("lora", 1.0)``
    equal; only the first is in the domain, so two cache lines never alias by a
    coincidence of ``==``. The check is linear in the namespace's size.
    """
    if namespace is None:
        return None
    if type(namespace) is not tuple:
        raise InvalidTypeError(f"namespace must be None or a tuple (e.g. ('lora', 7)), got {type(namespace).__name__}")
    # an explicit stack (never the interpreter's recursion); each entry: a value, its depth, and its path as a
    # linked list of indices (spelled out only for an error: building it at every level would be quadratic)
    stack: list[tuple[object, int, tuple[object, int] | None]] = [(namespace, 1, None)]
    while stack:
        value, depth, path = stack.pop()
        if type(value) is tuple:
            if depth > NAMESPACE_DEPTH_LIMIT:
                raise NamespaceDepthError(
                    f"{spell_path(path)} nests tuples {depth} deep: namespaces nest at most {NAMESPACE_DEPTH_LIMIT}"
                )
            stack.extend((item, depth + 1, (path, i)) for i, item in enumerate(value))
        elif type(value) not in NAMESPACE_ITEM_TYPES:
            raise InvalidTypeError(
                f"{spell_path(path)} is a {type(value).__name__}: namespace items must be str, bytes, int"
                " (not bool, float or a subclass) or tuples of those"
            )
    return namespace


def spell_path(path: tuple[object, int] | None) -> str:
    """``namespace[i][j]...`` from the linked list of indices (innermost last)."""
    indices: list[int] = []
    while path is not None:
        path, index = path  # type: ignore[assignment]
        indices.append(index)
    return "namespace" + "".join(f"[{i}]" for i in reversed(indices))


def check_token_ids(values: object, what: str = "input_ids") -> tuple[int, ...]:
    """``values`` as a tuple of token ids, each ``0 <= token < TOKEN_LIMIT``, or raise (names ``what``)."""
    return _check_ints(values, what, TOKEN_LIMIT, InvalidInputError)


def check_slot_indices(values: object, what: str = "indices") -> tuple[int, ...]:
    """``values`` as a tuple of slots, each ``0 <= slot < SLOT_LIMIT``, or raise SlotOutOfRangeError."""
    return _check_ints(values, what, SLOT_LIMIT, SlotOutOfRangeError)


def check_insert_inputs(
    input_ids: object, indices: object, namespace: object
) -> tuple[tuple[int, ...], tuple[int, ...], Namespace]:
    """The guards every ``insert_prefix`` starts with: the token ids, the slots and the namespace in their
    domains (checked in that order), and one slot per token (else ``LengthMismatchError``)."""
    tokens = check_token_ids(input_ids)
    slots = check_slot_indices(indices)
    checked_namespace = check_namespace(namespace)
    if len(tokens) != len(slots):
        raise LengthMismatchError.tokens_and_slots(len(tokens), len(slots))
    return tokens, slots, checked_namespace


def _check_ints(values: object, what: str, limit: int, out_of_range: type[InvalidInputError]) -> tuple[int, ...]:
    """``values`` as a tuple of ints in ``[0, limit)``; InvalidTypeError for a non-int, ``out_of_range`` else."""
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise InvalidTypeError(f"{what} must be a sequence of ints, got {type(values).__name__}")
    out = tuple(values)
    # the common case at C speed: every value an int (not a bool) inside the range
    if not out or (set(map(type, out)) == {int} and min(out) >= 0 and max(out) < limit):
        return out
    for i, v in enumerate(out):
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidTypeError(f"{what}[{i}] must be an int, got {type(v).__name__}")
        if not 0 <= v < limit:
            raise out_of_range(f"{what}[{i}] = {v} is outside [0, 2**{limit.bit_length() - 1})")
    # an int subclass as the int it holds: one whose __eq__ / __hash__ / __index__ lie would otherwise alias
    # other slots or tokens in the spec's sets and dicts (found by the hostile machine)
    return tuple(int.__int__(v) for v in out)

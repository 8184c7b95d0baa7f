"""Types shared by every implementation: results, namespaces, requests, input checks."""

from __future__ import annotations

from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeAlias

from .errors import InvalidInputError, InvalidRequestError, InvalidSizeError, InvalidTypeError, SlotOutOfRangeError
from .helpers import compute_pages_to_finish

# A namespace isolates cache lines (LoRA id, tenant salt). ``None`` is the
# default namespace; any other namespace is a tuple, never a joined string
# (its domain: ``check_namespace``).
Namespace: TypeAlias = "tuple[Hashable, ...] | None"


class SizeInfo(NamedTuple):
    """Sizes of the cache in tokens (always multiples of the page size)."""

    # tokens on pages nobody has locked: what evict() may take
    evictable_size: int
    # tokens on locked pages
    protected_size: int

    @property
    def total_size(self) -> int:
        """All cached tokens."""
        return self.evictable_size + self.protected_size


class InsertResult(NamedTuple):
    """What insert_prefix returns."""

    # tokens of the input that were already cached before the call (page aligned);
    # the caller frees its own duplicates indices[old_handle.cached_len : cached_len]
    cached_len: int
    # handle on the whole inserted path (cached_len == align_down(len(input_ids), P))
    handle: Any


class Prompted(Protocol):
    """Anything match_req can match: a Req or a PendingReq."""

    input_ids: list[int]
    namespace: Namespace


@dataclass
class SamplingParams:
    """How a request ends (the seed's ``SamplingParams``, greedy only)."""

    # new tokens to generate at most (clipped by the scheduler to what fits in a row)
    max_tokens: int = 16
    # keep generating past EOS
    ignore_eos: bool = False


@dataclass(eq=False)
class Req:
    """A request as the CacheManager and the scheduler see it (the seed's ``Req``, host side).

    Positions of its page-table row::

        [0, cache_handle.cached_len)          cached pages, locked through cache_handle
        [cache_handle.cached_len, alloc_len)  pages private to this request
        [0, cached_len)                       KV computed and stored
        [cached_len, device_len)              KV computed by the current forward
    """

    # prompt followed by the tokens generated so far
    input_ids: list[int]
    # row of the page table that maps this request's positions to slots
    table_idx: int
    # handle returned by match_req / cache_req, locked while the request lives;
    # None once the request was released by cache_req(finished=True)
    cache_handle: Any
    # cache line namespace
    namespace: Namespace = None
    # tokens whose KV is in the pool
    cached_len: int = 0
    # tokens whose KV is in the pool after the forward being prepared
    device_len: int = 0
    # positions of the row backed by pages (a multiple of the page size)
    alloc_len: int = 0
    # the request's id
    uid: int = field(default=0)
    # prompt length plus new tokens: the request is done when device_len reaches it
    max_device_len: int = 0
    sampling_params: SamplingParams = field(default_factory=SamplingParams)

    @property
    def remain_len(self) -> int:
        """Tokens still to put through a forward."""
        return self.max_device_len - self.device_len

    @property
    def extend_len(self) -> int:
        """Tokens the current forward computes."""
        return self.device_len - self.cached_len

    @property
    def can_decode(self) -> bool:
        """True while the request has tokens left to generate."""
        return self.remain_len > 0

    def complete_one(self) -> None:
        """After a forward: its tokens' KV is stored; room for the next token."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_host(self, next_token: int) -> None:
        """Record the sampled token on the host."""
        self.input_ids.append(next_token)


class ChunkedReq(Req):
    """A prefill chunk that is not the last: never sampled, never decoded."""

    @property
    def can_decode(self) -> bool:
        return False

    def append_host(self, next_token: int) -> None:
        raise AssertionError("a ChunkedReq is never sampled")


@dataclass(eq=False)
class PendingReq:
    """A request waiting for (the rest of) its prefill."""

    uid: int
    # the prompt
    input_ids: list[int]
    sampling_params: SamplingParams
    namespace: Namespace = None
    # the request's last chunk, when its prefill is split across batches
    chunked_req: ChunkedReq | None = None

    @property
    def input_len(self) -> int:
        """Prompt length."""
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        """New tokens to generate."""
        return self.sampling_params.max_tokens


@dataclass(eq=False)
class Batch:
    """One forward: its requests in order, and what the scheduler prepared for the model."""

    reqs: list[Req]
    phase: str  # "prefill" or "decode"
    # token ids of the positions computed, request after request
    input_ids: Any = None
    # positions [cached_len, device_len) of each request, concatenated
    positions: Any = None
    # slot of each computed position (where the model stores its K/V)
    out_loc: Any = None

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"


@dataclass
class RequestSpec:
    """One request of a workload (what ``Engine.generate`` takes)."""

    uid: int
    input_ids: list[int]
    max_tokens: int = 16
    ignore_eos: bool = False
    namespace: Namespace = None


@dataclass
class SchedulerConfig:
    """Sizes and policies of one scheduler."""

    page_size: int = 1
    num_pages: int = 256
    max_running_reqs: int = 16
    max_seq_len: int = 512
    # prompt tokens one prefill batch may compute
    max_extend_tokens: int = 256
    # "radix" (prefix sharing) or "naive" (none)
    cache_type: str = "radix"
    # process batch k's results after scheduling batch k+1
    overlap: bool = False
    eos_token_id: int = 0

    def check(self) -> None:
        """Raise unless every size is a positive int."""
        for name in ("page_size", "num_pages", "max_running_reqs", "max_seq_len", "max_extend_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidSizeError(f"{name} must be an int >= 1, got {value!r}")


@dataclass
class StepReport:
    """What one step did, in the same words for every implementation."""

    # "prefill", "decode", or None when nothing was scheduled
    phase: str | None
    # (uid, tokens computed) of the scheduled batch, in batch order
    scheduled: list[tuple[int, int]] = field(default_factory=list)
    # (uid, token, finished) of the results processed this step
    processed: list[tuple[int, int, bool]] = field(default_factory=list)
    # uids whose resources were released this step
    released: list[int] = field(default_factory=list)


@dataclass
class SchedulerStats:
    """Counters over a scheduler's life."""

    steps: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    admitted: int = 0
    prompt_tokens: int = 0
    # prompt tokens found in the cache at admission
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    aborted: int = 0
    peak_pages_in_use: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def check_request(
    config: SchedulerConfig,
    known: Container[int],
    uid: object,
    input_ids: object,
    max_tokens: object,
    namespace: object = None,
) -> tuple[list[int], int]:
    """A new request's prompt and max_tokens clipped to the room left in a row; raise if it cannot run.

    Rejected: a non-int or known uid, an empty prompt, a prompt that fills
    max_seq_len, max_tokens < 1, a request needing more pages than the pool has,
    a namespace outside the domain.
    """
    if not isinstance(uid, int) or isinstance(uid, bool):
        raise InvalidTypeError(f"uid must be an int, got {type(uid).__name__}")
    if uid in known:
        raise InvalidRequestError(f"request {uid} already exists")
    tokens = list(check_token_ids(input_ids))
    check_namespace(namespace)
    if not tokens:
        raise InvalidRequestError(f"request {uid} has an empty prompt")
    if len(tokens) >= config.max_seq_len:
        raise InvalidRequestError(
            f"request {uid}: prompt of {len(tokens)} tokens leaves no room in max_seq_len {config.max_seq_len}"
        )
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidSizeError(f"request {uid}: max_tokens must be >= 1, got {max_tokens!r}")
    clipped = min(max_tokens, config.max_seq_len - len(tokens))
    pages = compute_pages_to_finish(len(tokens) + clipped, 0, config.page_size)
    if pages > config.num_pages:
        raise InvalidRequestError(
            f"request {uid} needs {pages} pages, the pool has {config.num_pages}: it could never run"
        )
    return tokens, clipped


def is_finished(sampled: int, params: SamplingParams, token: int, eos_token_id: int) -> bool:
    """True when the ``sampled``-th token ``token`` ends its request (max_tokens reached, or EOS)."""
    return sampled >= params.max_tokens or (not params.ignore_eos and token == eos_token_id)


def check_page_size(page_size: object) -> int:
    """``page_size`` as an int >= 1, or raise."""
    if not isinstance(page_size, int) or isinstance(page_size, bool):
        raise InvalidTypeError(f"page_size must be an int, got {type(page_size).__name__}")
    if page_size < 1:
        raise InvalidInputError(f"page_size must be >= 1, got {page_size}")
    return page_size


# Slots index the KV pool through int32 page tables, as every engine's kernels do.
SLOT_LIMIT = 2**31
# Token ids are kept as int64.
TOKEN_LIMIT = 2**63
# What a namespace tuple may hold, besides nested tuples: exactly these types (not bool, not a
# subclass such as IntEnum, not float), so that two namespaces are equal only when they are the same value.
NAMESPACE_ITEM_TYPES = (str, bytes, int)


def check_namespace(namespace: object) -> Namespace:
    """``namespace`` if it lies in the namespace domain, else raise InvalidTypeError.

    The domain: ``None``, or a tuple whose items are ``str``, ``bytes`` or ``int``
    (exactly those types) or tuples of the same, nested to any depth. Python calls
    ``("lora", 1)``, ``("lora", True)`` and ``("lora", 1.0)`` equal; only the first is
    in the domain, so two cache lines never alias by a coincidence of ``==``.
    """
    if namespace is None:
        return None
    if type(namespace) is not tuple:
        raise InvalidTypeError(f"namespace must be None or a tuple (e.g. ('lora', 7)), got {type(namespace).__name__}")
    # an explicit stack: nesting depth is the caller's choice, not the interpreter's recursion limit
    stack: list[tuple[str, object]] = [("namespace", namespace)]
    while stack:
        where, value = stack.pop()
        if type(value) is tuple:
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif type(value) not in NAMESPACE_ITEM_TYPES:
            raise InvalidTypeError(
                f"{where} is a {type(value).__name__}: namespace items must be str, bytes, int"
                " (not bool, float or a subclass) or tuples of those"
            )
    return namespace


def check_token_ids(values: object, what: str = "input_ids") -> tuple[int, ...]:
    """``values`` as a tuple of token ids, each ``0 <= token < TOKEN_LIMIT``, or raise (names ``what``)."""
    return _check_ints(values, what, TOKEN_LIMIT, InvalidInputError)


def check_slot_indices(values: object, what: str = "indices") -> tuple[int, ...]:
    """``values`` as a tuple of slots, each ``0 <= slot < SLOT_LIMIT``, or raise SlotOutOfRangeError."""
    return _check_ints(values, what, SLOT_LIMIT, SlotOutOfRangeError)


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
    return out

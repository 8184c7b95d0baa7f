"""Requests as the cache manager and the scheduler see them, the scheduler's configuration and its reports,
and the checks a new request passes (the seed's ``Req``, ``SamplingParams``, ``Batch``)."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, Protocol

from .domains import Namespace, check_namespace, check_token_ids, copied_fields
from .errors import InvalidRequestError, InvalidSizeError, InvalidTypeError
from .helpers import compute_pages_to_finish


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

    def __deepcopy__(self, memo: dict[int, object]) -> Req:
        """The same request, independent (field by field: a dataclass's own deep copy goes through pickling)."""
        return copied_fields(self, memo)

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
                raise InvalidSizeError.not_positive(name, value)


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

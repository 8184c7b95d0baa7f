"""A caller's buffer, handle or input that changed, was forged, or came from elsewhere: a named error from
spec/errors.py, nothing changed, the process alive."""

from collections.abc import Callable

import pytest
import torch

from radixspec.optimized import RadixPrefixCache
from radixspec.spec.errors import InvalidTypeError

MUTATIONS: dict[str, Callable[[torch.Tensor], object]] = {
    # a zero stride over a million slots: C would write 999,999 int32 from a 64-byte allocation
    "restrided to a huge zero-stride view": lambda out: out.as_strided_((10**6,), (0,)),
    # the same object, now int8 underneath: C would write four times past the buffer
    "dtype swapped under the same object": lambda out: setattr(out, "data", out.view(torch.int8)),
    # every other slot: the C writes would land between the elements the caller reads
    "restrided to every other slot": lambda out: out.as_strided_((8,), (2,)),
    "shrunk to nothing": lambda out: out.resize_(0),
    "made 2-D": lambda out: out.resize_(4, 4),
}


@pytest.mark.parametrize("mutate", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_an_out_buffer_changed_after_its_first_use_is_checked_again(mutate: Callable[[torch.Tensor], object]) -> None:
    cache = RadixPrefixCache(page_size=1, device="cpu")
    cache.insert_prefix(list(range(12)), torch.arange(12, dtype=torch.int32))
    out = torch.empty(16, dtype=torch.int32)
    assert cache.evict(1, out=out)[:1].tolist() == [11]
    before = cache.abstract_state()
    mutate(out)
    with pytest.raises(InvalidTypeError, match="out must be a 1-D contiguous int32 CPU tensor"):
        cache.evict(1, out=out)
    assert cache.abstract_state() == before
    cache.check_integrity()
    # a buffer that is right again is taken again
    fresh = torch.full((16,), -1, dtype=torch.int32)
    assert cache.evict(2, out=fresh)[:2].tolist() == [9, 10]

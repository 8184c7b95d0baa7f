"""A new request and a scheduler config are checked before anything changes; each refusal says why."""

from __future__ import annotations

import dataclasses

import pytest

from radixspec.spec.errors import CacheError, InvalidInputError, InvalidRequestError, InvalidSizeError, InvalidTypeError
from radixspec.spec.requests import SchedulerConfig, check_request

CONFIG = SchedulerConfig(page_size=2, num_pages=4, max_running_reqs=2, max_seq_len=12, max_extend_tokens=8)


def test_check_request_clips_max_tokens_to_the_row() -> None:
    assert check_request(CONFIG, {1}, 2, [5, 6, 7], 3) == ([5, 6, 7], 3)
    roomy = dataclasses.replace(CONFIG, num_pages=8)
    assert check_request(roomy, {1}, 2, (5, 6, 7), 30) == ([5, 6, 7], 9)  # 3 + 9 = max_seq_len


@pytest.mark.parametrize(
    ("uid", "prompt", "max_tokens", "config", "error", "message"),
    [
        ("2", [5], 1, CONFIG, InvalidTypeError, "uid must be an int, got str"),
        (True, [5], 1, CONFIG, InvalidTypeError, "uid must be an int, got bool"),
        (1, [5], 1, CONFIG, InvalidRequestError, "request 1 already exists"),
        (2, [], 1, CONFIG, InvalidRequestError, "request 2 has an empty prompt"),
        (
            2,
            [5] * 12,
            1,
            CONFIG,
            InvalidRequestError,
            "request 2: prompt of 12 tokens leaves no room in max_seq_len 12",
        ),
        (2, [5], 0, CONFIG, InvalidSizeError, "request 2: max_tokens must be >= 1, got 0"),
        (2, [5], True, CONFIG, InvalidSizeError, "request 2: max_tokens must be >= 1, got True"),
        (2, [5], 2.0, CONFIG, InvalidSizeError, "request 2: max_tokens must be >= 1, got 2.0"),
        (
            2,
            [5] * 9,
            2,
            CONFIG,
            InvalidRequestError,
            "request 2 needs 5 pages, the pool has 4: it could never run",
        ),
    ],
)
def test_check_request_names_what_is_wrong(
    uid: object, prompt: list[int], max_tokens: object, config: SchedulerConfig, error: type, message: str
) -> None:
    with pytest.raises(error) as raised:
        check_request(config, {1}, uid, prompt, max_tokens)
    assert str(raised.value) == message


def test_a_request_that_fits_the_pool_exactly_is_accepted() -> None:
    # 8 tokens + 1: positions [0, 8) need K/V, 4 pages of 2
    assert check_request(CONFIG, set(), 2, [5] * 8, 1) == ([5] * 8, 1)


@pytest.mark.parametrize("name", ["page_size", "num_pages", "max_running_reqs", "max_seq_len", "max_extend_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, 1.0])
def test_every_config_size_must_be_a_positive_int(name: str, value: object) -> None:
    sizes = {"page_size": 1, "num_pages": 1, "max_running_reqs": 1, "max_seq_len": 2, "max_extend_tokens": 1}
    with pytest.raises(CacheError) as raised:
        SchedulerConfig(**{**sizes, name: value}).check()  # type: ignore[arg-type]
    assert str(raised.value) == f"{name} must be an int >= 1, got {value!r}"
    SchedulerConfig(**sizes).check()


def test_check_request_names_the_prompt_and_counts_pages_from_nothing_allocated() -> None:
    with pytest.raises(InvalidInputError) as raised:
        check_request(CONFIG, set(), 1, [-1], 1)
    assert str(raised.value) == "input_ids[0] = -1 is outside [0, 2**63)"
    with pytest.raises(InvalidTypeError) as raised:
        check_request(CONFIG, set(), 1, "ab", 1)
    assert str(raised.value) == "input_ids must be a sequence of ints, got str"
    one = dataclasses.replace(CONFIG, page_size=1)  # 4 pages of 1 token
    assert check_request(one, set(), 1, [5] * 4, 1) == ([5] * 4, 1)  # positions [0, 4): 4 pages
    with pytest.raises(InvalidRequestError, match="^request 1 needs 5 pages, the pool has 4"):
        check_request(one, set(), 1, [5] * 5, 1)

"""The optimized cache as a fuzz target: the input formats it draws."""

from __future__ import annotations

import pytest


def test_the_optimized_target_gives_each_format_only_values_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values past int32 (or int64) go as a list: never through torch's overflow, a C++ throw that aborts a
    campaign under the preloaded ASan runtime (python -m tools.sanitize)."""
    import torch

    from radixspec.fuzz.targets import ours_optimized as ours

    real_tensor = torch.tensor

    def checked_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        bits = 32 if dtype == torch.int32 else 64
        assert all(-(2 ** (bits - 1)) <= v < 2 ** (bits - 1) for v in values), f"{values} past {dtype}"
        return real_tensor(values, dtype=dtype)

    monkeypatch.setattr(ours.torch, "tensor", checked_tensor)
    target = ours.OptimizedCache(1)
    for shift in range(len(ours.INPUT_FORMATS)):
        target.calls = shift
        for values in ([0, 2**31], [2**63, 1], [-(2**31) - 1], [5, 6]):
            converted = target.convert(list(values))
            assert [int(v) for v in converted] == values
    assert ours.fits([2**31 - 1, -(2**31)], 32) and not ours.fits([2**31], 32) and not ours.fits([True], 64)

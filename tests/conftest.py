"""Load the Hypothesis profile named by HYPOTHESIS_PROFILE (``ci`` under CI) before any test class is built;
run every test in its own temporary directory, so that the suite writes nothing into the checkout (a campaign's
default ``--out fuzz-failures``, a wheel's ``build/``) and nothing into the user's CUDA build cache."""

import pytest

from fuzz.profiles import load_from_env

load_from_env()


@pytest.fixture(autouse=True)
def _write_only_under_tmp_path(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # a directory of its own (the test's tmp_path stays empty for the test)
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("RADIXSPEC_CACHE", str(cwd / "radixspec-cache"))

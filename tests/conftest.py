"""Load the Hypothesis profile named by HYPOTHESIS_PROFILE (``ci`` under CI) before any test class is built;
let the suite write nothing into the checkout or the user's caches: every test runs in a temporary directory of
its own (a campaign's default ``--out fuzz-failures``, a wheel's ``build/``), the CUDA build cache is a
temporary one, and so are Hypothesis's storage (``.hypothesis/``) and pytest-benchmark's (``.benchmarks/``)
unless a run names its own (``make bench`` saves under ``.benchmarks/``)."""

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from radixspec.fuzz.profiles import load_from_env


def _temporary_directory(prefix: str) -> str:
    """A directory removed when the process exits (each xdist worker makes its own): runs must not pile up
    directories under the system's temporary folder."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


set_hypothesis_home_dir(_temporary_directory("radixspec-hypothesis-"))
load_from_env()

BENCHMARK_STORAGE_DEFAULT = "file://./.benchmarks"


def pytest_report_header(config: pytest.Config) -> str:
    import radixspec.fuzz

    return f"radixspec under test: {Path(radixspec.fuzz.__file__).parent}"


def pytest_configure(config: pytest.Config) -> None:
    # .ci/installed runs the suite against the wheel: a run that imports the checkout's radixspec instead tests
    # something else than it says
    if os.environ.get("RADIXSPEC_TEST_INSTALLED") == "1":
        import radixspec.fuzz

        where = Path(radixspec.fuzz.__file__).resolve()
        if "site-packages" not in where.parts:
            raise pytest.UsageError(f"RADIXSPEC_TEST_INSTALLED=1 but radixspec is imported from {where}")
    # runs before pytest-benchmark's own (trylast), which creates its storage folder
    if config.getoption("benchmark_storage", None) == BENCHMARK_STORAGE_DEFAULT:
        config.option.benchmark_storage = f"file://{_temporary_directory('radixspec-benchmarks-')}"


@pytest.fixture(autouse=True)
def _write_only_under_tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # a directory of its own (the test's tmp_path stays empty for the test), through a MonkeyPatch of its own
    # (a test's monkeypatch.undo() must not take the test back into the checkout)
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        patch.setenv("RADIXSPEC_CACHE", str(cwd / "radixspec-cache"))
        yield

"""What an install gets: one wheel, built once from a copy of the checkout, read as pip would install it."""

import email
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools writes build/ beside the sources, and the checkout stays as it was
    source = tmp / "source"
    ignore = (".git", ".venv", ".tox", "build", "*.egg-info", "__pycache__", ".hypothesis", "fuzz-failures", "*.so")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*ignore))
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w"]
    proc = subprocess.run([*command, str(tmp)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (built,) = tmp.glob("radixspec-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [entry for entry in wheel.namelist() if entry.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


def test_a_wheel_adds_one_top_level_import_name(wheel: zipfile.ZipFile) -> None:
    tops = {entry.split("/")[0] for entry in wheel.namelist() if not entry.split("/")[0].endswith(".dist-info")}
    assert tops == {"radixspec"}
    assert dist_info(wheel, "top_level.txt").split() == ["radixspec"]


def test_a_wheel_holds_the_four_layers_and_the_face_but_no_maintainer_tool(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for module in ("spec/prefix_cache.py", "reference/radix_cache.py", "optimized/radix_cache.py", "fuzz/campaign.py"):
        assert f"radixspec/{module}" in names
    assert {"radixspec/py.typed", "radixspec/__init__.py", "radixspec/__main__.py"} <= names
    assert any(name.startswith("radixspec/optimized/_radix_c") for name in names), "the C tree is not built in"
    assert any(name.startswith("radixspec/optimized/_hotpath.cpython") for name in names), "the hot path is not built"
    assert "radixspec/optimized/_hotpath.pyi" in names, "the hot path's types are not shipped"
    for tool in ("mutate_c", "mutation_sample", "mutation_report", "sanitize", "planted"):
        assert not any(name.endswith(f"/{tool}.py") for name in names), f"{tool} is a maintainer tool (tools/)"


def test_a_wheel_carries_the_cuda_sources(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert {f"radixspec/optimized/csrc/{name}" for name in ("store.cu", "store_cuda.h", "store_status.h")} <= names


def test_a_wheel_has_its_license_its_console_script_and_no_dev_pin(wheel: zipfile.ZipFile) -> None:
    metadata = email.message_from_string(dist_info(wheel, "METADATA"))
    assert metadata["License-Expression"] == "Apache-2.0"
    assert any(entry.endswith(".dist-info/licenses/LICENSE") for entry in wheel.namelist())
    assert "radixspec = radixspec.fuzz.commands:main" in dist_info(wheel, "entry_points.txt")
    runtime = [req for req in metadata.get_all("Requires-Dist") or [] if "extra ==" not in req]
    for dev in ("pytest", "pytest-benchmark", "tox", "ruff", "mypy", "mutmut"):
        assert not any(req.split()[0].startswith(dev) for req in runtime), f"{dev} is a dev tool: {runtime}"
